"""Storage dtypes and int8 quantization of one layer's K/V (symmetric absmax, per token or per
channel; ``auto`` = KIVI: K per channel, V per token). Error bounds: README "Storage dtypes"."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

MODEL_DTYPES = ("float32", "float16", "bfloat16")
STORAGE_DTYPES = (*MODEL_DTYPES, "int8")
QUANT_AXES = ("token", "channel", "auto")  # auto = KIVI: K per-channel, V per-token
TORCH_DTYPE = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}


@dataclass
class StoredLayer:
    """One layer as stored. k, v: [kv_heads, tokens, head_dim] in storage dtype; scales fp32,
    [kv_heads, tokens, 1] (per-token) or [kv_heads, 1, head_dim] (per-channel), int8 only."""

    k: Tensor
    v: Tensor
    k_scale: Tensor | None = None
    v_scale: Tensor | None = None

    def dequantize(self, dtype: torch.dtype | str) -> tuple[Tensor, Tensor]:
        dtype = TORCH_DTYPE[dtype] if isinstance(dtype, str) else dtype
        if self.k.dtype == torch.int8:
            assert self.k_scale is not None and self.v_scale is not None
            k = (self.k.to(torch.float32) * self.k_scale).to(dtype)
            v = (self.v.to(torch.float32) * self.v_scale).to(dtype)
            return k, v
        return self.k.to(dtype), self.v.to(dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors().values())

    def _tensors(self) -> dict[str, Tensor]:
        out = {"k": self.k, "v": self.v}
        if self.k_scale is not None:
            out["k_scale"] = self.k_scale
        if self.v_scale is not None:
            out["v_scale"] = self.v_scale
        return out


def _absmax_scale(x: Tensor, dim: int) -> Tensor:
    scale = x.abs().amax(dim=dim, keepdim=True).to(torch.float32) / 127.0
    return scale


def quantize_tensor(x: Tensor, axis: str) -> tuple[Tensor, Tensor]:
    """Symmetric absmax int8. axis "token": one scale per (kv_head, token) -> [H, T, 1];
    "channel": one per (kv_head, channel) -> [H, 1, D]."""
    xf = x.to(torch.float32)
    scale = _absmax_scale(xf, dim=2 if axis == "token" else 1)
    q = torch.where(scale > 0, xf / scale.clamp_min(1e-30), torch.zeros_like(xf))
    return q.round_().clamp_(-127, 127).to(torch.int8), scale.contiguous()


def quantize_layer(k: Tensor, v: Tensor, storage_dtype: str, quant_axis: str | None = None) -> StoredLayer:
    """k, v: [kv_heads, tokens, head_dim] (any float dtype) -> StoredLayer in storage dtype."""
    if storage_dtype not in STORAGE_DTYPES:
        raise ValueError(f"storage_dtype {storage_dtype!r}: valid are {STORAGE_DTYPES}")
    if storage_dtype != "int8":
        dt = TORCH_DTYPE[storage_dtype]
        return StoredLayer(k.detach().to(dt).contiguous(), v.detach().to(dt).contiguous())
    if quant_axis not in QUANT_AXES:
        raise ValueError(f"quant_axis {quant_axis!r}: valid for int8 are {QUANT_AXES}")
    k_axis, v_axis = ("channel", "token") if quant_axis == "auto" else (quant_axis, quant_axis)
    qk, sk = quantize_tensor(k.detach(), k_axis)
    qv, sv = quantize_tensor(v.detach(), v_axis)
    return StoredLayer(qk, qv, sk, sv)
