"""Can the CPU path of the recomputed rows' attention get closer to causal prefill's cost per key?

    python benchmarks/kernels/cpu_attention_variants.py          # bf16 and fp32, ~30 s

The recomputed rows of a blended layer (n scattered positions out of T) attend causally by position.
ragkv's CPU path (``blend_attention_sdpa``) sorts them, cuts them into blocks and runs torch's fused
SDPA per block over the keys up to the block's last position with a boolean mask. Per (head, row, key)
that costs more than causal prefill's ``is_causal`` kernel. This script measures, on one layer's
shapes of SmolLM2 (9 query heads, 3 KV heads, head_dim 64) at T = 3087 and n = 510 (r = 0.15 + suffix):

    mask cost      one block: SDPA with a boolean mask, a float mask, and no mask
    current        blend_attention_sdpa (blocks of >= 64 queries, at most 8), its blocks and masks
                   built in the call (what every layer paid before they were built once per active set)
    plan reused    the same with the blocks and masks built beforehand (``sdpa_plan``), as a request's
                   layers now share them; "plan build" is what building them costs once
    split B        per block, the keys every query of the block sees run WITHOUT a mask and only the
                   band between the block's first and last position with one; the two halves are
                   merged by their log-sum-exp (torch's CPU flash kernel returns it). B blocks.

and prints each against the eager fp32 reference (max abs error) so a faster variant is also a right one.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from _common import bench_ms

from kernels.blend_attention import blend_attention_sdpa, blend_attention_torch, sdpa_plan

flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def split_attention(q, k, v, q_pos, blocks: int):
    """Unmasked keys below each block + a masked band, merged by log-sum-exp."""
    hq, n, d = q.shape
    hkv, t, _ = k.shape
    g, scale = hq // hkv, d**-0.5
    order, out = torch.argsort(q_pos), torch.empty_like(q)
    bounds = torch.linspace(0, n, min(blocks, n) + 1).round().long().tolist()
    for s, e in itertools.pairwise(bounds):
        idx = order[s:e]
        pos, m = q_pos[idx], e - s
        lo, hi = int(pos.min()) + 1, min(t, int(pos.max()) + 1)  # keys [0, lo) are seen by every row
        qq = q[:, idx].reshape(1, hkv, g * m, d)
        o1, l1 = flash(qq, k[None, :, :lo], v[None, :, :lo], scale=scale)
        o = o1
        if hi > lo:
            seen = torch.arange(lo, hi)[None, :] <= pos[:, None]
            mask = torch.zeros(m, hi - lo, dtype=q.dtype).masked_fill_(~seen, float("-inf")).repeat(g, 1)
            o2, l2 = flash(qq, k[None, :, lo:hi], v[None, :, lo:hi], attn_mask=mask[None, None], scale=scale)
            # a row that sees no key of the band comes back with lse 0 and output 0: make it -inf
            l2 = l2.masked_fill((pos < lo).repeat(g)[None, None], float("-inf"))
            lse = torch.logaddexp(l1, l2)
            o = (o1.float() * (l1 - lse).exp()[..., None] + o2.float() * (l2 - lse).exp()[..., None]).to(q.dtype)
        out[:, idx] = o[0].view(hq, m, d)
    return out


def cpu_ms(fn) -> float:
    return bench_ms(fn, "cpu")


def measure(dt: torch.dtype) -> None:
    T, HQ, HKV, D, N, S = 3087, 9, 3, 64, 510, 45
    torch.manual_seed(0)
    q = torch.randn(HQ, N, D, dtype=dt)
    k, v = torch.randn(HKV, T, D, dtype=dt), torch.randn(HKV, T, D, dtype=dt)
    pos = torch.cat([torch.randperm(T - S)[: N - S].sort().values, torch.arange(T - S, T)])
    ref = blend_attention_torch(q, k, v, pos).float()
    qb, kb, vb = torch.randn(1, HKV, 219, D, dtype=dt), k[None], v[None]
    seen = torch.rand(219, T) > 0.3
    fmask = torch.zeros(219, T, dtype=dt).masked_fill(~seen, float("-inf"))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    print(f"{dt}: one block of 219 rows x {T} keys: bool mask {cpu_ms(lambda: sdpa(qb, kb, vb, attn_mask=seen[None, None])):.1f} ms, "
          f"float mask {cpu_ms(lambda: sdpa(qb, kb, vb, attn_mask=fmask[None, None])):.1f} ms, "
          f"no mask {cpu_ms(lambda: sdpa(qb, kb, vb)):.1f} ms")
    qc = torch.randn(1, HQ, T, D, dtype=dt)
    print(f"{dt}: causal prefill of all {T} rows (is_causal, GQA): {cpu_ms(lambda: sdpa(qc, kb, vb, is_causal=True, enable_gqa=True)):.1f} ms")
    plan = sdpa_plan(pos, T, HQ // HKV, dt)
    print(f"{dt}: plan build {cpu_ms(lambda: sdpa_plan(pos, T, HQ // HKV, dt)):.1f} ms")
    variants = [("current", lambda: blend_attention_sdpa(q, k, v, pos)),
                ("plan reused", lambda: blend_attention_sdpa(q, k, v, pos, plan=plan))]
    variants += [(f"split {b}", lambda b=b: split_attention(q, k, v, pos, b)) for b in (4, 8, 16)]
    for name, fn in variants:
        err = float((fn().float() - ref).abs().max())
        print(f"{dt}: {name:11s} {cpu_ms(fn):6.1f} ms  (max abs error vs fp32 reference {err:.3g})")


def main() -> None:
    for dt in (torch.bfloat16, torch.float32):
        measure(dt)


if __name__ == "__main__":
    main()
