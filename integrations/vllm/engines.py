"""What each side of the connector runs on, built from vLLM's config; no transformers model anywhere.

    scheduler   ChunkKeys: the store, the prompt template (tokenizer) and the model's fingerprint
                digest read from the checkpoint files (ragkv.integrations.vllm.keys)
    worker      BlendEngine over vLLM's own model in this process (the blend-aware class the plugin
                registered, ragkv.integrations.vllm.models), through VllmLayers: the selective
                recompute runs vLLM's modules, weights and kernels

Memory: no second copy of the weights. The worker's blend holds the prompt's K/V in the model dtype
(2 x layers x kv_heads x head_dim x tokens x dtype bytes; SmolLM2 fp32: 46 KB/token) and the
recomputed rows' activations while it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from ragkv.blend import BlendConfig, BlendEngine
from ragkv.blend.config import DEFAULT_SELECTOR
from ragkv.integrations.vllm.keys import ChunkKeys, model_digest
from ragkv.store import open_store


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


def tokenizer_of(vllm_config):
    """The transformers tokenizer of vLLM's model (a tokenizer only: no weights are read)."""
    from transformers import AutoTokenizer

    mc = vllm_config.model_config
    return AutoTokenizer.from_pretrained(mc.tokenizer, local_files_only=True, revision=mc.tokenizer_revision)


def scheduler_keys(vllm_config, settings: ConnectorSettings, tokenizer=None) -> ChunkKeys:
    """The scheduler side's lookup keys for vLLM's model: equal to the worker engine's."""
    mc = vllm_config.model_config
    tok = tokenizer or tokenizer_of(vllm_config)
    return ChunkKeys.build(open_store(settings.store), tok, mc.hf_config, model_digest(mc.model, mc.dtype, tok),
                           settings.namespace)


def worker_engine(model, vllm_config, settings: ConnectorSettings, tokenizer=None) -> BlendEngine:
    """A BlendEngine over vLLM's own ``model`` (ragkv.integrations.vllm.models.blend_model). Raises
    UnsupportedModelError naming the vLLM version and what differs when its layers are not the
    ones VllmLayers repeats."""
    from ragkv.integrations.vllm.layers import VllmLayers

    mc = vllm_config.model_config
    tok = tokenizer or tokenizer_of(vllm_config)
    if not isinstance(getattr(model, "_ragkv_adapter", None), VllmLayers):
        model._ragkv_adapter = VllmLayers(model)  # what ragkv.adapter.ModelAdapter.of(model) returns
    return BlendEngine(model, tok, open_store(settings.store), BlendConfig(ratio=settings.ratio, selector=settings.selector),
                       namespace=settings.namespace, fingerprint=model_digest(mc.model, mc.dtype, tok))

