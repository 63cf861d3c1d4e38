"""ragkv: KV-cache reuse for RAG (content-addressed chunk K/V + CacheBlend fusion)."""

from ragkv._version import __version__

__all__ = ["__version__"]
