"""ragkv.kernels: the blend hot path as Triton kernels, each beside its torch reference."""
