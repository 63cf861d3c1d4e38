"""Per-token K/V deviation between a fresh (recomputed) and a cached layer: the CacheBlend selection score.

Shapes (H = kv_heads, T = tokens, D = head_dim):
    fresh_k, cached_k, fresh_v, cached_v:  [H, T, D] compute dtype, last dim contiguous (None when unused)
    out:                                   [T] fp32

    dev_x[t] = sum_{h, d} (fresh_x[h, t, d] - cached_x[h, t, d]) ** 2          (x in K, V)
    mode "k" -> dev_k, "v" -> dev_v, "kv" -> dev_k + dev_v
    normalize=True divides each term by its cached energy sum_{h, d} cached_x[h, t, d] ** 2 (+ eps), so a
    relative deviation is returned and K and V weigh alike in "kv" mode.
All arithmetic in fp32 (differences taken after upcasting, so fp16/bf16 inputs lose nothing extra).

select_topk(scores, k) is torch.topk on [T] scores: a selection over a few thousand floats is one small
launch, dwarfed by the layer's attention; a custom kernel would not pay off, so there is none.
"""

from __future__ import annotations

import torch

from ._compat import tl, triton

_EPS = 1e-12
_MODES = ("k", "v", "kv")


@triton.jit
def _sq_dev_accumulate(f_ptr, c_ptr, stride_fh, stride_ft, stride_ch, stride_ct, offs_t, mask_t, H, D,
                       NORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    # -- returns sum_{h,d} (f - c)^2 (over cached energy when NORMALIZE) for BLOCK_T tokens
    dev = tl.zeros((BLOCK_T,), dtype=tl.float32)
    energy = tl.zeros((BLOCK_T,), dtype=tl.float32)
    offs_d = tl.arange(0, BLOCK_D)
    for h in range(H):
        for d0 in range(0, D, BLOCK_D):
            mask = mask_t[:, None] & ((d0 + offs_d) < D)[None, :]
            f = tl.load(f_ptr + h * stride_fh + offs_t[:, None] * stride_ft + (d0 + offs_d)[None, :],
                        mask=mask, other=0.0).to(tl.float32)
            c = tl.load(c_ptr + h * stride_ch + offs_t[:, None] * stride_ct + (d0 + offs_d)[None, :],
                        mask=mask, other=0.0).to(tl.float32)
            diff = f - c
            dev += tl.sum(diff * diff, axis=1)
            if NORMALIZE:
                energy += tl.sum(c * c, axis=1)
    if NORMALIZE:
        dev = dev / (energy + 1e-12)
    return dev


@triton.jit
def _kv_deviation_kernel(
    fk_ptr, ck_ptr, fv_ptr, cv_ptr, out_ptr,
    H, T, D,
    stride_fkh, stride_fkt, stride_ckh, stride_ckt,
    stride_fvh, stride_fvt, stride_cvh, stride_cvt,
    USE_K: tl.constexpr, USE_V: tl.constexpr, NORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # one program = BLOCK_T tokens, looping over heads and head_dim chunks; no atomics, one store
    pid = tl.program_id(0)
    offs_t = (pid * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    mask_t = offs_t < T
    acc = tl.zeros((BLOCK_T,), dtype=tl.float32)
    if USE_K:
        acc += _sq_dev_accumulate(fk_ptr, ck_ptr, stride_fkh, stride_fkt, stride_ckh, stride_ckt,
                                  offs_t, mask_t, H, D, NORMALIZE, BLOCK_T, BLOCK_D)
    if USE_V:
        acc += _sq_dev_accumulate(fv_ptr, cv_ptr, stride_fvh, stride_fvt, stride_cvh, stride_cvt,
                                  offs_t, mask_t, H, D, NORMALIZE, BLOCK_T, BLOCK_D)
    tl.store(out_ptr + offs_t, acc, mask=mask_t)


def _check(fresh_k, cached_k, fresh_v, cached_v, mode):
    if mode not in _MODES:
        raise ValueError(f"kv_deviation mode {mode!r}: expected one of {_MODES}")
    pairs = []
    if "k" in mode:
        pairs.append((fresh_k, cached_k))
    if "v" in mode:
        pairs.append((fresh_v, cached_v))
    shape = None
    for f, c in pairs:
        assert f is not None and c is not None, f"mode {mode!r} needs both fresh and cached tensors"
        assert f.dim() == 3 and f.shape == c.shape, f"[kv_heads, T, D] pairs, got {tuple(f.shape)} {tuple(c.shape)}"
        assert f.stride(-1) == 1 and c.stride(-1) == 1, "last dim must be contiguous"
        assert shape is None or f.shape[:2] == shape[:2], "K and V must share [kv_heads, T]"
        shape = f.shape
    return pairs


def kv_deviation_triton(fresh_k, cached_k, fresh_v=None, cached_v=None, mode: str = "v",
                        normalize: bool = False) -> torch.Tensor:
    pairs = _check(fresh_k, cached_k, fresh_v, cached_v, mode)
    H, T, D = pairs[0][0].shape
    out = torch.empty(T, dtype=torch.float32, device=pairs[0][0].device)
    if T == 0:
        return out
    fk, ck = (fresh_k, cached_k) if "k" in mode else pairs[0]  # placeholders keep the signature fixed
    fv, cv = (fresh_v, cached_v) if "v" in mode else pairs[0]
    BLOCK_D = min(128, triton.next_power_of_2(D))
    BLOCK_T = 32
    _kv_deviation_kernel[(triton.cdiv(T, BLOCK_T),)](
        fk, ck, fv, cv, out,
        H, T, D,
        fk.stride(0), fk.stride(1), ck.stride(0), ck.stride(1),
        fv.stride(0), fv.stride(1), cv.stride(0), cv.stride(1),
        USE_K="k" in mode, USE_V="v" in mode, NORMALIZE=normalize,
        BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D,
    )
    return out


def kv_deviation_torch(fresh_k, cached_k, fresh_v=None, cached_v=None, mode: str = "v",
                       normalize: bool = False) -> torch.Tensor:
    """Reference: fp32 squared L2 over heads and head_dim, per token."""
    out = None
    for f, c in _check(fresh_k, cached_k, fresh_v, cached_v, mode):
        c32 = c.to(torch.float32)
        dev = (f.to(torch.float32) - c32).square().sum(dim=(0, 2))
        if normalize:
            dev = dev / (c32.square().sum(dim=(0, 2)) + _EPS)
        out = dev if out is None else out + dev
    return out


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores ([T] -> [min(k, T)] int64), sorted ascending by token index."""
    k = max(0, min(int(k), scores.numel()))
    return torch.topk(scores, k, sorted=False).indices.sort().values
