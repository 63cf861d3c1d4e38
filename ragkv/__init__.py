"""ragkv: KV-cache reuse for RAG (content-addressed chunk K/V + CacheBlend fusion)."""

import os as _os
import sys as _sys
from pathlib import Path as _Path

from ragkv._version import __version__


def _unshadow_checkout_root() -> None:
    """In a source checkout, the repository root holds ``kernels/`` (installed as ``ragkv.kernels``).
    When that root is on sys.path (``python -m``/``-c`` from it, or a Ray worker given the driver's
    directory), it shadows Hugging Face's top-level ``kernels`` package, which transformers >= 5.25
    imports. Drop the root from sys.path; an installed ragkv (no ``kernels/`` beside it) is untouched."""
    root = _Path(__file__).resolve().parent.parent
    if not ((root / "kernels" / "__init__.py").is_file() and (root / "pyproject.toml").is_file()):
        return
    _sys.path[:] = [p for p in _sys.path if _Path(p or _os.getcwd()).resolve() != root]


_unshadow_checkout_root()

__all__ = ["__version__"]
