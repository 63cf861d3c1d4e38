"""The precompute job: chunk a corpus, prefill every chunk under the precompute policy, store it.

    sources -> documents     ragkv.sources: files, folders, .jsonl, texts; what cannot be used is
                             reported, never fatal
    documents -> plan        chunk_spans (THE chunker) -> template.chunk_ids -> key; keep the keys of
                             this shard, drop duplicates; a chunk every tier holds is skipped, one
                             that only some tiers hold is copied into the others (``repaired``)
    budget                   the planned bytes against each bounded tier's ``max_bytes``: a corpus
                             that cannot fit is refused before any compute (``allow_eviction``)
    plan -> store            batches of similar lengths (prefill.batches) through the prefiller, one
                             forward each; entries encoded and written on a background thread while
                             the next batch computes (Prefiller.write)

The plan and store steps live in ragkv.writer, shared with the Ray actors of ``--ray``
(ragkv.distributed): both paths key, skip, repair and write chunks with the same code.

Keys, policy and encoding come from the ``Prefiller`` the job is given (ragkv.prefill, the same the
read path writes its misses back with), so a chunk written here is
exactly what the read path looks up. Idempotent: a second run (or one restarted after ``kill -9``:
the stores write atomically) computes only what is missing. Repeated write failures of one cause
(disk full, store directory gone, Redis down) stop the job early with what was saved.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Collection, Iterable
from dataclasses import asdict, dataclass, field

from ragkv.keys import KEY_PREFIX
from ragkv.prefill import Prefiller
from ragkv.sources import Report, read_documents
from ragkv.store.entry import encode
from ragkv.writer import _MAX_REPORTED_ERRORS, STOP_AFTER, Tally, key_shard, plan, write_chunks

__all__ = ["STOP_AFTER", "OverBudget", "PrecomputeSummary", "key_shard", "parse_shard", "plan", "precompute"]


@dataclass
class PrecomputeSummary:
    docs: int = 0  # documents read (a .jsonl line is one document)
    chunks: int = 0  # distinct chunks of this shard
    # new .. failed count entries: per chunk its gap/context entry and, under PrecomputePolicy.lead,
    # its lead entry (two per chunk)
    new: int = 0  # entries computed and written by this run
    skipped: int = 0  # entries every tier already held (or written meanwhile by another process)
    repaired: int = 0  # entries copied from one tier into the tiers that lacked them
    failed: int = 0  # entries whose prefill or write failed (or chunks that could not be chunked)
    tokens: int = 0  # cached tokens of the new entries
    bytes_written: int = 0
    planned_bytes: int = 0  # estimated bytes of the chunks to compute, before computing
    seconds: float = 0.0
    tokens_per_s: float = 0.0  # tokens / seconds (the whole run: reading, chunking, prefill, writes)
    shard: str | None = None
    stopped: str | None = None  # why the job stopped before the end, and how to resume
    files_skipped: list[dict] = field(default_factory=list)  # {"path", "reason"}
    bad_lines: list[dict] = field(default_factory=list)  # {"path", "line", "reason"} of .jsonl files
    errors: list[str] = field(default_factory=list)  # the first few failures, for the operator

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        lines = [
            f"docs {self.docs}  chunks {self.chunks}  entries: new {self.new}  skipped {self.skipped}  "
            f"repaired {self.repaired}  failed {self.failed}" + (f"  (shard {self.shard})" if self.shard else ""),
            f"{self.tokens} tokens, {self.bytes_written / 2**20:.1f} MiB written in {self.seconds:.1f} s "
            f"({self.tokens_per_s:.0f} tokens/s)",
        ]
        for f in self.files_skipped:
            lines.append(f"skipped {f['path']}: {f['reason']}")
        if self.bad_lines:
            lines.append(f"{len(self.bad_lines)} bad .jsonl line(s) skipped, e.g. "
                         f"{self.bad_lines[0]['path']}:{self.bad_lines[0]['line']}: {self.bad_lines[0]['reason']}")
        lines.extend(f"error: {e}" for e in self.errors)
        if self.stopped:
            lines.append(f"STOPPED: {self.stopped}")
        return "\n".join(lines)

    def note(self, msg: str) -> None:
        if len(self.errors) < _MAX_REPORTED_ERRORS:
            self.errors.append(msg)

    def stop(self, reason: str, left: int) -> None:
        """The job stopped early after repeated write failures: say why and how to resume."""
        self.stopped = (f"{reason}. {self.new} entries were saved, {left} not attempted; fix the cause and "
                        "rerun the same command to resume (stored chunks are skipped)")


class OverBudget(ValueError):
    """The planned entries cannot fit a bounded tier: they would evict each other. ``summary``: the
    job's summary so far (what was read and planned), when there is one."""

    def __init__(self, message: str, summary: PrecomputeSummary | None = None):
        super().__init__(message)
        self.summary = summary


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


def check_job_args(chunk_tokens, batch_tokens) -> None:
    if not isinstance(chunk_tokens, int) or chunk_tokens < 16:
        raise ValueError(f"chunk_tokens must be an integer >= 16, got {chunk_tokens!r}")
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")


