"""RoPE shift: re-rotate cached keys by per-token position deltas, fused with dequantization.

Shapes (H = kv_heads, T = tokens, D = head_dim, R = rotary_dim <= D, R even):
    k:         [H, T, D]  storage dtype (fp32 / fp16 / bf16 / int8); any strides, last dim contiguous
    scale:     None, or fp32 broadcastable to [H, T, D]: per-token [H, T, 1] or per-channel [H, 1, D]
    delta:     [T] int64  new_position - old_position (may be negative)
    inv_freq:  [R / 2] fp32  exactly the model's `rotary_emb.inv_freq` (already scaled for linear/llama3/yarn)
    out:       [H, T, D] out_dtype, last dim contiguous (new, or the caller's ``out``; ``out=k`` rotates in place)
    tables:    the torch path's (cos, sin) [T, R / 2] fp32 for this delta (``rope_tables``): a caller that
               re-rotates the same positions many times (every layer of a blended request) builds them once

Matches transformers' `apply_rotary_pos_emb` (NeoX rotate_half layout, cos/sin = cat(freqs, freqs)):
RoPE is a rotation R(p), so a key stored at position p moves to p + d by applying R(d):
    shift(R(p) k) = R(d) R(p) k = R(p + d) k.
attention_scaling (YaRN / longrope `mscale`): HF builds cos = cos(p * inv_freq) * s and sin likewise, so the
stored key is s * R(p) k and HF's key at p + d is s * R(p + d) k = R(d) (s * R(p) k). The stored key already
carries its single factor of s; the shift must be a pure rotation. There is deliberately no
`attention_scaling` argument: passing it would scale the key twice (tested against HF yarn in tests/kernels).
Dims [R, D) of a partial-rotary model pass through unchanged (dequantized only).

Numerics: the kernel computes theta = delta * inv_freq in fp32 and recovers the product's rounding error
with an fma, then reduces theta to [-pi, pi] by Cody-Waite (2*pi = C1 + C2 + C3, C1 = 6.28125 has 8 mantissa
bits so n * C1 is exact for |n| < 2**16, i.e. |delta * inv_freq| < ~4e5 rad); cos/sin then run on a small
argument. The reference computes the angle in float64. For |delta| < 2**16 the two agree to fp32 rounding of
cos/sin (~1e-6 relative). HF itself computes (p + d) * inv_freq in fp32, so HF's own keys carry an absolute
angle error of up to ~|p + d| * 6e-8 rad; comparisons with HF at large positions need that tolerance.
"""

from __future__ import annotations

import torch

from ._compat import tl, triton


