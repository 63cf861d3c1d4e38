"""The write path: chunk a corpus, prefill every chunk under the engine's precompute policy, store it.

    sources -> documents     .txt/.md files, .jsonl (one document per line, field "text"), folders
                             (recursive), or texts given directly; unreadable files are reported
                             and skipped, never fatal
    documents -> plan        chunk_document (THE chunker) -> template.chunk_ids -> key; keep the
                             keys of this shard, drop duplicates and keys already in the store
    plan -> store            batches of similar lengths through prefill_kv (one forward each); the
                             entries are encoded and written on a background thread while the next
                             batch computes

Keys and entry metadata come from a ``BlendEngine`` on the same model/tokenizer/store, so a chunk
written here is exactly what the read path looks up. Idempotent: a second run (or a run restarted
after ``kill -9``: the stores write atomically) computes only what is missing.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ragkv.blend import BlendConfig, BlendEngine
from ragkv.chunking import chunk_document
from ragkv.keys import KEY_PREFIX
from ragkv.policy import PrecomputePolicy
from ragkv.store.entry import encode

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl",)
_MAX_REPORTED_ERRORS = 20


@dataclass
class PrecomputeSummary:
    docs: int = 0  # documents read (a .jsonl line is one document)
    chunks: int = 0  # distinct chunks of this shard
    new: int = 0  # chunks computed and written by this run
    skipped: int = 0  # chunks already in the store (or written meanwhile by another process)
    failed: int = 0  # chunks whose prefill or write failed
    tokens: int = 0  # cached tokens of the new chunks
    bytes_written: int = 0
    seconds: float = 0.0
    tokens_per_s: float = 0.0  # tokens / seconds (the whole run: reading, chunking, prefill, writes)
    shard: str | None = None
    files_skipped: list[dict] = field(default_factory=list)  # {"path", "reason"}
    bad_lines: list[dict] = field(default_factory=list)  # {"path", "line", "reason"} of .jsonl files
    errors: list[str] = field(default_factory=list)  # the first few failures, for the operator

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        lines = [
            f"docs {self.docs}  chunks {self.chunks}  new {self.new}  skipped {self.skipped}  "
            f"failed {self.failed}" + (f"  (shard {self.shard})" if self.shard else ""),
            f"{self.tokens} tokens, {self.bytes_written / 2**20:.1f} MiB written in {self.seconds:.1f} s "
            f"({self.tokens_per_s:.0f} tokens/s)",
        ]
        for f in self.files_skipped:
            lines.append(f"skipped file {f['path']}: {f['reason']}")
        if self.bad_lines:
            lines.append(f"{len(self.bad_lines)} bad .jsonl line(s) skipped, e.g. "
                         f"{self.bad_lines[0]['path']}:{self.bad_lines[0]['line']}: {self.bad_lines[0]['reason']}")
        lines.extend(f"error: {e}" for e in self.errors)
        return "\n".join(lines)


# ----------------------------------------------------------------------------- pure helpers


def parse_shard(spec: str | tuple[int, int] | None) -> tuple[int, int] | None:
    """'I/N' (or (I, N)) -> (I, N) with 0 <= I < N; None -> None."""
    if spec is None:
        return None
    if isinstance(spec, str):
        parts = spec.strip().split("/")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"shard {spec!r}: expected I/N with integers 0 <= I < N, e.g. 0/4")
        spec = (int(parts[0]), int(parts[1]))
    i, n = spec
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"shard {i}/{n}: need N >= 1 and 0 <= I < N")
    return i, n


def key_shard(key: str, n: int) -> int:
    """Shard of a chunk key: its blake2b digest mod n (stable across machines and runs)."""
    return int(key.removeprefix(KEY_PREFIX), 16) % n


def _decode_file(raw: bytes) -> tuple[str | None, str | None]:
    """(text, None) or (None, reason)."""
    if not raw.strip():
        return None, "empty"
    if b"\x00" in raw[:8192]:
        return None, "binary (NUL bytes)"
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        return None, f"not UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})"
    if not text.strip():
        return None, "empty"
    return text, None


def _walk(path: Path) -> Iterable[Path]:
    if path.is_dir():
        for root, dirs, files in os.walk(path):
            dirs.sort()
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            for name in sorted(files):
                if not name.startswith("."):
                    yield Path(root) / name
    else:
        yield path


def read_documents(sources: Iterable[str | os.PathLike], summary: PrecomputeSummary) -> list[tuple[str, str]]:
    """(doc id, text) of every source. ``Path`` objects are files or folders; ``str`` items are
    document texts. Unusable files go to ``summary.files_skipped``, bad .jsonl lines to
    ``summary.bad_lines``."""
    docs: list[tuple[str, str]] = []
    for n, src in enumerate(sources):
        if isinstance(src, str):
            if src.strip():
                docs.append((f"<text {n}>", src))
            else:
                summary.files_skipped.append({"path": f"<text {n}>", "reason": "empty"})
            continue
        root = Path(src)
        if not root.exists():
            summary.files_skipped.append({"path": str(root), "reason": "no such file or directory"})
            continue
        for p in _walk(root):
            suffix = p.suffix.lower()
            if suffix not in TEXT_SUFFIXES + JSONL_SUFFIXES:
                summary.files_skipped.append({"path": str(p), "reason": f"unsupported type {suffix or '(none)'}"})
                continue
            try:
                raw = p.read_bytes()
            except OSError as e:
                summary.files_skipped.append({"path": str(p), "reason": f"unreadable: {e.strerror or e}"})
                continue
            text, why = _decode_file(raw)
            if text is None:
                summary.files_skipped.append({"path": str(p), "reason": why})
                continue
            if suffix in TEXT_SUFFIXES:
                docs.append((str(p), text))
                continue
            found = 0
            for lineno, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    summary.bad_lines.append({"path": str(p), "line": lineno, "reason": f"invalid JSON: {e.msg}"})
                    continue
                t = obj.get("text") if isinstance(obj, dict) else None
                if not isinstance(t, str) or not t.strip():
                    summary.bad_lines.append({"path": str(p), "line": lineno,
                                              "reason": 'no non-empty string field "text"'})
                    continue
                docs.append((f"{p}:{lineno}", t))
                found += 1
            if not found:
                summary.files_skipped.append({"path": str(p), "reason": "no usable .jsonl line"})
    summary.docs = len(docs)
    return docs


@dataclass
class _Planned:
    key: str
    ids: list[int]


def _batches(chunks: Sequence[_Planned], sink_len: int, batch_tokens: int) -> list[list[_Planned]]:
    """Longest first; each batch fits ``batch_tokens`` padded tokens: what prefill_kv does in one
    forward, so one prefill_kv call per batch = one forward."""
    order = sorted(chunks, key=lambda c: -len(c.ids))
    out, i = [], 0
    while i < len(order):
        n = max(1, batch_tokens // (sink_len + len(order[i].ids)))
        out.append(order[i : i + n])
        i += n
    return out


# ----------------------------------------------------------------------------- the job


class _Writer:
    """Encodes and writes entries on one background thread; ``submit`` blocks when ``depth`` batches
    are already waiting (bounds memory)."""

    def __init__(self, engine: BlendEngine, summary: PrecomputeSummary, on_done, depth: int = 1):
        self.engine, self.summary, self.on_done = engine, summary, on_done
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="ragkv-precompute-writer", daemon=True)
        self.thread.start()

    def submit(self, batch: list[_Planned], kvs: list) -> None:
        while True:
            try:
                return self.q.put((batch, kvs), timeout=1.0)
            except queue.Full:
                if not self.thread.is_alive():
                    raise RuntimeError("the precompute writer thread died") from None

    def close(self) -> None:
        if self.thread.is_alive():
            self.q.put(None)
        self.thread.join()

    def _run(self) -> None:
        eng, s = self.engine, self.summary
        start = eng.chunk_start
        while (item := self.q.get()) is not None:
            batch, kvs = item
            for c, kv in zip(batch, kvs):
                try:
                    enc = encode(eng.entry_meta(c.key, c.ids, start, eng.policy_id), kv)
                    wrote = eng.store.put_encoded(c.key, enc)
                    if not wrote and not eng.store.contains(c.key):  # e.g. every tier failed (logged)
                        raise RuntimeError("the store took nothing (see its log)")
                except Exception as e:  # a failed write never aborts the job
                    with self.lock:
                        s.failed += 1
                        _note(s, f"write of {c.key}: {type(e).__name__}: {e}")
                    self.on_done(1, 0)
                    continue
                with self.lock:
                    if wrote:
                        s.new += 1
                        s.tokens += len(c.ids)
                        s.bytes_written += enc.nbytes
                    else:
                        s.skipped += 1
                self.on_done(1, len(c.ids) if wrote else 0)
            del kvs


def _note(s: PrecomputeSummary, msg: str) -> None:
    if len(s.errors) < _MAX_REPORTED_ERRORS:
        s.errors.append(msg)


def precompute(
    paths_or_texts: Iterable[str | os.PathLike] | str | os.PathLike,
    model,
    tokenizer,
    store,
    chunk_tokens: int = 512,
    *,
    storage_dtype: str | None = None,
    quant_axis: str | None = None,
    namespace: str = "",
    batch_tokens: int = 4096,
    shard: str | tuple[int, int] | None = None,
    policy: PrecomputePolicy | None = None,
    engine: BlendEngine | None = None,
    progress: bool = False,
) -> PrecomputeSummary:
    """Chunk, prefill and store every document; return what was done.

    ``paths_or_texts``: ``Path`` items are files/folders (.txt/.md/.jsonl), ``str`` items are
    document texts. ``store``: a KVStore or a store URI. ``storage_dtype``/``quant_axis``: how
    entries are stored (None: model dtype). ``shard`` 'I/N': only chunks whose key falls in shard I.
    ``engine``: the read path's engine to take keys and policy from (default: one built from the
    arguments, so that ``BlendEngine(model, tokenizer, store, namespace=namespace)`` finds them).
    """
    t0 = time.perf_counter()
    shard_t = parse_shard(shard)
    if isinstance(paths_or_texts, (str, os.PathLike)):
        paths_or_texts = [paths_or_texts]
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
    if isinstance(store, str):
        from ragkv.store import open_store

        store = open_store(store)
    if engine is None:
        cfg = BlendConfig(storage_dtype=storage_dtype, quant_axis=quant_axis)
        engine = BlendEngine(model, tokenizer, store, config=cfg, policy=policy, namespace=namespace)
        engine.entry_meta(KEY_PREFIX + "0" * 64, [0], 0, engine.policy_id)  # bad dtype/axis: fail before work
    summary = PrecomputeSummary(shard=None if shard_t is None else f"{shard_t[0]}/{shard_t[1]}")
    docs = read_documents(paths_or_texts, summary)

    # plan: chunk, key, shard, dedupe, skip what the store has
    template, seen, todo = engine.template, set(), []
    for doc_id, text in docs:
        try:
            chunks = chunk_document(text, template, chunk_tokens)
        except Exception as e:  # one pathological document must not stop the corpus
            summary.failed += 1
            _note(summary, f"chunking {doc_id}: {type(e).__name__}: {e}")
            continue
        for chunk in chunks:
            ids = template.chunk_ids(chunk)
            key = engine.chunk_key(ids)
            if (shard_t and key_shard(key, shard_t[1]) != shard_t[0]) or key in seen:
                continue
            seen.add(key)
            if store.contains(key):
                summary.skipped += 1
            else:
                todo.append(_Planned(key, ids))
    summary.chunks = len(seen)

    bar = None
    if progress and todo:
        from tqdm import tqdm

        bar = tqdm(total=len(todo), unit="chunk", desc="precompute", file=sys.stderr, mininterval=0.5,
                   dynamic_ncols=True)
    t_compute, tok_done = time.perf_counter(), [0]

    def on_done(n_chunks: int, n_tokens: int) -> None:
        if bar is not None:
            tok_done[0] += n_tokens
            bar.set_postfix_str(f"{tok_done[0] / max(time.perf_counter() - t_compute, 1e-9):.0f} tok/s",
                                refresh=False)
            bar.update(n_chunks)

    writer = _Writer(engine, summary, on_done)
    try:
        for batch in _batches(todo, len(engine.sink_ids), batch_tokens):
            try:
                kvs = engine.prefill_chunks([c.ids for c in batch], batch_tokens)
            except Exception as e:
                with writer.lock:
                    summary.failed += len(batch)
                    _note(summary, f"prefill of {len(batch)} chunks: {type(e).__name__}: {e}")
                on_done(len(batch), 0)
                continue
            writer.submit(batch, kvs)
            del kvs
    finally:
        writer.close()
        if bar is not None:
            bar.close()
    summary.seconds = time.perf_counter() - t0
    summary.tokens_per_s = summary.tokens / summary.seconds if summary.seconds > 0 else 0.0
    return summary
