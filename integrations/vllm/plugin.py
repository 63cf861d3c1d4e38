"""ragkv's vLLM plugin: entry point ``ragkv`` in group ``vllm.general_plugins`` (pyproject.toml).

vLLM calls ``register`` in every one of its processes before any model is built. It only registers:
ragkv's blend-aware subclasses of vLLM's Llama, Qwen2 and Mistral classes for their architecture
names (ragkv.integrations.vllm.models), and ragkv's subclass of vLLM's HF renderer for renderer
mode "hf" (ragkv.integrations.vllm.chat: chat requests with documents as ragkv chunks). Both behave
as vLLM's own classes unless RagKVConnector is configured. Nothing is registered on a vLLM release
the native blend was not checked against, nor over an architecture or renderer another plugin
already replaced (the connector then says why it cannot blend).
Turn the plugin off with vLLM's own switch: ``VLLM_PLUGINS`` set to a list without ``ragkv``.
"""

from __future__ import annotations

import logging

log = logging.getLogger("ragkv.vllm")

ARCHITECTURES = {  # architecture -> (vLLM's own class's module, ragkv's subclass)
    "LlamaForCausalLM": ("vllm.model_executor.models.llama", "BlendLlamaForCausalLM"),
    "Qwen2ForCausalLM": ("vllm.model_executor.models.qwen2", "BlendQwen2ForCausalLM"),
    "MistralForCausalLM": ("vllm.model_executor.models.mistral", "BlendMistralForCausalLM"),
}


def _registered_module(registry, arch: str) -> str | None:
    """The module vLLM's registry currently builds ``arch`` from (None when it cannot tell)."""
    entry = registry.models.get(arch)
    return getattr(entry, "module_name", None) or getattr(getattr(entry, "model_cls", None), "__module__", None)


def register() -> None:
    import vllm
    from ragkv.integrations.vllm.layers import TESTED_VLLM
    from vllm import ModelRegistry

    if not vllm.__version__.startswith(TESTED_VLLM):
        log.warning("ragkv: vLLM %s is not a release ragkv's native blend was checked against (%s); its model "
                    "classes are left alone", vllm.__version__, ", ".join(v + "x" for v in TESTED_VLLM))
        return
    for arch, (own, cls) in ARCHITECTURES.items():
        current = _registered_module(ModelRegistry, arch)
        if current not in (own, __package__ + ".models"):
            log.warning("ragkv: %s is already replaced by %s; ragkv's blend-aware class is not registered",
                        arch, current)
            continue
        ModelRegistry.register_model(arch, f"{__package__}.models:{cls}")
    _register_renderer()


def _register_renderer() -> None:
    from vllm.renderers.registry import RENDERER_REGISTRY

    own, ours = ("vllm.renderers.hf", "HfRenderer"), (f"{__package__}.chat", "RagKVRenderer")
    current = RENDERER_REGISTRY.renderers.get("hf")
    if current not in (own, ours):
        log.warning("ragkv: vLLM's 'hf' renderer is already replaced by %s; chat documents are not laid out "
                    "as ragkv chunks", ".".join(current or ("?",)))
        return
    RENDERER_REGISTRY.renderers["hf"] = ours  # (its register() would warn about the replacement every start)
