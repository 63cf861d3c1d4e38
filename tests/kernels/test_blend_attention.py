"""blend_attention: the torch reference against transformers' eager attention, the kernel against it."""

import types

import pytest
import torch
from kernel_testing import DEVICE, TOL, assert_verbose_allclose, requires_triton
from transformers.models.llama.modeling_llama import eager_attention_forward

from ragkv.kernels.blend_attention import blend_attention_torch, blend_attention_triton


def _inputs(kv_heads, group, n, T, D, dtype, shuffled_k_pos=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(kv_heads * group, n, D, generator=g)
    k = torch.randn(kv_heads, T, D, generator=g)
    v = torch.randn(kv_heads, T, D, generator=g)
    # the blend case: queries are a sorted subset of the fused tokens
    q_pos = torch.randperm(T, generator=g)[:n].sort().values if n <= T else torch.randint(0, T, (n,), generator=g)
    k_pos = torch.randperm(T, generator=g) if shuffled_k_pos else None
    to = lambda x: None if x is None else x.to(DEVICE, dtype if x.is_floating_point() else x.dtype)  # noqa: E731
    return to(q), to(k), to(v), to(q_pos), to(k_pos)


def _hf_eager(q, k, v, q_pos, k_pos, sm_scale):
    # transformers' eager_attention_forward with a 4-D additive mask built from positions
    group = q.shape[0] // k.shape[0]
    module = types.SimpleNamespace(num_key_value_groups=group, training=False)
    k_pos = torch.arange(k.shape[1]) if k_pos is None else k_pos
    visible = k_pos[None, :] <= q_pos[:, None]
    mask = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)[None, None]
    out, _ = eager_attention_forward(module, q[None], k[None], v[None], mask, scaling=sm_scale)
    return out[0].transpose(0, 1)  # [1, n, Hq, D] -> [Hq, n, D]


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("shuffled_k_pos", [False, True])
def test_reference_matches_hf_eager(group, shuffled_k_pos):
    q, k, v, q_pos, k_pos = (x if x is None else x.cpu() for x in _inputs(2, group, 37, 200, 64, torch.float32,
                                                                            shuffled_k_pos, seed=group))
    q_pos = q_pos.clamp(min=1)  # every query sees at least one key (HF has no "sees nothing" case)
    got = blend_attention_torch(q, k, v, q_pos, k_pos, sm_scale=0.1, chunk=16)
    assert_verbose_allclose(got, _hf_eager(q, k, v, q_pos, k_pos, 0.1), atol=1e-5, rtol=1e-5)


# (kv_heads, group, n, T, D): GQA 1/3/8, odd shapes, long T with few query rows
SHAPES = [
    (2, 1, 1, 1, 64),
    (2, 3, 7, 7, 64),
    (1, 8, 5, 333, 128),
    (3, 3, 40, 333, 64),
    (2, 1, 70, 333, 128),
    (1, 8, 3, 4099, 128),
    (2, 3, 9, 4099, 64),
]


@requires_triton
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_triton_matches_reference(shape, dtype):
    kv_heads, group, n, T, D = shape
    q, k, v, q_pos, _ = _inputs(kv_heads, group, n, T, D, dtype, seed=T + n)
    got = blend_attention_triton(q, k, v, q_pos)
    ref = blend_attention_torch(q, k, v, q_pos)
    assert got.dtype == dtype and got.shape == q.shape
    atol, rtol = TOL[dtype]
    assert_verbose_allclose(got, ref, atol=atol, rtol=rtol)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_shuffled_k_pos_scale_and_blind_queries(dtype):
    # arbitrary key positions (no early stop), custom sm_scale, a query before every key -> zeros
    q, k, v, q_pos, k_pos = _inputs(2, 3, 20, 333, 64, dtype, shuffled_k_pos=True, seed=5)
    k_pos = k_pos + 10
    q_pos[0] = 3
    got = blend_attention_triton(q, k, v, q_pos, k_pos, sm_scale=0.2)
    ref = blend_attention_torch(q, k, v, q_pos, k_pos, sm_scale=0.2)
    atol, rtol = TOL[dtype]
    assert_verbose_allclose(got, ref, atol=atol, rtol=rtol)
    assert torch.equal(got[:, 0].float().cpu(), torch.zeros(6, 64))


