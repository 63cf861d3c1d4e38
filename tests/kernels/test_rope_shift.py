"""rope_shift: the torch reference against transformers' RoPE, the Triton kernel against the reference."""

import pytest
import torch
from kernel_testing import DEVICE, TOL, assert_verbose_allclose, requires_triton
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from ragkv.kernels.rope_shift import rope_shift_torch, rope_shift_triton, rope_tables

ROPE_PARAMETERS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 1024},
}


def _rotary(rope: str, head_dim: int) -> LlamaRotaryEmbedding:
    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                         max_position_embeddings=8192, rope_parameters=ROPE_PARAMETERS[rope])
    return LlamaRotaryEmbedding(config)


def _hf_keys(rotary, k_raw, pos):
    # k_raw [H, T, R] -> HF's key at positions pos [T] (apply_rotary_pos_emb, fp32)
    cos, sin = rotary(k_raw, pos[None])
    _, k = apply_rotary_pos_emb(k_raw[None], k_raw[None], cos, sin)
    return k[0]


@pytest.mark.parametrize("rope", list(ROPE_PARAMETERS))
def test_reference_shift_equals_hf_key_at_new_position(rope):
    torch.manual_seed(0)
    rotary = _rotary(rope, 64)
    k_raw = torch.randn(2, 257, 64)
    pos = torch.arange(257) + 100
    delta = torch.randint(-100, 1500, (257,))
    shifted = rope_shift_torch(_hf_keys(rotary, k_raw, pos), delta, rotary.inv_freq)
    # HF's own fp32 angle (p + d) * inv_freq carries ~|p + d| * 6e-8 rad of rounding
    assert_verbose_allclose(shifted, _hf_keys(rotary, k_raw, pos + delta), atol=1e-3, rtol=1e-4)


def test_attention_scaling_is_not_applied_twice():
    # yarn keys already carry attention_scaling once; scaling the shift again would be wrong
    torch.manual_seed(0)
    rotary = _rotary("yarn", 64)
    assert rotary.attention_scaling > 1.1
    k_raw = torch.randn(2, 33, 64)
    pos, delta = torch.arange(33), torch.full((33,), 77)
    expected = _hf_keys(rotary, k_raw, pos + delta)
    shifted = rope_shift_torch(_hf_keys(rotary, k_raw, pos), delta, rotary.inv_freq)
    assert_verbose_allclose(shifted, expected, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(shifted * rotary.attention_scaling, expected, atol=1e-2)


def test_reference_partial_rotary_matches_hf_style():
    # partial rotary (GPT-NeoX / Phi): rotate k[..., :R] with HF's RoPE, pass k[..., R:] through
    torch.manual_seed(0)
    R, D = 32, 96
    rotary = _rotary("default", R)
    k_raw = torch.randn(2, 50, D)
    pos, delta = torch.arange(50), torch.randint(-40, 300, (50,))

    def hf(p):
        return torch.cat((_hf_keys(rotary, k_raw[..., :R].contiguous(), p), k_raw[..., R:]), dim=-1)

    shifted = rope_shift_torch(hf(pos), delta, rotary.inv_freq, rotary_dim=R)
    assert_verbose_allclose(shifted, hf(pos + delta), atol=1e-4, rtol=1e-4)


def _inputs(H, T, D, storage, seed=0):
    g = torch.Generator().manual_seed(seed)
    delta = torch.randint(-3000, 3000, (T,), generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    if storage == "int8-token":
        k = torch.randint(-127, 128, (H, T, D), generator=g, dtype=torch.int8)
        scale = torch.rand(H, T, 1, generator=g) / 64
    elif storage == "int8-channel":
        k = torch.randint(-127, 128, (H, T, D), generator=g, dtype=torch.int8)
        scale = torch.rand(H, 1, D, generator=g) / 64
    else:
        k, scale = torch.randn(H, T, D, generator=g).to(storage), None
    to = lambda x: None if x is None else x.to(DEVICE)  # noqa: E731
    return to(k), to(scale), to(delta), to(inv_freq)


STORAGE = [torch.float32, torch.float16, torch.bfloat16, "int8-token", "int8-channel"]


@requires_triton
@pytest.mark.parametrize("T", [1, 7, 333, 4099])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("storage", STORAGE, ids=str)
def test_triton_matches_reference(T, D, storage):
    k, scale, delta, inv_freq = _inputs(2, T, D, storage)
    out_dtype = torch.bfloat16 if storage == "int8-token" else torch.float16 if storage == "int8-channel" else None
    got = rope_shift_triton(k, delta, inv_freq, scale=scale, out_dtype=out_dtype)
    ref = rope_shift_torch(k, delta, inv_freq, scale=scale, out_dtype=out_dtype)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    # both compute in fp32 and round once to the output dtype: at most one output ulp apart
    atol, rtol = TOL[got.dtype]
    assert_verbose_allclose(got, ref, atol=atol, rtol=rtol)


@requires_triton
@pytest.mark.parametrize("H", [1, 3, 8])
def test_triton_strided_partial_rotary_and_huge_deltas(H):
    # k is a strided view along T (every other token of a bigger cache), rotary_dim 64 < D 80,
    # deltas up to +-60000 exercise the range reduction: fp32 kernel vs float64-angle reference
    g = torch.Generator().manual_seed(H)
    big = torch.randn(H, 2 * 129, 80, generator=g).to(DEVICE)
    k = big[:, ::2]
    delta = torch.randint(-60000, 60000, (129,), generator=g).to(DEVICE)
    inv_freq = (1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))).to(DEVICE)
    got = rope_shift_triton(k, delta, inv_freq, rotary_dim=64)
    ref = rope_shift_torch(k, delta, inv_freq, rotary_dim=64)
    assert_verbose_allclose(got, ref, atol=2e-5, rtol=1e-5)
    assert torch.equal(got[..., 64:], k[..., 64:])


