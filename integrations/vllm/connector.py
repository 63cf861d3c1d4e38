"""RagKVConnector: vLLM serves prompts built by ragkv's PromptTemplate from blended chunk K/V.

    LLM(model=DIR, dtype="bfloat16", enable_prefix_caching=False, kv_transfer_config={
        "kv_connector": "RagKVConnector", "kv_connector_module_path": "ragkv.integrations.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": "disk:///var/cache/ragkv", "ratio": 0.15}})

Only vLLM's public v1 KV-connector API (``KVConnectorBase_V1``) is used; vLLM is not patched.

Scheduler side: ``get_num_new_matched_tokens`` recognises the prompt from its ids (``PromptLayout``)
and offers its K/V (all but the last token, block-aligned) when the store holds its chunks (at least
``min_hit_fraction`` of their tokens); otherwise 0, vLLM prefills as usual, and the worker writes the
prompt's missing chunks back so the next prompt over them hits.
Worker side: ``start_load_kv`` blends each offered prompt with ragkv's engine (stored chunks fused +
selective recompute + suffix, ragkv.blend) and writes the K/V into vLLM's paged cache layer by
layer, through each attention layer's own ``impl.do_kv_cache_update`` with the slots of the
request's blocks. A blend that fails reports its blocks through ``get_block_ids_with_load_errors``,
so vLLM recomputes them (``kv_load_failure_policy="recompute"``).
Per request, ``SamplingParams(extra_args={"kv_transfer_params": {...}})`` may carry ``ragkv_ratio``
(this request's ratio) or ``ragkv_skip: True`` (vLLM's own prefill, e.g. a baseline);
``RequestOutput.kv_transfer_params["ragkv"]`` says what happened (chunks, hits, offered
tokens, and the worker's blend stats when they arrived before the request finished).
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
    offer: bool = False
    ratio: float | str | None = None

    def summary(self) -> dict:
        return {"recognised": self.recognised, "reason": self.reason, "chunks": len(self.chunk_lens),
                "hits": sum(self.stored), "misses": len(self.stored) - sum(self.stored), "offered": self.offer}


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
        self._need_load: dict[str, tuple[int, int]] = {}
        self._issued: set[str] = set()  # requests whose K/V were handed to a worker
        self._worker_stats: dict[str, dict] = {}
        # worker side
        self._step_stats: dict[str, dict] = {}
        self._failed_blocks: set[int] = set()

    def stats(self) -> dict:
        return dict(self.totals)

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
            return Plan(False, "not a prompt of ragkv's template")
        prompt, stored = parsed
        lens = [len(c) for c in prompt.chunk_ids]
        hit = sum(n for n, s in zip(lens, stored) if s)
        plan = Plan(True, "", len(prompt.prefix_ids), lens, stored)
        if len(token_ids) - 1 < self._block_size:
            plan.reason = f"prompt shorter than one block ({self._block_size} tokens)"
        elif hit == 0 or hit < self.settings.min_hit_fraction * sum(lens):
            plan.reason = f"{hit} of {sum(lens)} chunk tokens stored"
        else:
            plan.offer = True
        return plan

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        rid = request.request_id
        if rid not in self._plans:
            try:  # never fail the scheduler: a prompt the connector cannot read is vLLM's to prefill
                if (getattr(request, "kv_transfer_params", None) or {}).get("ragkv_skip"):
                    plan = Plan(False, "the request asked for vLLM's own prefill (ragkv_skip)")
                else:
                    plan = self.plan(list(request.prompt_token_ids or []))
                    plan.ratio = request_ratio(request)
            except Exception as e:
                log.warning("request %s is prefilled by vLLM: %s", rid, e)
                plan = Plan(False, f"{type(e).__name__}: {e}")
            self._plans[rid] = plan
            self.totals["requests"] += 1
            self.totals["recognised"] += self._plans[rid].recognised
        if not self._plans[rid].offer or rid in self._issued:
            return 0, False  # a request resumed after preemption is recomputed by vLLM
        end = (len(request.prompt_token_ids) - 1) // self._block_size * self._block_size
        return max(0, end - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        if num_external_tokens > 0:
            end = (len(request.prompt_token_ids) - 1) // self._block_size * self._block_size
            self._need_load[request.request_id] = (end - num_external_tokens, end)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = RagKVMetadata()
        for req in scheduler_output.scheduled_new_reqs:
            plan = self._plans.get(req.req_id)
            ids = list(req.prompt_token_ids or [])
            if req.req_id in self._need_load:
                start, end = self._need_load.pop(req.req_id)
                self._issued.add(req.req_id)
                meta.loads.append(LoadJob(req.req_id, ids, plan.prefix_len, plan.chunk_lens, start, end,
                                          list(req.block_ids[0]), plan.ratio))
                self.totals["offered"] += 1
                self.totals["offered_tokens"] += end - start
            elif plan is not None and plan.recognised and self.settings.write_back and not all(plan.stored):
                meta.write_backs.append(WriteBackJob(req.req_id, ids, plan.prefix_len, plan.chunk_lens,
                                                     plan.stored))
        return meta

    def update_connector_output(self, connector_output):
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(wm, RagKVWorkerMetadata):
            for rid, st in wm.stats.items():
                self._worker_stats[rid] = st
                self.totals["blended"] += "error" not in st
                self.totals["load_errors"] += "error" in st
                self.totals["hits"] += st.get("hits", 0)
                self.totals["misses"] += st.get("misses", 0)
                self.totals["corrupt"] += st.get("corrupt", 0)

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        plan = self._plans.pop(rid, None)
        self._need_load.pop(rid, None)
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
