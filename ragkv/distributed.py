"""``ragkv precompute --ray``: the precompute job on Ray Data, over one machine or a Ray cluster.

    driver     reads the documents (ragkv.sources: the same files_skipped/bad_lines report as the
               local job), packs them into work units of similar size, starts or joins Ray
    dataset    ray.data.from_items(units).map_batches(_PrecomputeActor, ActorPoolStrategy(size=N)):
               each actor loads the model ONCE (from the name/dir and dtype, never a pickled
               model), opens the store from its URI and runs ragkv.writer's plan + write_chunks on
               its units: the same keys, skip-if-stored and tier repair as the local job
    results    actors write K/V straight to the shared store and hand back only one small row per
               chunk (key, outcome, tokens, bytes): K/V never travels through the object store.
               The driver merges the rows by key (a chunk shared by two documents counts once, as
               in the local job) into the same PrecomputeSummary, JSON and exit codes

Documents are never split: a document's chunks depend on the whole text, so the unit of work is a
document, and one very long document runs on one actor. Ray is imported only here, only with
``--ray``; without it the error says ``pip install 'ragkv[ray]'``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable

from ragkv.precompute import OverBudget, PrecomputeSummary, check_job_args, entry_bytes
from ragkv.sources import Report, read_documents
from ragkv.spec import EngineSpec
from ragkv.writer import OUTCOMES, Tally, plan, write_chunks

_RANK = {o: len(OUTCOMES) - i for i, o in enumerate(OUTCOMES)}  # new > repaired > skipped > failed > ...
UNITS_PER_WORKER = 4  # work units per actor: enough to balance documents of unequal length


def _import_ray():
    try:
        import ray
        import ray.data
    except ImportError as e:
        raise RuntimeError(f"--ray needs Ray Data ({e}): pip install 'ragkv[ray]'") from None
    return ray


def check_shared_store(store, allow_eviction: bool) -> None:
    """--ray writes from many processes: a memory tier would be lost with each actor, and a bounded
    tier's budget cannot be checked before the actors compute."""
    from ragkv.store.memory import MemoryStore

    for tier in store.tiers:
        if isinstance(tier, MemoryStore):
            raise ValueError(f"{tier.uri}: a memory store lives inside one process; --ray needs a store every "
                             "worker shares (redis://, redis+cluster://, or disk:// on a shared filesystem)")
        limit = getattr(tier, "max_bytes", None)
        if limit is not None and not allow_eviction:
            raise OverBudget(
                f"{tier.uri} is bounded (max_bytes={limit}) and --ray cannot check the corpus against it before "
                "computing (each worker plans only its own documents). Give the disk store max_bytes=none, or "
                "pass --allow-eviction to write anyway (eviction is per machine, never coordinated across them)")


