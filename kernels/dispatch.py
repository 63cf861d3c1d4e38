"""The single entry point the engine uses for the blend hot path.

Each public function runs the Triton kernel on CUDA tensors and the torch reference on CPU tensors.
Backend choice, first match wins:
    1. `use_backend(name)` (context manager) or `set_backend(name)` (process-wide, None clears it)
    2. environment variable RAGKV_KERNELS = auto (default) | triton | torch, read at every call
    3. auto: triton when the tensors are on CUDA and triton imports, else torch
Forcing "triton" on CPU tensors works only when triton runs in its interpreter (TRITON_INTERPRET=1 set
before the first kernel module import) and raises a RuntimeError otherwise; forcing "triton" without an
importable triton raises a RuntimeError too. Nothing here imports triton until a kernel is needed.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

ENV_VAR = "RAGKV_KERNELS"
BACKENDS = ("auto", "triton", "torch")

_override: str | None = None


def _validate(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown ragkv kernel backend {name!r}: expected one of {BACKENDS}")
    return name


def get_backend() -> str:
    """The requested backend: override, else $RAGKV_KERNELS, else 'auto'."""
    if _override is not None:
        return _override
    return _validate(os.environ.get(ENV_VAR, "auto").strip().lower() or "auto")


def set_backend(name: str | None) -> None:
    """Force a backend process-wide ('auto' | 'triton' | 'torch'); None returns to $RAGKV_KERNELS."""
    global _override
    _override = None if name is None else _validate(name)


@contextmanager
def use_backend(name: str) -> Iterator[None]:
    """`with use_backend("triton"): ...` runs every dispatched op in the block on that backend."""
    global _override
    previous, _override = _override, _validate(name)
    try:
        yield
    finally:
        _override = previous


def _module(op: str):
    return importlib.import_module(f"{__package__}.{op}")


def resolve_backend(op: str, device: torch.device) -> str:
    """'triton' or 'torch' for op on device; raises a RuntimeError when a forced triton cannot run."""
    backend = get_backend()
    if backend == "torch":
        return "torch"
    from ._compat import HAS_TRITON, is_interpreted

    if backend == "auto":
        return "triton" if device.type == "cuda" and HAS_TRITON else "torch"
    if not HAS_TRITON:
        raise RuntimeError(f"{ENV_VAR}=triton but triton is not importable: pip install 'ragkv[triton]'")
    if device.type == "cpu":
        kernel = next(v for k, v in vars(_module(op)).items() if k.startswith("_") and k.endswith("_kernel"))
        if not is_interpreted(kernel):
            raise RuntimeError(
                f"{ENV_VAR}=triton on CPU tensors needs triton's interpreter: set TRITON_INTERPRET=1 before "
                f"ragkv.kernels.{op} is first imported (or use CUDA tensors, or {ENV_VAR}=torch)"
            )
    elif device.type != "cuda":
        raise RuntimeError(f"{ENV_VAR}=triton: no triton backend for device {device}")
    return "triton"


# the torch backend's function when it is not the reference itself: blend_attention's reference
# materializes scores; on CPU the engine wants the blocked SDPA path (checked against the reference)
_TORCH_PATH = {"blend_attention": "blend_attention_sdpa"}


def _impl(op: str, device: torch.device):
    backend = resolve_backend(op, device)
    if backend == "torch" and op in _TORCH_PATH:
        return getattr(_module(op), _TORCH_PATH[op])
    return getattr(_module(op), f"{op}_{backend}")


def rope_shift(
    k: torch.Tensor,
    delta: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    rotary_dim: int | None = None,
    tables=None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Move cached keys k [kv_heads, T, D] (fp32/fp16/bf16, or int8 with fp32 `scale` [H, T, 1] or [H, 1, D])
    from position p to p + delta[t] (delta [T] int64), dequantizing to out_dtype (default k.dtype; required
    for int8). inv_freq [rotary_dim / 2] fp32 is the model's rotary_emb.inv_freq. A pure rotation: do not
    apply attention_scaling again, the stored key already carries it. Returns [kv_heads, T, D]: ``out``
    when given (``out=k`` rotates in place), else a new tensor.
    tables: ``rope_tables(delta, inv_freq)`` for this delta (reused across calls with the same delta)."""
    return _impl("rope_shift", k.device)(k, delta, inv_freq, scale=scale, out_dtype=out_dtype, rotary_dim=rotary_dim,
                                         tables=tables, out=out)


def rope_tables(delta: torch.Tensor, inv_freq: torch.Tensor):
    """What ``rope_shift`` can reuse across calls with the same ``delta``: the CPU path's cos/sin
    [T, R / 2] fp32; None where the kernel in use computes its own angles (Triton)."""
    if resolve_backend("rope_shift", delta.device) != "torch":
        return None
    return _module("rope_shift").rope_tables(delta, inv_freq)


def kv_deviation(
    fresh_k: torch.Tensor | None,
    cached_k: torch.Tensor | None,
    fresh_v: torch.Tensor | None = None,
    cached_v: torch.Tensor | None = None,
    mode: str = "v",
    normalize: bool = False,
) -> torch.Tensor:
    """Per-token squared L2 deviation [T] fp32 summed over heads and head_dim; inputs [kv_heads, T, D].
    mode 'k' | 'v' | 'kv' (sum); normalize divides each term by the cached tensor's per-token energy."""
    any_input = next(x for x in (fresh_k, cached_k, fresh_v, cached_v) if x is not None)
    return _impl("kv_deviation", any_input.device)(fresh_k, cached_k, fresh_v, cached_v, mode=mode, normalize=normalize)


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [min(k, T)] int64 of the k largest of scores [T], ascending (torch.topk on every backend)."""
    return _module("kv_deviation").select_topk(scores, k)


def scatter_rows(dst: torch.Tensor, src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """In place dst[:, index] = src for dst [kv_heads, T, D], src [kv_heads, n, D], unique index [n] int64.
    Returns dst."""
    return _impl("scatter_rows", dst.device)(dst, src, index)


def blend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor | None = None,
    sm_scale: float | None = None,
    plan=None,
) -> torch.Tensor:
    """Attention of q [q_heads, n, D] over k, v [kv_heads, T, D] (GQA), causal by original position:
    query i sees key j iff k_pos[j] <= q_pos[i] (q_pos [n], k_pos [T] int64, None = arange(T)).
    sm_scale defaults to D ** -0.5. Returns [q_heads, n, D] in q.dtype; a query seeing no key gets zeros.
    plan: ``blend_attention_plan(q_pos, T, group, dtype)`` for these queries (reused across layers)."""
    return _impl("blend_attention", q.device)(q, k, v, q_pos, k_pos, sm_scale, plan=plan)


def blend_attention_plan(q_pos: torch.Tensor, total: int, group: int, dtype: torch.dtype):
    """What ``blend_attention`` can reuse across calls with the same queries at ``q_pos`` over ``total``
    keys at positions 0..total-1 (GQA ``group`` query heads per kv head): the CPU path's query blocks
    and masks; None where the kernel in use needs none (Triton)."""
    if resolve_backend("blend_attention", q_pos.device) != "torch":
        return None
    return _module("blend_attention").sdpa_plan(q_pos, total, group, dtype)


__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "blend_attention",
    "blend_attention_plan",
    "get_backend",
    "kv_deviation",
    "resolve_backend",
    "rope_shift",
    "rope_tables",
    "scatter_rows",
    "select_topk",
    "set_backend",
    "use_backend",
]
