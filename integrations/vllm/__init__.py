"""ragkv.integrations.vllm: vLLM serves prompts built by ragkv's PromptTemplate from blended chunk K/V.

    RagKVConnector   the KV connector (vLLM's public v1 API, no patch); loaded by vLLM from
                     kv_transfer_config={"kv_connector": "RagKVConnector",
                     "kv_connector_module_path": "ragkv.integrations.vllm", ...}
    PromptLayout     recognises a PromptTemplate prompt from its token ids (no vLLM needed)
    plugin.register  the vllm.general_plugins entry point: blend-aware subclasses of vLLM's Llama,
                     Qwen2 and Mistral classes, so the blend runs on vLLM's own model (layers.py)
    DocumentsMiddleware  `vllm serve --middleware ragkv.integrations.vllm.DocumentsMiddleware`: chat
                     ``documents`` as strings (vLLM's API types them as objects); with the plugin's
                     renderer (chat.py), a chat request's documents are ragkv chunks
    kv_transfer_config(store, ratio)   that dict, for LLM(...) or `--kv-transfer-config`
    CPU_MEMORY_UTILIZATION             gpu_memory_utilization for vLLM on CPU

Needs vLLM (``pip install ragkv[vllm]``); the layout works without it. See README.md beside this file.
"""

from ragkv.integrations.vllm.layout import PromptLayout

__all__ = ["CPU_MEMORY_UTILIZATION", "DocumentsMiddleware", "PromptLayout", "RagKVConnector", "kv_transfer_config"]

# On CPU, vLLM's gpu_memory_utilization is the share of one NUMA node's RAM it reserves; its 0.92
# default refuses to start when that node is partly in use (README.md beside this file).
CPU_MEMORY_UTILIZATION = 0.3


def kv_transfer_config(store: str, ratio: float | None = None) -> dict:
    """vLLM's kv_transfer_config for RagKVConnector over ``store`` (a ragkv store URI); ``ratio``:
    the connector's default recompute ratio (None: the connector's own default)."""
    extra = {"store": store} if ratio is None else {"store": store, "ratio": ratio}
    return {"kv_connector": "RagKVConnector", "kv_connector_module_path": "ragkv.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def __getattr__(name):
    if name == "RagKVConnector":
        from ragkv.integrations.vllm.connector import RagKVConnector

        return RagKVConnector
    if name == "DocumentsMiddleware":
        from ragkv.integrations.vllm.chat import DocumentsMiddleware

        return DocumentsMiddleware
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
