"""blend_attention: Triton vs torch eager reference, TFLOP/s = 4 * D * q_heads * sum_i(visible keys of i) / time."""

from functools import partial

from _common import bench_ms, parse_args, record


def main() -> None:
    args = parse_args(__doc__)
    import torch

    from ragkv.kernels.blend_attention import blend_attention_torch, blend_attention_triton

    impls = {"triton": blend_attention_triton, "torch": blend_attention_torch}
    # (kv_heads, group, T, D, recompute ratio): Llama-3-8B-like layer; the CPU case is tiny
    cases = [(8, 4, 8192, 128, 0.15), (8, 4, 32768, 128, 0.15)] if args.device == "cuda" else [(2, 4, 256, 64, 0.15)]
    for Hkv, group, T, D, ratio in cases:
        n = max(1, int(T * ratio))
        q = torch.randn(Hkv * group, n, D, device=args.device, dtype=args.torch_dtype)
        k, v = (torch.randn(Hkv, T, D, device=args.device, dtype=args.torch_dtype) for _ in range(2))
        q_pos = torch.randperm(T, device=args.device)[:n].sort().values
        flops = 4 * D * Hkv * group * float((q_pos + 1).sum())
        for impl in args.impls:
            fn = impls[impl]
            ms = bench_ms(partial(fn, q, k, v, q_pos), args.device)
            record(args, "blend_attention", impl, f"Hkv={Hkv} g={group} T={T} n={n} D={D}", ms, "TFLOP/s",
                   flops / ms / 1e9)


if __name__ == "__main__":
    main()
