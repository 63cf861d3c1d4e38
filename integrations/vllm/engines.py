"""What each side of the connector runs on, built from vLLM's config; no transformers model anywhere.

    scheduler   SchedulerKeys: the store, the prompt template (tokenizer) and the Keyspace of the
                model's fingerprint read from the checkpoint files in milliseconds
                (ragkv.fingerprint.fingerprint_dir: the same keys the HF engine and ragkv precompute make)
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
from ragkv.blend.config import CHAT_SELECTOR
from ragkv.fingerprint import fingerprint_dir
from ragkv.keys import Keyspace
from ragkv.policy import PrecomputePolicy
from ragkv.prompt import PromptTemplate
from ragkv.store import open_store


@dataclass(frozen=True)
class ConnectorSettings:
    """``kv_connector_extra_config`` of RagKVConnector, checked."""

    store: str
    ratio: float | str = 0.15
    selector: str = CHAT_SELECTOR  # chats with a system prompt of their own (ragkv.blend.config)
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


@dataclass
class SchedulerKeys:
    """What the scheduler side looks chunks up with: no model, no weights in memory."""

    store: object
    template: PromptTemplate
    keys: Keyspace
    max_positions: int | None


def model_fingerprint(vllm_config):
    """The fingerprint of vLLM's model as it runs (its checkpoint, dtype and config; milliseconds)."""
    mc = vllm_config.model_config
    return fingerprint_dir(mc.model, mc.dtype, config=mc.hf_config)


def scheduler_keys(vllm_config, settings: ConnectorSettings, tokenizer=None) -> SchedulerKeys:
    """The scheduler side's lookup keys for vLLM's model: equal to the worker engine's."""
    mc = vllm_config.model_config
    template = PromptTemplate.for_tokenizer(tokenizer or tokenizer_of(vllm_config))
    max_positions = getattr(mc.hf_config, "max_position_embeddings", None)
    policy = PrecomputePolicy().resolve(max_positions)
    keys = Keyspace.for_template(model_fingerprint(vllm_config), template, policy, settings.namespace)
    return SchedulerKeys(open_store(settings.store), template, keys, max_positions)


def worker_engine(model, vllm_config, settings: ConnectorSettings, tokenizer=None) -> BlendEngine:
    """A BlendEngine over vLLM's own ``model`` (ragkv.integrations.vllm.models.blend_model; its
    layers through ``model.ragkv_layers()``). Raises UnsupportedModelError naming the vLLM version and
    what differs when its layers are not the ones VllmLayers repeats."""
    return BlendEngine(model, tokenizer or tokenizer_of(vllm_config), open_store(settings.store),
                       BlendConfig(ratio=settings.ratio, selector=settings.selector), namespace=settings.namespace,
                       model_fingerprint=model_fingerprint(vllm_config))
