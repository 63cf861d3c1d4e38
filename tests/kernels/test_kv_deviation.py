"""kv_deviation and select_topk: Triton kernel against the torch reference."""

import pytest
import torch
from kernel_testing import DEVICE, assert_verbose_allclose, requires_triton

from ragkv.kernels.kv_deviation import kv_deviation_torch, kv_deviation_triton, select_topk


def _pairs(H, T, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    cached = [torch.randn(H, T, D, generator=g) for _ in range(2)]
    fresh = [c + 0.1 * torch.randn(H, T, D, generator=g) * torch.rand(1, T, 1, generator=g) for c in cached]
    to = lambda x: x.to(DEVICE, dtype)  # noqa: E731
    return to(fresh[0]), to(cached[0]), to(fresh[1]), to(cached[1])


@requires_triton
@pytest.mark.parametrize("T", [1, 7, 333, 4099])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_triton_matches_reference(T, D, dtype):
    fk, ck, fv, cv = _pairs(3, T, D, dtype)
    got = kv_deviation_triton(fk, ck, fv, cv, mode="kv")
    ref = kv_deviation_torch(fk, ck, fv, cv, mode="kv")
    assert got.shape == (T,) and got.dtype == torch.float32
    # identical fp32 inputs to the sums, only the summation order differs
    assert_verbose_allclose(got, ref, atol=1e-6, rtol=1e-4)


@requires_triton
@pytest.mark.parametrize("H", [1, 8])
@pytest.mark.parametrize("mode", ["k", "v", "kv"])
@pytest.mark.parametrize("normalize", [False, True])
def test_modes_and_normalize(H, mode, normalize):
    fk, ck, fv, cv = _pairs(H, 333, 64, torch.float16, seed=H)
    args = (fk, ck, None, None) if mode == "k" else (None, None, fv, cv) if mode == "v" else (fk, ck, fv, cv)
    got = kv_deviation_triton(*args, mode=mode, normalize=normalize)
    ref = kv_deviation_torch(*args, mode=mode, normalize=normalize)
    assert_verbose_allclose(got, ref, atol=1e-6, rtol=1e-4)


def test_reference_definition():
    fk, ck, fv, cv = (torch.randn(2, 5, 4) for _ in range(4))
    dk = ((fk - ck) ** 2).sum(dim=(0, 2))
    dv = ((fv - cv) ** 2).sum(dim=(0, 2))
    assert_verbose_allclose(kv_deviation_torch(fk, ck, fv, cv, mode="kv"), dk + dv, atol=1e-6, rtol=1e-6)
    rel = dk / (ck**2).sum(dim=(0, 2)) + dv / (cv**2).sum(dim=(0, 2))
    assert_verbose_allclose(kv_deviation_torch(fk, ck, fv, cv, mode="kv", normalize=True), rel, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="mode"):
        kv_deviation_torch(fk, ck, mode="q")
    with pytest.raises(AssertionError, match="needs both"):
        kv_deviation_torch(fk, ck, mode="v")


def test_select_topk_is_sorted_topk():
    scores = torch.tensor([0.1, 5.0, 3.0, -1.0, 4.0])
    assert select_topk(scores, 3).tolist() == [1, 2, 4]
    assert select_topk(scores, 99).tolist() == [0, 1, 2, 3, 4]
    assert select_topk(scores, 0).numel() == 0
