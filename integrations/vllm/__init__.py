"""ragkv.integrations.vllm: vLLM serves prompts built by ragkv's PromptTemplate from blended chunk K/V.

    RagKVConnector   the KV connector (vLLM's public v1 API, no patch); loaded by vLLM from
                     kv_transfer_config={"kv_connector": "RagKVConnector",
                     "kv_connector_module_path": "ragkv.integrations.vllm", ...}
    PromptLayout     recognises a PromptTemplate prompt from its token ids (no vLLM needed)

Needs vLLM (``pip install ragkv[vllm]``); the layout works without it. See README.md beside this file.
"""

from ragkv.integrations.vllm.layout import PromptLayout

__all__ = ["PromptLayout", "RagKVConnector"]


def __getattr__(name):
    if name == "RagKVConnector":
        from ragkv.integrations.vllm.connector import RagKVConnector

        return RagKVConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
