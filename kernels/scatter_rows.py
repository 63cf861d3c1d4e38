"""Scatter recomputed K/V rows into the fused cache, in place: dst[:, index] = src.

Shapes (H = kv_heads, T = fused tokens, n = recomputed tokens, D = head_dim):
    dst:    [H, T, D]  any strides, last dim contiguous; written in place
    src:    [H, n, D]  any strides, last dim contiguous; cast to dst.dtype on store
    index:  [n] int64  rows of dst, each in [0, T); duplicate indices leave the row with any one of the
                       writers (as torch's index_put), so callers pass unique indices (select_topk does).
                       An index outside [0, T) raises IndexError on both backends (torch would wrap a
                       negative one, the kernel would write outside dst); the kernel also masks such rows.
"""

from __future__ import annotations

import torch

from ._compat import tl, triton


@triton.jit
def _scatter_rows_kernel(
    dst_ptr, src_ptr, idx_ptr,
    n, D, T,
    stride_dh, stride_dt, stride_sh, stride_sn,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # grid = (cdiv(n, BLOCK_N), H): one program copies BLOCK_N rows of one head
    pid_n = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_n = offs_n < n
    rows = tl.load(idx_ptr + offs_n, mask=mask_n, other=0)
    mask_n = mask_n & (rows >= 0) & (rows < T)  # never write outside dst (the host checks first)
    offs_d = tl.arange(0, BLOCK_D)
    for d0 in range(0, D, BLOCK_D):
        mask = mask_n[:, None] & ((d0 + offs_d) < D)[None, :]
        x = tl.load(src_ptr + h * stride_sh + offs_n[:, None] * stride_sn + (d0 + offs_d)[None, :], mask=mask)
        tl.store(dst_ptr + h * stride_dh + rows[:, None] * stride_dt + (d0 + offs_d)[None, :],
                 x.to(dst_ptr.dtype.element_ty), mask=mask)


def _check(dst, src, index):
    assert dst.dim() == 3 and src.dim() == 3, "dst [kv_heads, T, D], src [kv_heads, n, D]"
    assert dst.shape[0] == src.shape[0] and dst.shape[2] == src.shape[2], f"{tuple(dst.shape)} vs {tuple(src.shape)}"
    assert index.shape == (src.shape[1],), f"index [n]={src.shape[1]}, got {tuple(index.shape)}"
    assert dst.stride(-1) == 1 and src.stride(-1) == 1, "last dim must be contiguous"
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= dst.shape[1]):
        raise IndexError(f"scatter_rows: index values must lie in [0, {dst.shape[1]}), got "
                         f"[{int(index.min())}, {int(index.max())}]")


def scatter_rows_triton(dst: torch.Tensor, src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    _check(dst, src, index)
    H, n, D = src.shape
    if n == 0 or H == 0:
        return dst
    index = index.to(torch.int64).contiguous()
    BLOCK_D = min(128, triton.next_power_of_2(D))
    BLOCK_N = 16
    _scatter_rows_kernel[(triton.cdiv(n, BLOCK_N), H)](
        dst, src, index, n, D, dst.shape[1],
        dst.stride(0), dst.stride(1), src.stride(0), src.stride(1),
        BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
    )
    return dst


def scatter_rows_torch(dst: torch.Tensor, src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Reference: torch advanced-index assignment."""
    _check(dst, src, index)
    dst[:, index] = src.to(dst.dtype)
    return dst