def units(docs: list[tuple[str, str]], n_units: int) -> list[dict]:
    """Documents packed in order into about ``n_units`` units of similar character counts; each unit
    is one Ray row {"docs": JSON [[doc_id, text], ...]}."""
    target = max(1, sum(len(t) for _, t in docs) // max(1, n_units))
    out, cur, size = [], [], 0
    for doc in docs:
        cur.append(doc)
        size += len(doc[1])
        if size >= target:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return [{"docs": json.dumps(u)} for u in out]


class _PrecomputeActor:
    """One Ray actor: one model, loaded once; plans and writes the chunks of its work units."""

    def __init__(self, spec: EngineSpec, chunk_tokens: int, batch_tokens: int, threads: int):
        import torch

        torch.set_num_threads(max(1, threads))
        self.prefiller = spec.prefiller()
        self.size = entry_bytes(self.prefiller)  # planned bytes of a chunk to compute, as the local job counts
        self.chunk_tokens, self.batch_tokens = chunk_tokens, batch_tokens
        self.stop_reason: str | None = None

    def __call__(self, batch: dict) -> dict:
        summary = PrecomputeSummary()
        tally = Tally(summary, keep_keys=True)
        planned: dict[str, int] = {}
        for unit in batch["docs"]:
            docs = [tuple(d) for d in json.loads(unit)]
            todo = plan(self.prefiller, docs, self.chunk_tokens, None, tally)
            planned.update((j.key, self.size(len(j.ids))) for j in todo)
            if self.stop_reason:  # this actor stopped after repeated write failures: leave the rest
                for key, _, _, kind in todo:
                    tally.record(key, "not_attempted", kind=kind)
            else:
                self.stop_reason = write_chunks(self.prefiller, todo, self.batch_tokens, tally)
        rows = [(o.key, o.outcome, o.tokens, o.nbytes, planned.get(o.key, 0), "", o.kind) for o in tally.keys]
        rows += [("", "note", 0, 0, 0, e, "") for e in summary.errors]
        if self.stop_reason:
            rows.append(("", "stopped", 0, 0, 0, self.stop_reason, ""))
        cols = ("key", "outcome", "tokens", "bytes", "planned", "note", "kind")
        return {c: [r[i] for r in rows] for i, c in enumerate(cols)}


def merge(rows: Iterable[dict], summary: PrecomputeSummary) -> None:
    """The actors' rows -> summary: per key the best outcome (a chunk of two documents, or written
    by two actors at once, counts once); failures without a key (a document that could not be
    chunked) each count; a chunk counts once (by its 'chunk' entry, not its lead entry); the first
    stop reason stops the job."""
    best: dict[str, dict] = {}
    stops: list[str] = []
    tally = Tally(summary)
    for r in rows:
        if r["outcome"] == "note":
            tally.note(r["note"])
        elif r["outcome"] == "stopped":
            stops.append(r["note"])
        elif not r["key"]:
            tally.record("", r["outcome"])
        elif r["key"] not in best or _RANK[r["outcome"]] > _RANK[best[r["key"]]["outcome"]]:
            best[r["key"]] = r
    for r in best.values():
        tally.record(r["key"], r["outcome"], int(r["tokens"]), int(r["bytes"]), r["kind"])
    summary.planned_bytes = sum(int(r["planned"]) for r in best.values())
    summary.chunks = sum(r["kind"] == "chunk" for r in best.values())
    if stops:
        summary.stop(f"a worker stopped: {stops[0]}", sum(r["outcome"] == "not_attempted" for r in best.values()))


def precompute_ray(spec: EngineSpec, paths: Iterable[str | os.PathLike] = (), texts: Iterable[str] = (), *,
                   workers: int = 1, cpus_per_worker: int = 1, address: str | None = None,
                   chunk_tokens: int = 512, batch_tokens: int = 4096, allow_eviction: bool = False,
                   progress: bool = False) -> PrecomputeSummary:
    """The local ``precompute`` on Ray Data: ``workers`` actors of ``cpus_per_worker`` CPUs each.
    ``address``: None starts a new local Ray (or uses the one this process already joined), 'auto'
    or HOST:PORT joins a running cluster. The store (``spec.store_uri``) must be shared by every worker.
    Same keys, skip-if-stored resumability and summary as the local job."""
    from ragkv import models
    from ragkv.store import open_store

    t0 = time.perf_counter()
    check_job_args(chunk_tokens, batch_tokens)
    if workers < 1 or cpus_per_worker < 1:
        raise ValueError(f"workers and cpus_per_worker must be >= 1, got {workers} and {cpus_per_worker}")
    spec = spec.resolved()
    with open_store(spec.store_uri) as store:  # fail here, not in N actors: bad URI, unreachable store
        for tier in store.tiers:
            tier.check()
        check_shared_store(store, allow_eviction)
    models.load_tokenizer(spec.model)  # an unknown model fails here, clearly (ModelNotFoundError)
    ray = _import_ray()

    summary = PrecomputeSummary()
    docs = read_documents(paths, texts, Report(summary.files_skipped, summary.bad_lines))
    summary.docs = len(docs)
    if not docs:
        summary.seconds = time.perf_counter() - t0
        return summary
    started = _start_ray(ray, address, progress)
    try:
        _run(ray, docs, spec, summary, workers, chunk_tokens, batch_tokens, cpus_per_worker, progress)
    finally:
        if started:
            ray.shutdown()
    summary.seconds = time.perf_counter() - t0
    summary.tokens_per_s = summary.tokens / summary.seconds if summary.seconds > 0 else 0.0
    return summary


def _start_ray(ray, address: str | None, progress: bool) -> bool:
    """Start (address None: a new local Ray of our own, even where `ray start` left a maybe stale
    default cluster) or join Ray unless this process already has; -> whether it was started here."""
    if ray.is_initialized():
        return False
    try:
        ray.init(address=address or "local", include_dashboard=False, log_to_driver=progress)
    except Exception as e:  # e.g. --ray-address auto with no `ray start` on this machine
        where = f"join Ray at {address}" if address else "start a local Ray"
        raise RuntimeError(f"cannot {where}: {type(e).__name__}: {e}") from None
    return True


def _run(ray, docs, spec: EngineSpec, summary: PrecomputeSummary, workers: int, chunk_tokens: int,
         batch_tokens: int, cpus_per_worker: int, progress: bool) -> None:
    """The Ray Data pipeline: work units -> an actor pool -> one row per entry, merged into ``summary``."""
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = progress
    ds = ray.data.from_items(units(docs, UNITS_PER_WORKER * workers)).map_batches(
        _PrecomputeActor,
        fn_constructor_kwargs={"spec": spec, "chunk_tokens": chunk_tokens, "batch_tokens": batch_tokens,
                               "threads": cpus_per_worker},
        compute=ray.data.ActorPoolStrategy(size=workers),
        batch_size=1,
        num_cpus=cpus_per_worker,
    )
    try:
        merge(ds.iter_rows(), summary)
    except ray.exceptions.RayError as e:  # e.g. an actor could not load the model or open the store
        raise RuntimeError(f"the Ray job failed: {e}") from None
