"""Optional triton import: kernel files import `triton`/`tl` from here so that the torch references
beside the kernels stay importable on a torch-only install (the @triton.jit functions then become inert
plain functions that the dispatcher never calls)."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # torch-only install
    HAS_TRITON = False

    class _StubTriton:
        @staticmethod
        def jit(fn=None, **_kwargs):
            return fn if fn is not None else (lambda f: f)

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 << max(n - 1, 0).bit_length()

    class _StubTl:
        constexpr = object  # only used in annotations of the inert kernels

    triton = _StubTriton()
    tl = _StubTl()


def is_interpreted(kernel) -> bool:
    """True when `kernel` runs in triton's CPU interpreter: TRITON_INTERPRET=1 was set when the @triton.jit
    decorator ran (i.e. when the kernel module was first imported); setting it later has no effect."""
    return HAS_TRITON and type(kernel).__name__ == "InterpretedFunction"


__all__ = ["HAS_TRITON", "is_interpreted", "tl", "triton"]
