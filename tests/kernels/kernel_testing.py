"""Shared helpers for tests/kernels: device choice, triton skip marker, a verbose allclose."""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

_can_run = HAS_TRITON and (DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
requires_triton = pytest.mark.skipif(not _can_run, reason="triton missing (or CPU without TRITON_INTERPRET=1)")

# (atol, rtol) per compute dtype for "kernel vs fp32 reference" on O(1) values
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (3e-3, 3e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def assert_verbose_allclose(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float,
                            max_print: int = 5) -> None:
    """torch.testing-like allclose whose failure says how many elements mismatch, where the worst one is,
    and how many NaN/inf each side holds (NaN == NaN counts as equal)."""
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    close = torch.isclose(a, e, rtol=rtol, atol=atol, equal_nan=True)
    if bool(close.all()):
        return
    bad = (~close).nonzero()
    diff = (a - e).abs().nan_to_num(nan=float("inf"))
    diff[close] = 0
    worst = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    lines = [
        f"{bad.shape[0]} / {a.numel()} elements mismatch (atol={atol}, rtol={rtol})",
        f"worst at {worst}: actual={a[worst].item():.6g} expected={e[worst].item():.6g} "
        f"|diff|={diff[worst].item():.3g}",
        f"NaN actual/expected: {int(a.isnan().sum())}/{int(e.isnan().sum())}, "
        f"inf actual/expected: {int(a.isinf().sum())}/{int(e.isinf().sum())}",
    ]
    for idx in bad[:max_print].tolist():
        idx = tuple(idx)
        lines.append(f"  at {idx}: actual={a[idx].item():.6g} expected={e[idx].item():.6g}")
    raise AssertionError("\n".join(lines))