def test_input_checks():
    k = torch.randint(-5, 5, (1, 4, 8), dtype=torch.int8)
    with pytest.raises(AssertionError, match="scale"):
        rope_shift_torch(k, torch.zeros(4, dtype=torch.long), torch.ones(4))
    with pytest.raises(AssertionError, match="rotary_dim"):
        rope_shift_torch(k.float(), torch.zeros(4, dtype=torch.long), torch.ones(4), rotary_dim=6)


@pytest.mark.parametrize("storage", [torch.float32, torch.bfloat16, "int8-token"], ids=str)
def test_reference_with_tables_and_in_place_is_bitwise_the_same(storage):
    # the blend re-rotates the same span in every layer: cos/sin built once (rope_tables) and the
    # rotation written over the keys themselves must give exactly the fresh-tensor result
    k, scale, delta, inv_freq = _inputs(3, 301, 80, storage)
    kw = {"scale": scale, "out_dtype": torch.bfloat16 if scale is not None else None, "rotary_dim": 64}
    inv_freq = inv_freq[:32]
    ref = rope_shift_torch(k, delta, inv_freq, **kw)
    tables = rope_tables(delta, inv_freq)
    assert torch.equal(rope_shift_torch(k, delta, inv_freq, tables=tables, **kw), ref)
    if scale is None:  # in place (the input is the output: fp32 keys are read as they are, no copy)
        big = k.clone()[None]
        span = big[0]
        got = rope_shift_torch(span, delta, inv_freq, tables=tables, out=span, **kw)
        assert got.data_ptr() == span.data_ptr() and torch.equal(span, ref)
    out = torch.empty(k.shape, dtype=ref.dtype)
    assert rope_shift_torch(k, delta, inv_freq, tables=tables, out=out, **kw) is out and torch.equal(out, ref)


def test_out_and_tables_are_checked():
    k, _, delta, inv_freq = _inputs(2, 9, 64, torch.float32)
    with pytest.raises(AssertionError, match="out"):
        rope_shift_torch(k, delta, inv_freq, out=torch.empty(2, 9, 64, dtype=torch.bfloat16))
    with pytest.raises(AssertionError, match="tables"):
        rope_shift_torch(k, delta, inv_freq, tables=rope_tables(delta[:5], inv_freq))


@requires_triton
def test_triton_in_place_matches_reference():
    k, _, delta, inv_freq = _inputs(3, 333, 64, torch.bfloat16)
    ref = rope_shift_torch(k, delta, inv_freq)
    span = k.clone()
    assert rope_shift_triton(span, delta, inv_freq, out=span) is span
    atol, rtol = TOL[span.dtype]
    assert_verbose_allclose(span, ref, atol=atol, rtol=rtol)
