"""rope_shift: Triton vs torch reference, GB/s = (bytes read + bytes written) / time."""

from functools import partial

from _common import bench_ms, parse_args, record


def main() -> None:
    args = parse_args(__doc__)
    import torch

    from ragkv.kernels.rope_shift import rope_shift_torch, rope_shift_triton

    impls = {"triton": rope_shift_triton, "torch": rope_shift_torch}
    cases = [(8, 8192, 128), (8, 32768, 128)] if args.device == "cuda" else [(2, 256, 64)]
    for H, T, D in cases:
        for storage in (args.torch_dtype, torch.int8):
            k = torch.randn(H, T, D, device=args.device).to(storage) if storage != torch.int8 else \
                torch.randint(-127, 128, (H, T, D), dtype=torch.int8, device=args.device)
            scale = torch.rand(H, T, 1, device=args.device) if storage == torch.int8 else None
            delta = torch.randint(-4096, 4096, (T,), device=args.device)
            inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32, device=args.device) / D))
            nbytes = k.numel() * (k.element_size() + args.torch_dtype.itemsize) + T * 8 + \
                (scale.numel() * 4 if scale is not None else 0)
            case = f"H={H} T={T} D={D} in={str(storage).split('.')[-1]}"
            for impl in args.impls:
                fn = impls[impl]
                ms = bench_ms(partial(fn, k, delta, inv_freq, scale=scale, out_dtype=args.torch_dtype), args.device)
                record(args, "rope_shift", impl, case, ms, "GB/s", nbytes / ms / 1e6)


if __name__ == "__main__":
    main()
