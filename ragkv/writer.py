"""The step of the write path that the local job (ragkv.precompute) and every Ray actor
(ragkv.distributed) run, the same code for both:

    plan          documents -> chunks (THE chunker) -> entry keys (a chunk's gap/context entry and,
                  under PrecomputePolicy.lead, its lead entry); per distinct key: skipped (every
                  tier holds it), repaired (copied from a tier that holds it into those that lack
                  it) or to compute (a Job)
    write_chunks  batches of similar lengths (prefill.batches), one forward each, entries encoded and
                  written on a background thread while the next batch computes; a chunk another
                  process wrote meanwhile counts as skipped; STOP_AFTER consecutive write failures of
                  one cause stop the job (``stop_reason``)

Both take a ``Prefiller`` (ragkv.prefill): the keys, policy and encoding the read path looks up.
Every outcome goes through ``Tally.record`` (counts, and per key when ``Tally.keys`` is a list: what
a Ray actor hands back to the driver instead of any K/V).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Collection
from dataclasses import dataclass
from typing import NamedTuple

from ragkv.chunking import chunk_spans
from ragkv.keys import KEY_PREFIX
from ragkv.neighbours import neighbour_contexts
from ragkv.prefill import batches

STOP_AFTER = 3  # consecutive write failures of one cause that stop the job
_MAX_REPORTED_ERRORS = 20
OUTCOMES = ("new", "repaired", "skipped", "failed", "not_attempted")


class Job(NamedTuple):
    """One entry to compute: ``kind`` 'chunk' (behind the sink, the gap and ``context``) or 'lead'
    (right behind the sink; ``context`` empty). ragkv.keys.Keyspace.layout says what each kind is."""

    key: str
    ids: list[int]
    context: list[int]
    kind: str = "chunk"


def key_shard(key: str, n: int) -> int:
    """Shard of a chunk key: its blake2b digest mod n (stable across machines and runs)."""
    return int(key.removeprefix(KEY_PREFIX), 16) % n


@dataclass
class Outcome:
    key: str  # "" for a failure that has no key (a document that could not be chunked)
    outcome: str  # one of OUTCOMES
    tokens: int = 0  # cached tokens written (new only)
    nbytes: int = 0  # bytes written (new only)
    kind: str = "chunk"  # the entry's kind (Job.kind): a chunk counts once, by its 'chunk' entry


class Tally:
    """The counters of a PrecomputeSummary-like object (``summary``), updated under one lock; with
    ``keep_keys`` every outcome is also kept per key in ``keys`` (list of Outcome)."""

    def __init__(self, summary, keep_keys: bool = False):
        self.summary = summary
        self.keys: list[Outcome] | None = [] if keep_keys else None
        self.lock = threading.Lock()

    def record(self, key: str, outcome: str, tokens: int = 0, nbytes: int = 0, kind: str = "chunk") -> None:
        s = self.summary
        with self.lock:
            if outcome == "new":
                s.new, s.tokens, s.bytes_written = s.new + 1, s.tokens + tokens, s.bytes_written + nbytes
            elif outcome != "not_attempted":
                setattr(s, outcome, getattr(s, outcome) + 1)
            if self.keys is not None:
                self.keys.append(Outcome(key, outcome, tokens, nbytes, kind))

    def note(self, msg: str) -> None:
        with self.lock:
            if len(self.summary.errors) < _MAX_REPORTED_ERRORS:
                self.summary.errors.append(msg)


def triage(store, key: str) -> str:
    """'skipped' (every tier holds a valid entry), 'repaired' (copied from the tier that holds it
    into those that lack it) or 'todo'."""
    lacking = len(store.missing_tiers(key))
    if lacking == 0:
        return "skipped"
    if lacking < len(store.tiers) and store.fill(key):
        return "repaired"
    return "todo"


def plan(prefiller, docs, chunk_tokens: int, shard, tally: Tally, bar=None,
         keys: Collection[str] | None = None) -> list[Job]:
    """Chunk every document and triage each entry of each distinct chunk of ``shard`` ((I, N) or
    None, by the chunk's key: a chunk's entries stay together; and among ``keys`` when given, chunk
    keys): the entries to compute. ``summary.chunks`` = distinct chunks seen.

    Under ``context=k`` a chunk's context is its k nearest chunks among every chunk of ``docs`` (all
    shards: every shard of one corpus picks the same neighbours); otherwise it is empty."""
    template, store, keyspace = prefiller.template, prefiller.store, prefiller.keys
    seen: set[str] = set()
    pool: dict[str, list[int]] = {}  # every distinct chunk of the corpus, for neighbours
    todo: list[Job] = []
    done_chars = 0
    for doc_id, text in docs:
        try:
            spans = chunk_spans(text, template, chunk_tokens,
                                progress=None if bar is None else lambda c, d=done_chars: bar.update(d + c - bar.n))
        except Exception as e:  # one pathological document must not stop the corpus
            tally.record("", "failed")
            tally.note(f"chunking {doc_id}: {type(e).__name__}: {e}")
            continue
        done_chars += len(text)
        if bar is not None:
            bar.update(done_chars - bar.n)
            bar.set_postfix_str(f"{len(seen)} chunks", refresh=False)
        for s, e in spans:
            ids = template.chunk_ids(text[s:e])
            key = keyspace.chunk_key(ids)
            if keyspace.context:
                pool.setdefault(key, ids)
            if (shard and key_shard(key, shard[1]) != shard[0]) or (keys is not None and key not in keys) or key in seen:
                continue
            seen.add(key)
            for entry, kind in keyspace.entry_keys(ids):
                verdict = triage(store, entry)
                if verdict == "todo":
                    todo.append(Job(entry, ids, [], kind))
                else:
                    tally.record(entry, verdict, kind=kind)
    tally.summary.chunks = len(seen)
    gap_jobs = [j for j in todo if j.kind == "chunk"]
    if not keyspace.context or not gap_jobs:
        return todo
    contexts = iter(neighbour_contexts([j.ids for j in gap_jobs], list(pool.values()), keyspace.context))
    return [j._replace(context=next(contexts)) if j.kind == "chunk" else j for j in todo]


class EntryWriter:
    """Encodes and writes entries on one background thread; ``submit`` blocks when ``depth`` batches
    are already waiting (bounds memory). ``stop_reason`` is set after STOP_AFTER consecutive write
    failures of one cause; the job then stops submitting."""

    def __init__(self, prefiller, tally: Tally, on_done, depth: int = 1):
        self.prefiller, self.tally, self.on_done = prefiller, tally, on_done
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.stop_reason: str | None = None
        self.written: set[str] = set()  # keys given an outcome here
        self._streak: tuple[str, int] = ("", 0)
        self.thread = threading.Thread(target=self._run, name="ragkv-precompute-writer", daemon=True)
        self.thread.start()

    def submit(self, batch, kvs) -> None:
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
        pf = self.prefiller
        while (item := self.q.get()) is not None:
            batch, kvs = item
            for (key, ids, _, kind), kv in zip(batch, kvs):
                if self.stop_reason:  # stopping: the rest is left for the rerun, not attempted
                    break
                self.written.add(key)
                try:
                    wrote = pf.write(key, ids, kv, kind)
                    if not wrote and pf.store.missing_tiers(key):  # e.g. every tier failed (logged)
                        raise RuntimeError("the store took nothing (see its log)")
                except Exception as e:  # a failed write never aborts the job by itself
                    self._failed(key, kind, e)
                    continue
                self._streak = ("", 0)
                # 0 bytes: another process wrote it meanwhile
                self.tally.record(key, "new" if wrote else "skipped", len(ids) if wrote else 0, wrote, kind)
                self.on_done(1, len(ids) if wrote else 0)
            del kvs

    def _failed(self, key: str, kind: str, e: Exception) -> None:
        cause = type(e).__name__ + str(getattr(e.__cause__, "errno", "") or "")
        self.tally.record(key, "failed", kind=kind)
        self.tally.note(f"write of {key}: {type(e).__name__}: {e}")
        n = self._streak[1] + 1 if self._streak[0] == cause else 1
        self._streak = (cause, n)
        if n >= STOP_AFTER and self.stop_reason is None:
            self.stop_reason = f"{n} writes in a row failed with {type(e).__name__}: {e}"
        self.on_done(1, 0)


def job_batches(todo: list[Job], sink_len: int, batch_tokens: int) -> list[list[Job]]:
    """The jobs in forward batches (prefill.batches): one kind per batch, similar lengths together."""
    out = []
    for kind in ("chunk", "lead"):
        jobs = [j for j in todo if j.kind == kind]
        out += [[jobs[i] for i in group]
                for group in batches([len(j.ids) + len(j.context) for j in jobs], sink_len, batch_tokens)]
    return out


def write_chunks(prefiller, todo: list[Job], batch_tokens: int, tally: Tally,
                 on_done=lambda n_entries, n_tokens: None):
    """Prefill (as its kind, behind its context) and write every Job of ``todo``; -> the stop reason
    (None: every entry was attempted). Entries left unattempted by a stop are recorded as 'not_attempted'."""
    writer = EntryWriter(prefiller, tally, on_done)
    try:
        for batch in job_batches(todo, len(prefiller.keys.sink_ids), batch_tokens):
            if writer.stop_reason:
                break
            try:
                kvs = prefiller.prefill([j.ids for j in batch], batch[0].kind, [j.context for j in batch],
                                        batch_tokens)
            except Exception as e:
                for key, _, _, kind in batch:
                    writer.written.add(key)
                    tally.record(key, "failed", kind=kind)
                tally.note(f"prefill of {len(batch)} chunks: {type(e).__name__}: {e}")
                on_done(len(batch), 0)
                continue
            writer.submit(batch, kvs)
            del kvs
    finally:
        writer.close()
    if writer.stop_reason:
        for key, _, _, kind in todo:
            if key not in writer.written:
                tally.record(key, "not_attempted", kind=kind)
    return writer.stop_reason