@requires_triton
def test_triton_strided_q():
    # q as a view of [n, Hq, D] (the layout a model's projection produces)
    q, k, v, q_pos, _ = _inputs(2, 3, 25, 333, 64, torch.float16, seed=9)
    q_nhd = q.transpose(0, 1).contiguous()
    got = blend_attention_triton(q_nhd.transpose(0, 1), k, v, q_pos)
    assert_verbose_allclose(got, blend_attention_torch(q, k, v, q_pos), *TOL[torch.float16])


@pytest.mark.parametrize("n,T,group", [(1, 7, 1), (37, 333, 3), (200, 1500, 3), (64, 4099, 8)])
@pytest.mark.parametrize("order", ["unsorted", "sorted"])
def test_blocked_sdpa_path_matches_reference(n, T, group, order):
    from ragkv.kernels.blend_attention import blend_attention_sdpa, sdpa_plan

    g = torch.Generator().manual_seed(n + T)
    Hkv, D = 2, 64
    q = torch.randn(Hkv * group, n, D, generator=g)
    k, v = torch.randn(Hkv, T, D, generator=g), torch.randn(Hkv, T, D, generator=g)
    q_pos = torch.randperm(T, generator=g)[:n]  # scattered
    if order == "sorted":  # the engine's active rows: the blocks are slices of q, no gather
        q_pos = q_pos.sort().values
        assert all(isinstance(b.idx, slice) for b in sdpa_plan(q_pos, T, group, q.dtype, blocks=5))
    got = blend_attention_sdpa(q, k, v, q_pos, sm_scale=0.11, blocks=5)
    assert got.shape == q.shape and got.transpose(0, 1).is_contiguous()  # [Hq, n, D] over an [n, Hq, D] buffer
    assert_verbose_allclose(got, blend_attention_torch(q, k, v, q_pos, sm_scale=0.11), atol=2e-5, rtol=2e-5)


def test_blocked_sdpa_plan_built_once_gives_the_same_attention():
    from ragkv.kernels.blend_attention import blend_attention_sdpa, sdpa_plan

    g = torch.Generator().manual_seed(5)
    Hkv, group, D, T, n = 2, 3, 64, 700, 150
    q_pos = torch.randperm(T, generator=g)[:n]
    plan = sdpa_plan(q_pos, T, group, torch.float32)
    for _ in range(2):  # one plan, two "layers" with their own q/k/v
        q = torch.randn(Hkv * group, n, D, generator=g)
        k, v = torch.randn(Hkv, T, D, generator=g), torch.randn(Hkv, T, D, generator=g)
        got = blend_attention_sdpa(q, k, v, q_pos, plan=plan)
        assert torch.equal(got, blend_attention_sdpa(q, k, v, q_pos))
        assert_verbose_allclose(got, blend_attention_torch(q, k, v, q_pos), atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="plan covers other queries"):
        blend_attention_sdpa(q[:, :-1], k, v, q_pos[:-1], plan=plan)


def test_blocked_sdpa_plan_zeroes_a_query_that_sees_no_key():
    from ragkv.kernels.blend_attention import blend_attention_sdpa, sdpa_plan

    q, k, v = torch.randn(2, 3, 8), torch.randn(1, 5, 8), torch.randn(1, 5, 8)
    q_pos = torch.tensor([-1, 2, 4])
    plan = sdpa_plan(q_pos, 5, 2, torch.float32)
    got = blend_attention_sdpa(q, k, v, q_pos, plan=plan)
    assert torch.equal(got[:, 0], torch.zeros(2, 8))
    assert_verbose_allclose(got, blend_attention_torch(q, k, v, q_pos), atol=2e-5, rtol=2e-5)