@triton.jit
def _rope_shift_kernel(
    k_ptr, s_ptr, delta_ptr, inv_freq_ptr, out_ptr,
    H, T,
    stride_kh, stride_kt,
    stride_sh, stride_st, stride_sd,
    stride_oh, stride_ot,
    HALF: tl.constexpr,  # rotary_dim // 2
    D: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_HALF: tl.constexpr,  # next_power_of_2(HALF)
    BLOCK_PASS: tl.constexpr,  # next_power_of_2(D - 2 * HALF), 0 when fully rotary
):
    # one program = BLOCK_T tokens x all heads; cos/sin are computed once and reused for every head
    pid_t = tl.program_id(0)
    offs_t = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    mask_t = offs_t < T
    offs_f = tl.arange(0, BLOCK_HALF)
    mask_f = offs_f < HALF
    mask = mask_t[:, None] & mask_f[None, :]

    # -- angle = delta * inv_freq, with the fp32 product error kept and the result reduced to [-pi, pi]
    d = tl.load(delta_ptr + offs_t, mask=mask_t, other=0).to(tl.float32)[:, None]
    f = tl.load(inv_freq_ptr + offs_f, mask=mask_f, other=0.0)[None, :]
    theta = d * f
    err = tl.fma(d, f, -theta)
    # 2*pi = C1 + C2 + C3: C1 = 6.28125 (8 mantissa bits), C2 = fp32(2pi - C1), C3 = the rest
    n = tl.floor(theta * 0.15915494309189535 + 0.5)
    r = (theta - n * 6.28125) - n * 0.0019353071693331003
    r = (r - n * 1.0253131677018246e-11) + err
    cos = tl.cos(r)
    sin = tl.sin(r)

    for h in range(H):
        k_row = k_ptr + h * stride_kh + offs_t[:, None] * stride_kt
        o_row = out_ptr + h * stride_oh + offs_t[:, None] * stride_ot
        x1 = tl.load(k_row + offs_f[None, :], mask=mask, other=0).to(tl.float32)
        x2 = tl.load(k_row + HALF + offs_f[None, :], mask=mask, other=0).to(tl.float32)
        if HAS_SCALE:
            s_row = s_ptr + h * stride_sh + offs_t[:, None] * stride_st
            x1 *= tl.load(s_row + offs_f[None, :] * stride_sd, mask=mask, other=0.0)
            x2 *= tl.load(s_row + (HALF + offs_f[None, :]) * stride_sd, mask=mask, other=0.0)
        # -- x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1)
        y1 = x1 * cos - x2 * sin
        y2 = x2 * cos + x1 * sin
        tl.store(o_row + offs_f[None, :], y1.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(o_row + HALF + offs_f[None, :], y2.to(out_ptr.dtype.element_ty), mask=mask)
        if BLOCK_PASS > 0:
            # -- partial rotary: dims [2*HALF, D) are only dequantized
            offs_p = 2 * HALF + tl.arange(0, BLOCK_PASS)
            mask_p = mask_t[:, None] & (offs_p < D)[None, :]
            xp = tl.load(k_row + offs_p[None, :], mask=mask_p, other=0).to(tl.float32)
            if HAS_SCALE:
                xp *= tl.load(s_row + offs_p[None, :] * stride_sd, mask=mask_p, other=0.0)
            tl.store(o_row + offs_p[None, :], xp.to(out_ptr.dtype.element_ty), mask=mask_p)


def _check(k, scale, delta, inv_freq, rotary_dim):
    assert k.dim() == 3 and k.stride(-1) == 1, "k: [kv_heads, T, D] with a contiguous last dim"
    H, T, D = k.shape
    assert delta.shape == (T,), f"delta: [T]={T}, got {tuple(delta.shape)}"
    half = inv_freq.numel()
    rotary_dim = 2 * half if rotary_dim is None else rotary_dim
    assert rotary_dim == 2 * half and rotary_dim <= D, f"rotary_dim {rotary_dim} != 2 * inv_freq {half} or > D {D}"
    if k.dtype == torch.int8:
        assert scale is not None, "int8 keys need a scale ([H, T, 1] per-token or [H, 1, D] per-channel)"
    if scale is not None:
        assert scale.dim() == 3 and scale.shape[0] in (1, H) and scale.shape[1] in (1, T) and scale.shape[2] in (1, D)
    return H, T, D, half


def _out_dtype(k, out_dtype):
    if out_dtype is not None:
        return out_dtype
    assert k.is_floating_point(), "int8 keys need an explicit out_dtype"
    return k.dtype


def _out(k, out_dtype, out):
    """The output tensor: ``out`` checked against k's shape and the output dtype, else a new one."""
    dtype = _out_dtype(k, out_dtype)
    if out is None:
        return torch.empty(k.shape, dtype=dtype, device=k.device)
    assert out.shape == k.shape and out.dtype == dtype and out.stride(-1) == 1, (
        f"out: {tuple(k.shape)} {dtype} with a contiguous last dim, got {tuple(out.shape)} {out.dtype}")
    return out


def rope_tables(delta: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [T, R / 2] fp32 of the angles delta * inv_freq, computed in float64 once per distinct
    delta (a chunk shares one) and rounded to fp32: what ``rope_shift_torch`` rotates by."""
    uniq, which = torch.unique(delta, return_inverse=True)
    theta = uniq.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]  # [U, R/2]
    return theta.cos().to(torch.float32)[which], theta.sin().to(torch.float32)[which]


def rope_shift_triton(
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
    # (tables: the CPU path's cos/sin; the kernel computes its angles itself and needs none. In place
    # is safe: each program loads a block's keys before it stores their rotation)
    H, T, D, half = _check(k, scale, delta, inv_freq, rotary_dim)
    out = _out(k, out_dtype, out)
    if T == 0 or H == 0:
        return out
    inv_freq = inv_freq.to(torch.float32).contiguous()
    delta = delta.to(torch.int64).contiguous()
    has_scale = scale is not None
    if has_scale:
        scale = scale.to(torch.float32).expand(H, T, D)  # stride 0 on the broadcast dims
        s_strides = scale.stride()
    else:
        scale, s_strides = inv_freq, (0, 0, 0)  # placeholder pointer, never read
    BLOCK_HALF = triton.next_power_of_2(half)
    BLOCK_PASS = triton.next_power_of_2(D - 2 * half) if 2 * half < D else 0
    BLOCK_T = max(1, min(64, 4096 // BLOCK_HALF))
    grid = (triton.cdiv(T, BLOCK_T),)
    _rope_shift_kernel[grid](
        k, scale, delta, inv_freq, out,
        H, T,
        k.stride(0), k.stride(1),
        *s_strides,
        out.stride(0), out.stride(1),
        HALF=half, D=D, HAS_SCALE=has_scale,
        BLOCK_T=BLOCK_T, BLOCK_HALF=BLOCK_HALF, BLOCK_PASS=BLOCK_PASS,
    )
    return out


def rope_shift_torch(
    k: torch.Tensor,
    delta: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    rotary_dim: int | None = None,
    tables: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference (and the CPU path): dequantize to fp32, rotate by delta * inv_freq (angle and cos/sin in
    float64, rounded to fp32: ``rope_tables``, or the caller's ``tables`` for this delta), round once to
    the output dtype."""
    _, T, D, half = _check(k, scale, delta, inv_freq, rotary_dim)
    cos, sin = rope_tables(delta, inv_freq) if tables is None else tables
    assert cos.shape == sin.shape == (T, half), f"tables: [T, R/2]=({T}, {half}), got {tuple(cos.shape)}"
    out = _out(k, out_dtype, out)
    x = k.to(torch.float32)
    if scale is not None:
        x = x * scale.to(torch.float32)
    # x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1), one half at a time (fewer passes
    # over the keys than building rotate_half; the same fp32 products and sums); both halves are
    # computed before either is written, so out may be k itself
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    y1 = (x1 * cos).sub_(x2 * sin)
    y2 = (x2 * cos).add_(x1 * sin)
    out[..., :half] = y1
    out[..., half : 2 * half] = y2
    if 2 * half < D:
        out[..., 2 * half :] = x[..., 2 * half :]
    return out
