"""scatter_rows: Triton vs torch index assignment, GB/s = (src read + dst rows written) / time."""

from functools import partial

from _common import bench_ms, parse_args, record


def main() -> None:
    args = parse_args(__doc__)
    import torch

    from ragkv.kernels.scatter_rows import scatter_rows_torch, scatter_rows_triton

    impls = {"triton": scatter_rows_triton, "torch": scatter_rows_torch}
    cases = [(8, 8192, 128, 0.15), (8, 32768, 128, 0.15)] if args.device == "cuda" else [(2, 256, 64, 0.15)]
    for H, T, D, ratio in cases:
        n = max(1, int(T * ratio))
        dst = torch.randn(H, T, D, device=args.device, dtype=args.torch_dtype)
        src = torch.randn(H, n, D, device=args.device, dtype=args.torch_dtype)
        index = torch.randperm(T, device=args.device)[:n].sort().values
        nbytes = 2 * src.numel() * src.element_size() + n * 8
        for impl in args.impls:
            fn = impls[impl]
            ms = bench_ms(partial(fn, dst, src, index), args.device)
            record(args, "scatter_rows", impl, f"H={H} T={T} n={n} D={D}", ms, "GB/s", nbytes / ms / 1e6)


if __name__ == "__main__":
    main()
