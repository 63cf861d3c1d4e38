"""vLLM's own Llama, Qwen2 and Mistral model classes, made reachable by ragkv's connector.

ragkv's vLLM plugin (``plugin.register``, entry point ``vllm.general_plugins``) registers these
subclasses for their architectures, so vLLM builds them in every process that runs a model, the
default multi-process engine's workers included. They change nothing in vLLM's forward, weights or
kernels: an instance built under a config whose KV connector is RagKVConnector records itself
(weakly) so the connector's worker side in the same process can blend with its modules
(``blend_model``, then ragkv.integrations.vllm.layers.VllmLayers). Under any other config they are
vLLM's classes exactly.
"""

from __future__ import annotations

import weakref

from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.mistral import MistralForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

CONNECTOR = "RagKVConnector"
_live: weakref.WeakSet = weakref.WeakSet()  # blend-aware models of this process built for the connector


def uses_ragkv(vllm_config) -> bool:
    """Whether this vLLM config runs RagKVConnector."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    return ktc is not None and getattr(ktc, "kv_connector", None) == CONNECTOR


class BlendAware:
    """Mixin over a vLLM model class: records the instance for the connector, and gives ragkv's
    engine its layer interface (``ragkv_layers``, what ragkv.adapter.ModelAdapter.of returns)."""

    def __init__(self, *, vllm_config, prefix: str = "", **kwargs):
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        if uses_ragkv(vllm_config):
            _live.add(self)

    def ragkv_layers(self):
        """ragkv's layer interface over this model's own modules (raises UnsupportedModelError naming
        the vLLM version and what differs when its layers are not the ones VllmLayers repeats)."""
        from ragkv.integrations.vllm.layers import VllmLayers

        return VllmLayers(self)


class BlendLlamaForCausalLM(BlendAware, LlamaForCausalLM):
    pass


class BlendQwen2ForCausalLM(BlendAware, Qwen2ForCausalLM):
    pass


class BlendMistralForCausalLM(BlendAware, MistralForCausalLM):
    pass


def blend_model(vllm_config):
    """The blend-aware model this process built for ``vllm_config``: the one whose attention layers
    are the config's (``compilation_config.static_forward_context``). Raises RuntimeError saying why
    there is none."""
    context = vllm_config.compilation_config.static_forward_context
    found = [m for m in list(_live)
             if any(context.get(getattr(layer.self_attn.attn, "layer_name", None)) is layer.self_attn.attn
                    for layer in m.model.layers)]
    if len(found) == 1:
        return found[0]
    arch = (getattr(vllm_config.model_config.hf_config, "architectures", None) or ["?"])[0]
    if not found:
        raise RuntimeError(
            f"RagKVConnector blends with vLLM's own model, and this process's model ({arch}) is not ragkv's "
            "blend-aware subclass: ragkv's vLLM plugin registers one for LlamaForCausalLM, Qwen2ForCausalLM and "
            "MistralForCausalLM through the entry point 'ragkv' in group vllm.general_plugins. Install ragkv in "
            "vLLM's environment, and if VLLM_PLUGINS is set, include 'ragkv' in it")
    raise RuntimeError(f"{len(found)} blend-aware models share this config's attention layers")
