"""kv_deviation (mode kv): Triton vs torch reference, GB/s = bytes of the four inputs / time."""

from functools import partial

from _common import bench_ms, parse_args, record


def main() -> None:
    args = parse_args(__doc__)
    import torch

    from ragkv.kernels.kv_deviation import kv_deviation_torch, kv_deviation_triton

    impls = {"triton": kv_deviation_triton, "torch": kv_deviation_torch}
    cases = [(8, 8192, 128), (8, 32768, 128)] if args.device == "cuda" else [(2, 256, 64)]
    for H, T, D in cases:
        fk, ck, fv, cv = (torch.randn(H, T, D, device=args.device, dtype=args.torch_dtype) for _ in range(4))
        nbytes = 4 * fk.numel() * fk.element_size() + T * 4
        for impl in args.impls:
            fn = impls[impl]
            ms = bench_ms(partial(fn, fk, ck, fv, cv, mode="kv"), args.device)
            record(args, "kv_deviation", impl, f"H={H} T={T} D={D}", ms, "GB/s", nbytes / ms / 1e6)


if __name__ == "__main__":
    main()
