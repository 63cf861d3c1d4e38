"""The connector's ragkv side: one BlendEngine per process over ragkv's own HF copy of vLLM's model.

vLLM's modules are never patched or called: ragkv loads the same model directory with transformers
(in vLLM's dtype), so the K/V it blends are the model's own, and writes them into vLLM's paged cache.
Memory cost: one more copy of the weights in every process that hosts a connector role (the engine
core process for the scheduler side, each worker for the worker side; one in all with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``), plus the blend's working set (the prompt's K/V in the model
dtype, a few activations of the recomputed rows).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from ragkv.blend import BlendConfig, BlendEngine
from ragkv.blend.config import DEFAULT_SELECTOR
from ragkv.store import open_store

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class ConnectorSettings:
    """``kv_connector_extra_config`` of RagKVConnector, checked."""

    store: str
    ratio: float | str = 0.15
    selector: str = DEFAULT_SELECTOR
    namespace: str = ""
    min_hit_fraction: float = 1.0  # share of chunk tokens that must be stored to offer the K/V
    write_back: bool = True  # prefill and store the chunks of prompts vLLM prefilled itself

    @classmethod
    def from_extra(cls, extra: dict | None) -> ConnectorSettings:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"RagKVConnector: unknown kv_connector_extra_config keys {unknown}; "
                             f"valid: {sorted(cls.__dataclass_fields__)}")
        if not extra.get("store"):
            raise ValueError("RagKVConnector needs kv_connector_extra_config['store'], a ragkv store URI "
                             "(e.g. 'disk:///var/cache/ragkv')")
        s = cls(**extra)
        BlendConfig(ratio=s.ratio, selector=s.selector)  # raises naming a bad ratio/selector
        if not 0.0 < float(s.min_hit_fraction) <= 1.0:
            raise ValueError(f"min_hit_fraction must lie in (0, 1], got {s.min_hit_fraction!r}")
        return s


_engines: dict[tuple, BlendEngine] = {}
_lock = threading.Lock()


def engine_for(model_path: str, dtype: torch.dtype, settings: ConnectorSettings) -> BlendEngine:
    """The process's engine for this model, dtype and store (built once, shared by both roles when
    the scheduler and the worker live in one process)."""
    from ragkv.models import load

    key = (model_path, str(dtype), settings.store, settings.namespace, settings.selector, str(settings.ratio))
    with _lock:
        eng = _engines.get(key)
        if eng is None:
            model, tok = load(model_path, dtype=dtype)
            eng = BlendEngine(model, tok, open_store(settings.store),
                              BlendConfig(ratio=settings.ratio, selector=settings.selector),
                              namespace=settings.namespace)
            _engines[key] = eng
        return eng
