"""RagKVConnector: vLLM serves prompts built by ragkv's PromptTemplate from blended chunk K/V.

    LLM(model=DIR, dtype="float32", kv_transfer_config={
        "kv_connector": "RagKVConnector", "kv_connector_module_path": "ragkv.integrations.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": "disk:///var/cache/ragkv", "ratio": 0.15}})

Only vLLM's public v1 KV-connector API (``KVConnectorBase_V1``) is used; vLLM is not patched. vLLM's
defaults stay on: prefix caching and chunked prefill.

Scheduler side: ``get_num_new_matched_tokens`` recognises the prompt from its ids (``PromptLayout``)
and, when the store holds its chunks (at least ``min_hit_fraction`` of their tokens), offers the
K/V vLLM's prefix cache lacks: from what vLLM holds (``num_computed_tokens``, e.g. a shared system
prompt) to the prompt's last full block before its last token; otherwise 0, vLLM prefills as usual,
and the worker writes the prompt's missing chunks back so the next prompt over them hits. Blended
blocks are kept out of vLLM's prefix cache (``prefix_cache.BlendedBlocks``), so vLLM never serves
them as its own K/V. What vLLM computes after the blend (the last partial block, the question) is
scheduled like any prefill, over several steps when it exceeds the chunked-prefill budget.
Worker side: ``start_load_kv`` blends each offered prompt with ragkv's engine (stored chunks fused +
selective recompute + suffix, ragkv.blend) and writes the offered range of every layer's K/V into
vLLM's paged cache, through each attention layer's own ``impl.do_kv_cache_update`` with the slots of
the request's blocks. A blend that fails reports its blocks through
``get_block_ids_with_load_errors``, so vLLM recomputes them (``kv_load_failure_policy="recompute"``).
Per request, ``SamplingParams(extra_args={"kv_transfer_params": {...}})`` may carry ``ragkv_ratio``
(this request's ratio), ``ragkv_skip: True`` (vLLM's own prefill, e.g. a baseline) or
``ragkv_prompt_tokens: n`` (the first n ids are the ragkv prompt, the rest a continuation vLLM
computes on top of the blend, e.g. a teacher-forced answer); ``RequestOutput.kv_transfer_params["ragkv"]``
says what happened (chunks, hits, ``vllm_cached``: the tokens vLLM's prefix cache held, ``written``:
the range the connector wrote, and the worker's blend stats when they arrived before the request
finished).
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from ragkv.blend import check_ratio
from ragkv.integrations.vllm.engines import ConnectorSettings, scheduler_keys, worker_engine
from ragkv.integrations.vllm.layout import PromptLayout
from ragkv.integrations.vllm.models import blend_model
from ragkv.integrations.vllm.prefix_cache import BlendedBlocks
from ragkv.integrations.vllm.writer import blend_and_write, write_back
from ragkv.store.errors import StoreError
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

log = logging.getLogger("ragkv.vllm")
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


@dataclass
class Plan:
    """The scheduler's reading of one prompt."""

    recognised: bool
    reason: str = ""
    prefix_len: int = 0
    chunk_lens: list[int] = field(default_factory=list)
    stored: list[bool] = field(default_factory=list)
    offer: bool = False  # the store holds its chunks: the connector offers what vLLM's cache lacks
    ratio: float | str | None = None
    length: int = 0  # tokens of the ragkv prompt (the request's own, or kv_transfer_params' ragkv_prompt_tokens)
    vllm_cached: int = 0  # tokens vLLM's prefix cache held (block-aligned), as the scheduler last reported
    load: tuple[int, int] | None = None  # the prompt range [start, end) the connector writes

    def end(self, block_size: int) -> int:
        """The offered range's end: all of the ragkv prompt but its last token, block-aligned."""
        return (self.length - 1) // block_size * block_size

    def summary(self) -> dict:
        reason = self.reason or ("vLLM's prefix cache held the range" if self.offer and self.load is None else "")
        out = {"recognised": self.recognised, "reason": reason, "chunks": len(self.chunk_lens),
               "hits": sum(self.stored), "misses": len(self.stored) - sum(self.stored),
               "offered": self.load is not None, "vllm_cached": self.vllm_cached}
        if self.load is not None:
            out["written"] = list(self.load)
        return out


@dataclass
class LoadJob:
    req_id: str
    token_ids: list[int]
    prefix_len: int
    chunk_lens: list[int]
    start: int  # write tokens [start, end) of the prompt
    end: int
    block_ids: list[int]
    ratio: float | str | None = None  # the request's own (kv_transfer_params["ragkv_ratio"]), else the config's


