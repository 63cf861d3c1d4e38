"""Attention for a subset of query tokens over the whole fused K/V, causal by ORIGINAL position.

Shapes (Hq = q_heads = kv_heads * group, n = selected queries, T = fused tokens, D = head_dim):
    q:      [Hq, n, D]   compute dtype (fp32 / fp16 / bf16), last dim contiguous
    k, v:   [Hkv, T, D]  same dtype, last dim contiguous
    q_pos:  [n] int64    absolute position of each query
    k_pos:  [T] int64    absolute position of each key; None means arange(T) (lets the kernel stop early)
    out:    [Hq, n, D]   q.dtype

    out[h, i] = softmax_j(q[h, i] . k[h // group, j] * sm_scale  masked to k_pos[j] <= q_pos[i]) @ v[h // group]

Matches transformers' `eager_attention_forward` (repeat_kv + matmul + additive causal mask + fp32 softmax)
for every query that sees at least one key; a query that sees none returns zeros (HF's finite min-mask
would average all values instead; CacheBlend never asks for such a row).

Kernel: FlashAttention-2 style online softmax in the exp2 domain, fp32 accumulators, no [n, T] matrix.
GQA packing: one program owns a block of BLOCK_M rows of the [group * n] queries that share one kv head,
so each K/V tile is loaded once per kv head instead of once per query head (small n, large group wins).
fp32 inputs use IEEE dots (no TF32) so they match the fp32 reference; fp16/bf16 dot with fp32 accumulation.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import torch

from ._compat import is_interpreted, tl, triton

_LOG2E = 1.4426950408889634


@triton.jit
def _attn_fwd_inner(
    acc, l_i, m_i, q, q_pos,
    k_base, v_base, kpos_ptr, stride_kt, stride_vt,
    T, hi, offs_d, mask_d, qk_scale,
    K_POS_IS_ARANGE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < T
        # -- compute qk (log2 domain) and mask by original position
        k = tl.load(k_base + offs_n[None, :].to(tl.int64) * stride_kt + offs_d[:, None],
                    mask=mask_n[None, :] & mask_d[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        if UPCAST_DOT:
            k = k.to(tl.float32)
        qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        if K_POS_IS_ARANGE:
            k_pos = offs_n.to(tl.int64)
        else:
            k_pos = tl.load(kpos_ptr + offs_n, mask=mask_n, other=0)
        visible = (k_pos[None, :] <= q_pos[:, None]) & mask_n[None, :]
        qk = tl.where(visible, qk, float("-inf"))
        # -- update m_i and l_i (m_safe keeps fully masked rows free of inf - inf)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # -- update output accumulator
        v = tl.load(v_base + offs_n[:, None].to(tl.int64) * stride_vt + offs_d[None, :],
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None]
        if UPCAST_DOT:
            acc = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _blend_attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, qpos_ptr, kpos_ptr, out_ptr,
    n, T, D, qk_scale,
    stride_qh, stride_qn, stride_kh, stride_kt, stride_vh, stride_vt, stride_oh, stride_on,
    GROUP: tl.constexpr,
    K_POS_IS_ARANGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # interpreter only: its tl.dot multiplies bf16 bit patterns as integers
):
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and BLOCK_D >= 16, "tl.dot needs blocks of at least 16")
    # grid = (cdiv(GROUP * n, BLOCK_M), kv_heads); row r of a kv head is query r % n of q head r // n
    pid_m = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = rows < GROUP * n
    qh = kvh * GROUP + rows // n
    qi = (rows % n).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D

    q_rows = qh * stride_qh + qi * stride_qn
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    q_pos = tl.load(qpos_ptr + qi, mask=mask_m, other=-1)
    if UPCAST_DOT:
        q = q.to(tl.float32)

    if K_POS_IS_ARANGE:
        hi = tl.minimum(tl.max(q_pos, 0) + 1, T)  # keys past the block's last position are all masked
    else:
        hi = T
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, q_pos,
        k_ptr + kvh * stride_kh, v_ptr + kvh * stride_vh, kpos_ptr, stride_kt, stride_vt,
        T, hi, offs_d, mask_d, qk_scale,
        K_POS_IS_ARANGE, BLOCK_N, DOT_PRECISION, UPCAST_DOT,
    )
    # -- epilogue: rows that saw no key have l_i == 0 and acc == 0 -> output 0
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_rows = qh * stride_oh + qi * stride_on
    tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_d[None, :])


def _check(q, k, v, q_pos, k_pos):
    assert q.dim() == 3 and k.dim() == 3 and k.shape == v.shape, "q [Hq, n, D], k/v [Hkv, T, D]"
    Hq, n, D = q.shape
    Hkv, T, Dk = k.shape
    assert Dk == D and Hq % Hkv == 0, f"q {tuple(q.shape)} vs k {tuple(k.shape)}"
    assert q.dtype == k.dtype == v.dtype, f"dtypes differ: {q.dtype} {k.dtype} {v.dtype}"
    assert q_pos.shape == (n,), f"q_pos [n]={n}, got {tuple(q_pos.shape)}"
    assert k_pos is None or k_pos.shape == (T,), f"k_pos [T]={T}, got {tuple(k_pos.shape)}"
    return Hq, n, D, Hkv, T


def blend_attention_triton(q, k, v, q_pos, k_pos=None, sm_scale: float | None = None, plan=None) -> torch.Tensor:
    # (plan: the CPU path's precomputed blocks; the kernel masks by position itself and needs none)
    Hq, n, D, Hkv, T = _check(q, k, v, q_pos, k_pos)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if n == 0 or Hq == 0:
        return out
    if T == 0:
        return out.zero_()
    group = Hq // Hkv
    q_pos = q_pos.to(torch.int64).contiguous()
    arange = k_pos is None
    k_pos = q_pos if arange else k_pos.to(torch.int64).contiguous()  # placeholder when arange
    BLOCK_D = max(16, triton.next_power_of_2(D))
    BLOCK_M = 16 if group * n <= 16 else 64
    BLOCK_N = 64
    grid = (triton.cdiv(group * n, BLOCK_M), Hkv)
    _blend_attn_fwd_kernel[grid](
        q, k, v, q_pos, k_pos, out,
        n, T, D, sm_scale * _LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        GROUP=group, K_POS_IS_ARANGE=arange,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST_DOT=q.dtype == torch.bfloat16 and is_interpreted(_blend_attn_fwd_kernel),
    )
    return out


def blend_attention_torch(q, k, v, q_pos, k_pos=None, sm_scale: float | None = None,
                          chunk: int = 1024) -> torch.Tensor:
    """Reference: eager fp32 matmul + positional mask + softmax, `chunk` queries at a time."""
    Hq, n, D, Hkv, T = _check(q, k, v, q_pos, k_pos)
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    group = Hq // Hkv
    k_pos = torch.arange(T, device=k.device) if k_pos is None else k_pos
    kf, vf = k.to(torch.float32), v.to(torch.float32)
    qf = q.to(torch.float32).view(Hkv, group, n, D)  # GQA: group's query heads share one kv head
    out = torch.empty(Hkv, group, n, D, dtype=torch.float32, device=q.device)
    for s in range(0, n, chunk):
        qc = qf[:, :, s : s + chunk]
        scores = torch.einsum("hgnd,htd->hgnt", qc, kf) * sm_scale
        visible = k_pos[None, :] <= q_pos[s : s + chunk, None]  # [c, T]
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no visible key -> zeros
        out[:, :, s : s + chunk] = torch.einsum("hgnt,htd->hgnd", probs, vf)
    return out.view(Hq, n, D).to(q.dtype)


class SdpaBlock(NamedTuple):
    idx: torch.Tensor | slice  # the block's queries (indices into q's n axis; a slice when q_pos is sorted)
    m: int  # how many
    kv_len: int  # keys [0, kv_len) cover every position the block's queries see
    mask: torch.Tensor  # [1, 1, group * m, kv_len] additive (0 / -inf) in the compute dtype
    blind: bool  # some query sees no key (its row comes out NaN and is zeroed)


def sdpa_plan(q_pos: torch.Tensor, total: int, group: int, dtype: torch.dtype,
              blocks: int | None = None) -> tuple[SdpaBlock, ...]:
    """The blocked SDPA path's query blocks and their masks for queries at ``q_pos`` [n] over keys at
    0..total-1 (``blend_attention_sdpa``). It depends on the positions only, not on the layer: a caller
    running many layers over the same queries builds it once and passes it as ``plan``. Sorted
    positions (the engine's active rows always are) give blocks that are slices of q: no gather."""
    n = q_pos.numel()
    blocks = max(1, min(8, n // 64)) if blocks is None else blocks
    ordered = n < 2 or bool((q_pos[1:] >= q_pos[:-1]).all())
    order = None if ordered else torch.argsort(q_pos)
    bounds = torch.linspace(0, n, min(blocks, n) + 1).round().long().tolist()
    plan = []
    for s, e in itertools.pairwise(bounds):
        if s == e:
            continue
        idx = slice(s, e) if order is None else order[s:e]
        pos = q_pos[idx]
        kv_len = min(total, int(pos.max()) + 1)
        hidden = torch.arange(kv_len, device=q_pos.device)[None, :] > pos[:, None]  # [m, kv_len]
        mask = torch.zeros(hidden.shape, dtype=dtype, device=q_pos.device).masked_fill_(hidden, float("-inf"))
        # head h uses kv head h // group: the group's queries are stacked along the query axis
        plan.append(SdpaBlock(idx, e - s, kv_len, mask.repeat(group, 1)[None, None], int(pos.min()) < 0))
    return tuple(plan)


def blend_attention_sdpa(q, k, v, q_pos, k_pos=None, sm_scale: float | None = None,
                         blocks: int | None = None, plan: tuple[SdpaBlock, ...] | None = None) -> torch.Tensor:
    """CPU production path (torch): the queries, sorted by position, are cut into ``blocks`` groups
    (default: one per 64 queries, at most 8); each group runs torch's fused SDPA over only the keys up
    to its last position, with the positional mask for that slice. A causal-by-position attention of
    n scattered queries over T keys then costs ~(1/2 + 1/(2*blocks)) of the dense n x T work. GQA
    without copying K/V: the query heads that share a kv head are stacked along the query axis.
    ``plan``: the blocks and masks from ``sdpa_plan`` for these q_pos (built here when None; building
    them costs ~a tenth of the call, so a layer loop builds one plan and passes it to every layer).
    k_pos must be None (keys at positions 0..T-1); otherwise this falls back to the reference.
    Returns [Hq, n, D]: a view of an [n, Hq, D] buffer, the layout the model's output projection reads."""
    Hq, n, D, Hkv, T = _check(q, k, v, q_pos, k_pos)
    if k_pos is not None:
        return blend_attention_torch(q, k, v, q_pos, k_pos, sm_scale)
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    group = Hq // Hkv
    if plan is None:
        plan = sdpa_plan(q_pos, T, group, q.dtype, blocks)
    if sum(b.m for b in plan) != n or any(b.mask.shape[2] != group * b.m for b in plan):
        raise ValueError(f"plan covers other queries than these {n} (group {group})")
    out = torch.empty(n, Hq, D, dtype=q.dtype, device=q.device).transpose(0, 1)
    for idx, m, kv_len, mask, blind in plan:
        qq = q[:, idx].reshape(Hkv, group * m, D)
        o = torch.nn.functional.scaled_dot_product_attention(
            qq[None], k[None, :, :kv_len], v[None, :, :kv_len], attn_mask=mask.to(q.dtype), scale=sm_scale,
        )[0].view(Hq, m, D)
        out[:, idx] = o.nan_to_num(0.0) if blind else o  # a query seeing no key -> zeros
    return out
