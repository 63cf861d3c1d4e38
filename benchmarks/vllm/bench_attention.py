"""Attention of the recomputed rows by original position: vLLM's CPU attention op vs ragkv's blocked SDPA.

    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/vllm/bench_attention.py --ratios 0.15,1

One layer of SmolLM2's shape (9 query heads, 3 kv heads, head dim 64, fp32) over a --tokens prompt:
the recomputed rows are a random --ratio of the chunk tokens plus a 48-token suffix, each attending to
the keys at positions <= its own. vLLM's op (``ops.cpu_attention_with_kv_cache``, the CPU backend's
kernel) masks bottom-right per request, so each run of consecutive recomputed positions becomes a
pseudo-request over the same block table with ``seq_len`` = the run's last position + 1: then its mask
is "key position <= the row's position" exactly. ragkv's op is ``ragkv.kernels.blend_attention`` (CPU:
blocked SDPA with a plan built once per active set, as the blend builds it). Prints the largest
difference between the two and the best-of-5 time of each, per ratio.
"""

from __future__ import annotations

import argparse
import time

import torch

HQ, HKV, D, BLOCK, PREFIX, SUFFIX = 9, 3, 64, 32, 30, 48


def setup(tokens: int, ratio: float, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    chunk = tokens - PREFIX - SUFFIX
    rows = torch.sort(torch.randperm(chunk, generator=g)[: int(ratio * chunk)]).values + PREFIX
    q_pos = torch.cat([rows, torch.arange(tokens - SUFFIX, tokens)])
    q = torch.randn(HQ, q_pos.numel(), D, generator=g)
    k, v = torch.randn(HKV, tokens, D, generator=g), torch.randn(HKV, tokens, D, generator=g)
    return q, k, v, q_pos


def vllm_attention(q, k, v, q_pos):
    """-> a function running vLLM's CPU attention for these rows (cache and metadata built once)."""
    import vllm._custom_ops as ops

    n, T = q_pos.numel(), k.shape[1]
    blocks = (T + BLOCK - 1) // BLOCK
    cache = torch.zeros(blocks, HKV, BLOCK * 2, D)  # the CPU backend's layout: key | value per block
    key_cache, value_cache = cache.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous(), key_cache,
                                   value_cache, torch.arange(T), "vec")
    cut = torch.nonzero(q_pos[1:] != q_pos[:-1] + 1).flatten() + 1  # runs of consecutive positions
    starts, ends = torch.cat([torch.tensor([0]), cut]), torch.cat([cut, torch.tensor([n])])
    qsl = torch.cat([starts, torch.tensor([n])]).to(torch.int32)
    seq_lens = (q_pos[ends - 1] + 1).to(torch.int32)
    table = torch.arange(blocks, dtype=torch.int32)[None].expand(starts.numel(), blocks).contiguous()
    query = q.transpose(0, 1).contiguous()

    def run():
        meta = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=starts.numel(), num_heads=HQ, num_kv_heads=HKV, head_dim=D, seq_lens=seq_lens,
            dtype=q.dtype, query_start_loc=qsl, causal=True, sliding_window_size=-1, isa="vec", enable_kv_split=False)
        out = torch.empty(n, HQ, D)
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=qsl,
            seq_lens=seq_lens, scale=D**-0.5, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table,
            softcap=0.0, scheduler_metadata=meta, s_aux=None)
        return out  # [n, Hq, D]

    return run, starts.numel()


def ragkv_attention(q, k, v, q_pos):
    from ragkv.kernels import dispatch as ops

    plan = ops.blend_attention_plan(q_pos, k.shape[1], HQ // HKV, q.dtype)
    return lambda: ops.blend_attention(q, k, v, q_pos, sm_scale=D**-0.5, plan=plan).transpose(0, 1)  # [n, Hq, D]


def best_of(fn, reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=3087)
    ap.add_argument("--ratios", default="0.15,1")
    args = ap.parse_args()
    print(f"{torch.get_num_threads()} threads, {args.tokens} tokens, fp32, {HQ} q heads / {HKV} kv heads, head dim {D}")
    for ratio in (float(r) for r in args.ratios.split(",")):
        q, k, v, q_pos = setup(args.tokens, ratio)
        theirs, runs = vllm_attention(q, k, v, q_pos)
        ours = ragkv_attention(q, k, v, q_pos)
        diff = float((theirs() - ours()).abs().max())
        t_vllm, t_ragkv = best_of(theirs), best_of(ours)
        t_vllm, t_ragkv = min(t_vllm, best_of(theirs)), min(t_ragkv, best_of(ours))  # interleaved twice
        print(f"ratio {ratio:g}: {q_pos.numel()} rows in {runs} runs; max |vLLM - ragkv| {diff:.1e}; "
              f"vLLM op {t_vllm * 1e3:.1f} ms, ragkv blocked SDPA {t_ragkv * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
