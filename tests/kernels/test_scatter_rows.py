"""scatter_rows: Triton kernel against torch advanced-index assignment (a copy: results must be equal)."""

import pytest
import torch
from kernel_testing import DEVICE, requires_triton

from ragkv.kernels.scatter_rows import scatter_rows_torch, scatter_rows_triton


@requires_triton
@pytest.mark.parametrize("T", [1, 7, 333, 4099])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_triton_matches_reference(T, D, dtype):
    g = torch.Generator().manual_seed(T)
    n = max(1, T // 7)
    dst = torch.randn(3, T, D, generator=g).to(DEVICE, dtype)
    src = torch.randn(3, n, D, generator=g).to(DEVICE, dtype)
    index = torch.randperm(T, generator=g)[:n].to(DEVICE)
    got, ref = dst.clone(), dst.clone()
    assert scatter_rows_triton(got, src, index) is got
    scatter_rows_torch(ref, src, index)
    assert torch.equal(got, ref)


@requires_triton
@pytest.mark.parametrize("H", [1, 8])
def test_strided_views_and_cast(H):
    # dst is one layer's K inside a [layers, H, T, D] buffer seen through a transpose; src fp32 -> dst fp16
    # (not bf16: triton's CPU interpreter truncates fp32 -> bf16 where torch and the GPU round to nearest)
    g = torch.Generator().manual_seed(H)
    buf = torch.randn(2, 50, H, 64, generator=g).to(DEVICE, torch.float16)
    dst = buf[1].transpose(0, 1)  # [H, 50, 64], strides (64, H*64, 1)
    src = torch.randn(H, 9, 64, generator=g).to(DEVICE)
    index = torch.tensor([0, 3, 4, 10, 11, 12, 30, 48, 49], device=DEVICE)
    ref = dst.clone()
    scatter_rows_torch(ref, src, index)
    before = buf[0].clone()
    scatter_rows_triton(dst, src, index)
    assert torch.equal(dst, ref)
    assert torch.equal(buf[0], before)


@requires_triton
def test_empty_index_is_a_no_op():
    dst = torch.randn(2, 5, 64, device=DEVICE)
    ref = dst.clone()
    scatter_rows_triton(dst, torch.empty(2, 0, 64, device=DEVICE), torch.empty(0, dtype=torch.long, device=DEVICE))
    assert torch.equal(dst, ref)


@pytest.mark.parametrize("bad", [[0, 5], [-1, 2], [7, 100]])
def test_out_of_bounds_index_raises_on_both_backends_and_writes_nothing(bad):
    """The reference raised (or wrapped a negative index) while the kernel wrote outside dst."""
    buf = torch.zeros(2, 2, 12, 64, device=DEVICE)
    dst = buf[0, :, :5]  # [2, 5, 64] inside a larger buffer: an index of 5+ would land in buf
    src = torch.ones(2, 2, 64, device=DEVICE)
    index = torch.tensor(bad, device=DEVICE)
    for fn in (scatter_rows_torch, *((scatter_rows_triton,) if _triton_ok() else ())):
        with pytest.raises(IndexError, match=r"must lie in \[0, 5\)"):
            fn(dst, src, index)
        assert buf.abs().sum() == 0


def _triton_ok() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