def entry_bytes(prefiller: Prefiller):
    """f(n_tokens) -> bytes of one chunk entry this prefiller writes (a linear fit of two encoded entries)."""
    import torch

    fp, sizes = prefiller.keys.fingerprint, []
    storage = prefiller.storage.resolve(fp.dtype)
    for n in (16, 32):
        kv = [(torch.zeros(fp.num_kv_heads, n, fp.head_dim),) * 2 for _ in range(fp.num_layers)]
        meta = prefiller.keys.meta(KEY_PREFIX + "0" * 64, [0] * n, "chunk", storage)
        sizes.append(encode(meta, kv).nbytes)
    per_token = (sizes[1] - sizes[0]) / 16
    return lambda n: int(sizes[0] + per_token * (n - 16))


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return ""


# ----------------------------------------------------------------------------- plan


def check_budget(prefiller: Prefiller, todo, summary: PrecomputeSummary, allow_eviction: bool) -> None:
    """Refuse (OverBudget) a plan whose entries cannot fit a bounded tier of the store."""
    size = entry_bytes(prefiller)
    summary.planned_bytes = sum(size(len(j.ids)) for j in todo)
    for tier in prefiller.store.tiers:
        limit = getattr(tier, "max_bytes", None)
        if limit is None or summary.planned_bytes <= limit or allow_eviction:
            continue
        dtype = prefiller.storage.resolve(prefiller.keys.fingerprint.dtype)[0]
        raise OverBudget(
            f"this run would write ~{_size(summary.planned_bytes)} of K/V ({len(todo)} entries stored as {dtype}) "
            f"but {tier.uri} holds at most {_size(limit)}: new entries would evict each other. Store a smaller "
            "dtype (--dtype int8 is ~4x smaller than float32), raise max_bytes, split the corpus (--shard) "
            "over several stores, or pass --allow-eviction to write anyway", summary)


# ----------------------------------------------------------------------------- the job


def precompute(
    prefiller: Prefiller,
    paths: Iterable[str | os.PathLike] = (),
    texts: Iterable[str] = (),
    *,
    chunk_tokens: int = 512,
    batch_tokens: int = 4096,
    shard: str | tuple[int, int] | None = None,
    keys: Collection[str] | None = None,
    allow_eviction: bool = False,
    progress: bool = False,
) -> PrecomputeSummary:
    """Chunk, prefill and store every document; return what was done.

    ``prefiller``: the model, tokenizer, store, policy, storage format and namespace (a BlendEngine's
    ``engine.prefiller``, or ``EngineSpec.prefiller()``): chunks are keyed and encoded exactly as the
    read path looks them up. ``paths``: files and folders
    (.txt/.md/.jsonl); ``texts``: document texts. ``shard`` 'I/N': only chunks whose key falls in
    shard I. ``keys``: only the chunks with these keys (e.g. those a question set uses); under
    ``context=k`` their neighbours still come from every document. Raises OverBudget (before computing) when the chunks cannot fit a bounded tier, unless
    ``allow_eviction``."""
    t0 = time.perf_counter()
    shard_t = parse_shard(shard)
    check_job_args(chunk_tokens, batch_tokens)
    summary = PrecomputeSummary(shard=None if shard_t is None else f"{shard_t[0]}/{shard_t[1]}")
    report = Report(summary.files_skipped, summary.bad_lines)
    docs = read_documents(paths, texts, report)
    summary.docs = len(docs)

    tally = Tally(summary)
    bar = _bar(progress, sum(len(t) for _, t in docs), "planning", "char")
    try:
        todo = plan(prefiller, docs, chunk_tokens, shard_t, tally, bar, keys=keys)
    finally:
        if bar is not None:
            bar.close()
    check_budget(prefiller, todo, summary, allow_eviction)
    skipped_at_plan = summary.skipped

    bar = _bar(progress and bool(todo), len(todo), "precompute", "entry")
    t_compute, tok_done = time.perf_counter(), [0]

    def on_done(n_entries: int, n_tokens: int) -> None:
        if bar is not None:
            tok_done[0] += n_tokens
            bar.set_postfix_str(f"{tok_done[0] / max(time.perf_counter() - t_compute, 1e-9):.0f} tok/s",
                                refresh=False)
            bar.update(n_entries)

    try:
        stop_reason = write_chunks(prefiller, todo, batch_tokens, tally, on_done)
    finally:
        if bar is not None:
            bar.close()
    if stop_reason:
        summary.stop(stop_reason, len(todo) - summary.new - summary.failed - (summary.skipped - skipped_at_plan))
    summary.seconds = time.perf_counter() - t0
    summary.tokens_per_s = summary.tokens / summary.seconds if summary.seconds > 0 else 0.0
    return summary


def _bar(enabled: bool, total: int, desc: str, unit: str):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, unit_scale=True, desc=desc, file=sys.stderr, mininterval=0.5,
                dynamic_ncols=True)
