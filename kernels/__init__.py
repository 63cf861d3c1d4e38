"""ragkv.kernels: the blend hot path as Triton kernels, each beside its torch reference.

Public API (see dispatch.py; triton runs on CUDA tensors, the torch reference on CPU tensors):
    rope_shift, kv_deviation, select_topk, scatter_rows, blend_attention,
    use_backend / set_backend / get_backend, env var RAGKV_KERNELS = auto | triton | torch.

Importing this package imports torch only; triton is imported on the first kernel call that needs it.
Each op's file (rope_shift.py, kv_deviation.py, scatter_rows.py, blend_attention.py) holds the kernel,
its launcher `<op>_triton` and its reference `<op>_torch`: import those with
`from ragkv.kernels.rope_shift import rope_shift_torch`. The package attribute `ragkv.kernels.rope_shift`
is always the dispatcher function, never the submodule of the same name (see _Package below).
"""

import sys
import types

from .dispatch import (
    BACKENDS,
    ENV_VAR,
    blend_attention,
    get_backend,
    kv_deviation,
    resolve_backend,
    rope_shift,
    scatter_rows,
    select_topk,
    set_backend,
    use_backend,
)

_SHADOWED = frozenset({"rope_shift", "kv_deviation", "scatter_rows", "blend_attention"})


class _Package(types.ModuleType):
    # Importing the submodule ragkv.kernels.rope_shift makes Python set the package attribute `rope_shift`
    # to that module, which would hide the public function of the same name; keep the function.
    def __setattr__(self, name, value):
        if name in _SHADOWED and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "blend_attention",
    "get_backend",
    "kv_deviation",
    "resolve_backend",
    "rope_shift",
    "scatter_rows",
    "select_topk",
    "set_backend",
    "use_backend",
]