@dataclass
class WriteBackJob:
    req_id: str
    token_ids: list[int]
    prefix_len: int
    chunk_lens: list[int]
    stored: list[bool]


@dataclass
class RagKVMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    write_backs: list[WriteBackJob] = field(default_factory=list)


@dataclass
class RagKVWorkerMetadata(KVConnectorWorkerMetadata):
    stats: dict[str, dict] = field(default_factory=dict)  # req id -> blend stats

    def aggregate(self, other: RagKVWorkerMetadata) -> RagKVWorkerMetadata:
        return RagKVWorkerMetadata({**self.stats, **other.stats})


def request_ratio(request) -> float | str | None:
    """A request's own ratio: ``SamplingParams(extra_args={"kv_transfer_params": {"ragkv_ratio": r}})``."""
    params = getattr(request, "kv_transfer_params", None) or {}
    ratio = params.get("ragkv_ratio")
    return None if ratio is None else check_ratio(ratio, "kv_transfer_params['ragkv_ratio']")


def prompt_tokens(params: dict, n: int) -> int:
    """How many of a request's ``n`` prompt tokens are the ragkv prompt: all, or
    ``kv_transfer_params["ragkv_prompt_tokens"]`` (the rest is a continuation vLLM computes on top of
    the blend, e.g. a teacher-forced answer)."""
    k = params.get("ragkv_prompt_tokens")
    if k is None:
        return n
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
        raise ValueError(f"kv_transfer_params['ragkv_prompt_tokens'] must be an integer in [1, {n}], got {k!r}")
    return k


class RagKVConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = ConnectorSettings.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self._block_size = vllm_config.cache_config.block_size
        self.totals: Counter = Counter()  # this side's running counts (see stats())
        if role == KVConnectorRole.SCHEDULER:  # keys only: no model, no weights
            self.lookup = scheduler_keys(vllm_config, self.settings)
            self.layout = PromptLayout.for_template(self.lookup.template)
        else:  # vLLM built the model in this process before its connector (plugin: ragkv.integrations.vllm.models)
            self.engine = worker_engine(blend_model(vllm_config), vllm_config, self.settings)
        # scheduler side
        self._plans: dict[str, Plan] = {}
        self.guard = BlendedBlocks(block_size=self._block_size)  # keeps blended K/V out of vLLM's prefix cache
        self._issued: set[str] = set()  # requests whose K/V were handed to a worker
        self._worker_stats: dict[str, dict] = {}
        # worker side
        self._step_stats: dict[str, dict] = {}
        self._failed_blocks: set[int] = set()

    def stats(self) -> dict:
        return dict(self.totals)

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.guard.bind(kv_cache_manager)

    # ------------------------------------------------------------------ scheduler side

    def _stored(self, ids: list[int]) -> bool:
        try:
            return self.lookup.store.contains(self.lookup.keys.chunk_key(ids))
        except StoreError as e:
            log.warning("store lookup failed, counted as a miss: %s", e)
            return False

    def plan(self, token_ids: list[int]) -> Plan:
        """How the connector reads a prompt (no side effects but store lookups)."""
        parsed = self.layout.parse(token_ids, self._stored, self.lookup.max_positions)
        if parsed is None:
            return Plan(False, "not a prompt of ragkv's template", length=len(token_ids))
        prompt, stored = parsed
        lens = [len(c) for c in prompt.chunk_ids]
        hit = sum(n for n, s in zip(lens, stored) if s)
        plan = Plan(True, "", len(prompt.prefix_ids), lens, stored, length=len(token_ids))
        if len(token_ids) - 1 < self._block_size:
            plan.reason = f"prompt shorter than one block ({self._block_size} tokens)"
        elif hit == 0 or hit < self.settings.min_hit_fraction * sum(lens):
            plan.reason = f"{hit} of {sum(lens)} chunk tokens stored"
        else:
            plan.offer = True
        return plan

    def _plan_request(self, request) -> Plan:
        params = getattr(request, "kv_transfer_params", None) or {}
        ids = list(request.prompt_token_ids or [])
        if params.get("ragkv_skip"):
            return Plan(False, "the request asked for vLLM's own prefill (ragkv_skip)", length=len(ids))
        n = prompt_tokens(params, len(ids))
        plan = self.plan(ids[:n])
        plan.ratio = request_ratio(request)
        return plan

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """``num_computed_tokens``: what vLLM's own prefix cache holds of the prompt (block-aligned).
        The connector offers the rest of the ragkv prompt up to its last full block, never a token
        vLLM already has."""
        rid = request.request_id
        if rid not in self._plans:
            try:  # never fail the scheduler: a prompt the connector cannot read is vLLM's to prefill
                plan = self._plan_request(request)
            except Exception as e:
                log.warning("request %s is prefilled by vLLM: %s", rid, e)
                plan = Plan(False, f"{type(e).__name__}: {e}")
            self._plans[rid] = plan
            self.totals["requests"] += 1
            self.totals["recognised"] += plan.recognised
        plan = self._plans[rid]
        plan.vllm_cached = num_computed_tokens
        if not plan.offer or rid in self._issued:
            return 0, False  # a request resumed after preemption is recomputed by vLLM
        return max(0, plan.end(self._block_size) - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        if num_external_tokens > 0:
            plan = self._plans[request.request_id]
            end = plan.end(self._block_size)
            plan.load = (end - num_external_tokens, end)
            self.guard.watch(request.request_id, plan.load[0])

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = RagKVMetadata()
        for req in scheduler_output.scheduled_new_reqs:
            plan = self._plans.get(req.req_id)
            if plan is None:
                continue
            ids = list(req.prompt_token_ids or [])[:plan.length]
            if plan.load is not None and req.req_id not in self._issued:
                start, end = plan.load
                self._issued.add(req.req_id)
                meta.loads.append(LoadJob(req.req_id, ids, plan.prefix_len, plan.chunk_lens, start, end,
                                          list(req.block_ids[0]), plan.ratio))
                self.totals["offered"] += 1
                self.totals["offered_tokens"] += end - start
            elif plan.recognised and self.settings.write_back and not all(plan.stored):
                meta.write_backs.append(WriteBackJob(req.req_id, ids, plan.prefix_len, plan.chunk_lens,
                                                     plan.stored))
        self.guard.step()
        return meta

    def update_connector_output(self, connector_output):
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(wm, RagKVWorkerMetadata):
            for rid, st in wm.stats.items():
                if rid in self._plans:  # (a request already finished keeps nothing here)
                    self._worker_stats[rid] = st
                self.totals["blended"] += "error" not in st
                self.totals["load_errors"] += "error" in st
                self.totals["hits"] += st.get("hits", 0)
                self.totals["misses"] += st.get("misses", 0)
                self.totals["corrupt"] += st.get("corrupt", 0)

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        plan = self._plans.pop(rid, None)
        self.guard.finish(rid)
        self._issued.discard(rid)
        if plan is None:
            return False, None
        info = plan.summary()
        worker = self._worker_stats.pop(rid, None)
        if worker is not None:
            info["blend"] = worker
        return False, {"ragkv": info}

    # ------------------------------------------------------------------ worker side

    def _attention_layers(self, forward_context) -> list:
        layers = []
        for name, layer in forward_context.no_compile_layers.items():
            if getattr(layer, "kv_cache", None) is None or not hasattr(getattr(layer, "impl", None),
                                                                       "do_kv_cache_update"):
                continue
            m = _LAYER_INDEX.search("." + name + ".")
            if m:
                layers.append((int(m.group(1)), layer))
        layers.sort(key=lambda t: t[0])
        if [i for i, _ in layers] != list(range(self.engine.adapter.num_layers)):
            raise RuntimeError(f"vLLM's attention layers {[i for i, _ in layers]} do not match the model's "
                               f"{self.engine.adapter.num_layers} layers")
        return [layer for _, layer in layers]

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, RagKVMetadata) or not meta.loads:
            return
        layers = self._attention_layers(forward_context)
        for job in meta.loads:
            t0 = time.perf_counter()
            try:
                stats = blend_and_write(self.engine, job, layers, self._block_size)
                self.totals["blended"] += 1
            except Exception as e:  # the blocks are recomputed by vLLM
                log.exception("ragkv blend of request %s failed; vLLM recomputes it", job.req_id)
                first, last = job.start // self._block_size, (job.end - 1) // self._block_size
                self._failed_blocks.update(job.block_ids[first:last + 1])
                stats = {"error": f"{type(e).__name__}: {e}"}
                self.totals["load_errors"] += 1
            stats["t_connector"] = time.perf_counter() - t0
            self._step_stats[job.req_id] = stats

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv wrote every layer before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # chunks are written back from ragkv's own prefill (wait_for_save), not from vLLM's cache

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        if not isinstance(meta, RagKVMetadata):
            return
        for job in meta.write_backs:
            try:
                self.totals["written_back"] += write_back(self.engine, job)
            except Exception:
                log.exception("ragkv write-back of request %s failed", job.req_id)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self._step_stats:
            return None
        out, self._step_stats = RagKVWorkerMetadata(self._step_stats), {}
        return out
