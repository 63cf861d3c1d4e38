"""ragkv.integrations: HuggingFace generate wrapper and LlamaIndex components."""
