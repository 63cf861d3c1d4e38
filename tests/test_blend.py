"""The read path: re-rotation, fusion, selective recompute, handoff to generate."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from blend_testlib import TEMPLATE, SlowStore, make_prompt
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ragkv import models
from ragkv.adapter import ModelAdapter, UnsupportedModelError
from ragkv.blend import (
    SELECTORS,
    BlendConfig,
    BlendEngine,
    DeviationSelector,
    QuerySelector,
    StartsSelector,
)
from ragkv.blend import attention as attention_mod
from ragkv.blend import cache as cache_mod
from ragkv.blend.select import SelectionRequest
from ragkv.kernels import dispatch as ops
from ragkv.prefill import prefill_kv
from ragkv.prompt import Prompt
from ragkv.store.memory import MemoryStore

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 512},
}


def full_logits(model, prompt: Prompt) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt.input_ids])).logits[0, -1].float()


def config(**cfg) -> BlendConfig:
    """BlendConfig with the deviation selector's settings (check_layers, signal, ...) among ``cfg``."""
    sel = {k: cfg.pop(k) for k in ("check_layers", "first_ratio", "signal", "normalize") if k in cfg}
    return BlendConfig(selector=DeviationSelector(**sel), **cfg)


def cache_arg(model, cache) -> dict:
    """The forward's cache argument under the installed transformers' name (the adapter's)."""
    return {ModelAdapter.of(model).cache_kw: cache}


def engine(model, **cfg) -> BlendEngine:
    return BlendEngine(model, None, MemoryStore(), config=config(**cfg), template=TEMPLATE)


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_rerotation_equals_prefill_at_new_offset_every_layer(rope):
    model = models.tiny_model("llama", rope_parameters=ROPES[rope])
    ids = torch.randint(10, 500, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    (stored,) = prefill_kv(ModelAdapter.of(model), [], [ids])  # computed alone at positions 0..36
    inv_freq = ModelAdapter.of(model).inv_freq
    for offset in (5, 300):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model.model(input_ids=torch.tensor([ids]), position_ids=torch.arange(offset, offset + 37)[None],
                        use_cache=True, **cache_arg(model, cache))
        delta = torch.full((37,), offset)
        for li, (k0, _) in enumerate(stored):
            moved = ops.rope_shift(k0, delta, inv_freq)
            torch.testing.assert_close(moved, cache.layers[li].keys[0], atol=2e-5, rtol=1e-4,
                                       msg=f"{rope} layer {li} offset {offset}")


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_ratio_one_equals_full_prefill(kind):
    model = models.tiny_model(kind)
    prompt = make_prompt()
    eng = engine(model)
    eng.prefill_prompt(prompt, ratio=0.15)  # first call computes and stores every chunk
    res = eng.prefill_prompt(prompt, ratio=1.0)
    assert res.stats.misses == 0 and res.stats.hits == 3
    assert res.stats.recomputed_tokens == sum(map(len, prompt.chunk_ids))
    torch.testing.assert_close(res.logits, full_logits(model, prompt), atol=1e-4, rtol=0)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_ratio_one_equals_full_prefill_under_each_attention_implementation(attn):
    model = models.tiny_model("llama", attn_implementation=attn)
    prompt = make_prompt(seed=2)
    eng = engine(model)
    eng.prefill_prompt(prompt)
    res = eng.prefill_prompt(prompt, ratio=1.0)
    torch.testing.assert_close(res.logits, full_logits(model, prompt), atol=1e-4, rtol=0)
    half = eng.prefill_prompt(prompt, ratio=0.5)  # a real blend: not full prefill, half the chunk tokens
    assert half.stats.recomputed_tokens == math.ceil(0.5 * sum(map(len, prompt.chunk_ids)))
    assert (half.logits - res.logits).abs().max() > 1e-4
    with torch.no_grad():  # both implementations blend to the same result
        other = models.tiny_model("llama", attn_implementation="sdpa" if attn == "eager" else "eager")
    res_other = engine(other).prefill_prompt(prompt, ratio=0.5)
    ref = eng.prefill_prompt(prompt, ratio=0.5)
    torch.testing.assert_close(res_other.logits, ref.logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_ratio_one_greedy_generation_equals_plain_generate(kind):
    model = models.tiny_model(kind)
    prompt = make_prompt(seed=3)
    eng = engine(model)
    eng.prefill_prompt(prompt)
    res = eng.prefill_prompt(prompt, ratio=1.0)
    assert res.cache.get_seq_length() == prompt.num_tokens - 1
    out = eng.adapter.generate(res.input_ids, res.cache, max_new_tokens=12)
    ids = torch.tensor([prompt.input_ids])
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                         pad_token_id=0)[0, ids.shape[1]:]
    assert torch.equal(out, ref)


def _store_exact_caches(eng: BlendEngine, model, prompt: Prompt) -> None:
    """Store, under the engine's keys, chunk K/V sliced out of a full prefill of this very prompt:
    the cached K/V are then exact, so blending at any ratio must reproduce full prefill."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model.model(input_ids=torch.tensor([prompt.input_ids]), use_cache=True, **cache_arg(model, cache))
    pieces = [(eng.keys.prefix_key(prompt.prefix_ids), prompt.prefix_ids, 0, "prefix")]
    pieces += [(eng.keys.chunk_key(ids), ids, s, "chunk") for ids, s in zip(prompt.chunk_ids, prompt.chunk_positions())]
    for key, ids, start, kind in pieces:
        layers = [(lay.keys[0, :, start : start + len(ids)].clone(), lay.values[0, :, start : start + len(ids)].clone())
                  for lay in cache.layers]
        assert eng.store.put(replace(eng.keys.meta(key, ids, kind), start_pos=start), layers)


def _bottom_right_mask(q_pos, total, dtype):
    n = q_pos.numel()
    allowed = torch.arange(total)[None, :] <= (total - n + torch.arange(n))[:, None]
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def _perturb(eng: BlendEngine, ids, token_rows, amount=3.0) -> None:
    """Shift the cached K and V of some tokens of a stored chunk by ``amount`` in every layer."""
    key = eng.keys.chunk_key(ids)
    entry = eng.store.get(key)
    layers = []
    for k, v in entry.layers:
        k, v = k.clone(), v.clone()
        k[:, token_rows] += amount
        v[:, token_rows] += amount
        layers.append((k, v))
    eng.store.delete(key)
    eng.store.put(entry.meta, layers)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])  # position-aware attention / explicit 4-D mask
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_recompute_attends_causally_by_original_position(kind, attn, monkeypatch):
    model = models.tiny_model(kind, attn_implementation=attn)
    prompt = make_prompt(seed=5, sizes=(21, 17, 30))
    eng = engine(model)
    _store_exact_caches(eng, model, prompt)
    # make a few early tokens (with gaps) deviate, so exactly they are selected; they are recomputed in
    # every layer, so with a correct mask the blend still reproduces full prefill exactly
    _perturb(eng, prompt.chunk_ids[0], [2, 9, 15])
    _perturb(eng, prompt.chunk_ids[1], [4, 11])
    expect = [4 + 2, 4 + 9, 4 + 15, 25 + 4, 25 + 11]
    full = full_logits(model, prompt)
    exact = DynamicCache(config=model.config)
    with torch.no_grad():
        model.model(input_ids=torch.tensor([prompt.input_ids]), use_cache=True, **cache_arg(model, exact))
    last = eng.adapter.num_layers - 1
    res = eng.prefill_prompt(prompt, ratio=5 / 68)
    assert res.selected.tolist() == expect
    torch.testing.assert_close(res.logits, full, atol=1e-4, rtol=0)
    torch.testing.assert_close(res.cache.layers[last].values[0][:, expect], exact.layers[last].values[0][:, expect])
    # the bug of the public implementations: a mask aligned to the bottom right of the active block
    # lets the recomputed tokens see keys after their own position
    if attn != "eager":
        return
    monkeypatch.setattr(attention_mod, "causal_mask_by_position", _bottom_right_mask)
    bad = eng.prefill_prompt(prompt, ratio=5 / 68)
    assert bad.selected.tolist() == expect
    assert (bad.cache.layers[last].values[0][:, expect] - exact.layers[last].values[0][:, expect]).abs().max() > 1e-2
    assert (bad.logits - full).abs().max() > 1e-3


def _naive_reference(model, eng: BlendEngine, prompt: Prompt):
    """Naive fusion without the engine: stored chunk K/V rotated with HF's own apply_rotary_pos_emb,
    concatenated after the prefix, then the suffix run through the model on top."""
    rot = model.model.rotary_emb
    ks, vs = [[] for _ in range(eng.adapter.num_layers)], [[] for _ in range(eng.adapter.num_layers)]
    entries = [(eng.store.get(eng.keys.prefix_key(prompt.prefix_ids)), 0)]
    keys = [eng.keys.lead_key(ids) if i == 0 and eng.keys.lead else eng.keys.chunk_key(ids) for i, ids in enumerate(prompt.chunk_ids)]
    entries += [(eng.store.get(key), s) for key, s in zip(keys, prompt.chunk_positions())]
    for entry, start in entries:
        n = entry.meta.num_tokens
        cos, sin = rot(torch.zeros(1), torch.full((1, n), start - entry.meta.start_pos))
        for li, (k, v) in enumerate(entry.layers):
            _, k_rot = apply_rotary_pos_emb(k[None], k[None], cos, sin)
            ks[li].append(k_rot)
            vs[li].append(v[None])
    cache = DynamicCache(config=model.config)
    for li in range(len(ks)):
        cache.update(torch.cat(ks[li], 2), torch.cat(vs[li], 2), li)
    ctx = cache.get_seq_length()
    suffix = torch.tensor([prompt.suffix_ids])
    with torch.no_grad():
        logits, cache = ModelAdapter.of(model).forward(suffix, cache, torch.arange(ctx, ctx + suffix.shape[1])[None])
    return logits[0, -1], cache


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_ratio_zero_equals_naive_fusion_and_suffix_is_recomputed(kind):
    model = models.tiny_model(kind)
    prompt = make_prompt(seed=7)
    eng = engine(model)
    eng.prefill_prompt(prompt)
    res = eng.prefill_prompt(prompt, ratio=0.0)
    ref_logits, ref_cache = _naive_reference(model, eng, prompt)
    torch.testing.assert_close(res.logits, ref_logits.float(), atol=1e-4, rtol=0)
    assert res.stats.recomputed_tokens == 0
    T = prompt.num_tokens
    for li in range(eng.adapter.num_layers):  # suffix rows (but the last token) are fresh, as in the reference
        s = T - len(prompt.suffix_ids)
        torch.testing.assert_close(res.cache.layers[li].keys[..., s:, :], ref_cache.layers[li].keys[..., s : T - 1, :])


def test_suffix_is_active_in_every_layer_and_selection_has_the_ratio(monkeypatch):
    model = models.tiny_model("llama")
    prompt = make_prompt(seed=9, sizes=(40, 40, 20))
    eng = engine(model, check_layers=(1, 2), first_ratio=0.6)
    eng.prefill_prompt(prompt)
    seen = []
    orig = cache_mod.FusedCache.update

    def spy(self, layer_idx, k, v, positions):
        seen.append((layer_idx, positions.clone()))
        return orig(self, layer_idx, k, v, positions)

    monkeypatch.setattr(cache_mod.FusedCache, "update", spy)
    res = eng.prefill_prompt(prompt, ratio=0.2)
    T, S, C, P = prompt.num_tokens, len(prompt.suffix_ids), 100, len(prompt.prefix_ids)
    suffix = set(range(T - S, T))
    last = eng.adapter.num_layers - 1
    # the last layer writes every active row's K/V, then runs the rest of it for the last token only
    assert [li for li, _ in seen].count(last) == 2 and seen[-1] == (last, torch.tensor([T - 1]))
    seen.pop()
    counts = {}
    for li, active in seen:
        assert suffix <= set(active.tolist()), f"layer {li} skipped suffix tokens"
        counts.setdefault(li, []).append(int(((active >= P) & (active < P + C)).sum()))
        if li > 1 or len(counts[li]) > 1:  # the exact prefix is not recomputed once the first check narrowed
            assert int((active < P).sum()) == 0
    # layer 0 computes every chunk token; a check layer writes the K/V of every active row, then runs
    # only the kept ones: 60% of the chunk after layer 1's check, 20% after layer 2's
    keep1, keep2 = math.ceil(0.6 * C), math.ceil(0.2 * C)
    assert counts[0] == [C] and counts[1] == [C, keep1] and counts[2] == [keep1, keep2] and counts[3] == [keep2]
    assert res.stats.recomputed_tokens == math.ceil(0.2 * C)
    assert res.selected.numel() == math.ceil(0.2 * C) and (res.selected < T - S).all()


@pytest.mark.parametrize("signal", ["k", "v", "kv"])
def test_selection_signals_pick_the_most_deviating_tokens(signal):
    model = models.tiny_model("llama")
    prompt = make_prompt(seed=11, sizes=(30, 30))
    eng = engine(model, signal=signal)
    _store_exact_caches(eng, model, prompt)
    # corrupt the cached V/K of 5 known tokens of chunk 2 (positions 4+30+[3, 8, 13, 18, 23]): exact
    # caches elsewhere mean those five have by far the largest deviation at the check layer
    bad = [3, 8, 13, 18, 23]
    _perturb(eng, prompt.chunk_ids[1], bad)
    res = eng.prefill_prompt(prompt, ratio=5 / 60)
    assert sorted(res.selected.tolist()) == [4 + 30 + b for b in bad]


def test_unsupported_architectures_are_refused_clearly():
    with pytest.raises(UnsupportedModelError, match="depends on sequence length"):
        ModelAdapter.of(models.tiny_model("llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4,
                                                                     "factor": 2.0}))
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match="Llama-family layout"):
        BlendEngine(gpt2, None, MemoryStore(), template=TEMPLATE)
    windowed = models.tiny_model("mistral", sliding_window=16)
    with pytest.raises(UnsupportedModelError, match="sliding window"):
        engine(windowed).prefill_prompt(make_prompt())
    with pytest.raises(UnsupportedModelError, match="partial rotary"):
        ModelAdapter.of(models.tiny_model("llama", rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                     "partial_rotary_factor": 0.5}))


class _KVRecorder:
    """The cache contract's ragkv side, recording the K/V each layer writes; attends over them only."""

    def __init__(self):
        self.written = []

    def update(self, li, k, v, positions):
        self.written.append((li, k.clone(), v.clone()))
        return k, v


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_layer_kv_gives_the_layers_kv_and_runs_neither_attention_nor_mlp(attn, monkeypatch):
    model = models.tiny_model("llama", attn_implementation=attn)
    a = ModelAdapter.of(model)
    hidden = torch.randn(1, 9, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    pos = torch.tensor([0, 2, 3, 7, 8, 11, 12, 13, 20])
    mlp_calls, attention_calls = [], []
    model.model.layers[1].mlp.register_forward_hook(lambda *_: mlp_calls.append(1))
    real_sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *x, **kw: attention_calls.append(1) or real_sdpa(*x, **kw))
    monkeypatch.setattr(torch, "matmul", lambda *x, f=torch.matmul, **kw: attention_calls.append(1) or f(*x, **kw))
    full = _KVRecorder()
    with torch.no_grad():
        a.run_layer(1, hidden, pos, full, attention_mask=attention_mod.causal_mask_by_position(pos, 21, torch.float32)[..., pos])
        assert len(mlp_calls) == 1 and attention_calls  # run_layer's
        attention_calls.clear()
        k2, v2 = a.layer_kv(1, hidden, pos)
    assert len(mlp_calls) == 1 and not attention_calls  # layer_kv ran neither
    ((li, k, v),) = full.written
    assert li == 1
    torch.testing.assert_close(k2, k, rtol=0, atol=0)
    torch.testing.assert_close(v2, v, rtol=0, atol=0)
    model.model.layers[1].self_attn.forward = lambda hidden_states, *args, **kw: (hidden_states, None)  # writes no K/V
    with pytest.raises(UnsupportedModelError, match="attention of layer 1 of LlamaForCausalLM wrote no K/V"):
        a.layer_kv(1, hidden, pos)


def test_check_layers_give_what_running_the_whole_layer_over_every_active_row_gives(monkeypatch):
    """A check layer runs only the K/V of the rows it then drops (ModelAdapter.layer_kv): the result
    equals running the whole layer over every active row and narrowing after it."""
    from ragkv.blend.attention import position_attention

    model = models.tiny_model("llama")
    prompt = make_prompt(seed=13, sizes=(30, 25, 35))
    eng = engine(model, check_layers=(1, 2), first_ratio=0.5)
    eng.prefill_prompt(prompt)  # stores the chunks
    narrowed = eng.prefill_prompt(prompt, ratio=0.2)
    a = eng.adapter

    def whole_layer(li, hidden, positions, position_embeddings=None):  # what a check layer did before layer_kv
        recorder = _KVRecorder()
        a.run_layer(li, hidden, positions, recorder, attention=position_attention, ragkv_q_pos=positions)
        return recorder.written[0][1:]

    monkeypatch.setattr(a, "layer_kv", whole_layer)
    whole = eng.prefill_prompt(prompt, ratio=0.2)
    assert narrowed.selected.tolist() == whole.selected.tolist()
    torch.testing.assert_close(narrowed.logits, whole.logits, rtol=1e-5, atol=1e-5)
    for got, want in zip(narrowed.cache.layers, whole.cache.layers):
        torch.testing.assert_close(got.keys, want.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.values, want.values, rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_clear_errors():
    model = models.tiny_model("llama")
    eng = engine(model)
    with pytest.raises(ValueError, match="ratio"):
        eng.prefill_prompt(make_prompt(), ratio=1.5)
    with pytest.raises(ValueError, match="ratio"):
        BlendConfig(ratio=-0.1)
    with pytest.raises(ValueError, match="signal"):
        DeviationSelector(signal="q")
    with pytest.raises(ValueError, match="check layer"):
        engine(model, check_layers=(9,)).prefill_prompt(make_prompt())
    with pytest.raises(ValueError, match="longer than the model's window"):
        eng.prefill_prompt(make_prompt(sizes=(1500, 700)))


def test_missing_and_corrupt_entries_are_recomputed_and_written_back(tmp_path):
    from ragkv.store.disk import DiskStore

    model = models.tiny_model("llama")
    prompt = make_prompt(seed=13)
    store = DiskStore(tmp_path / "kv", fsync=False)
    eng = BlendEngine(model, None, store, config(), template=TEMPLATE)
    first = eng.prefill_prompt(prompt, ratio=1.0)
    assert first.stats.misses == 3 and first.stats.hits == 0
    second = eng.prefill_prompt(prompt, ratio=1.0)
    assert second.stats.misses == 0 and second.stats.hits == 3
    torch.testing.assert_close(first.logits, second.logits, atol=1e-5, rtol=0)
    # damage chunk 1's header (lookup: a miss) and flip a byte of chunk 2's last layer (found mid-request)
    k1, k2 = (eng.keys.chunk_key(ids) for ids in prompt.chunk_ids[1:])
    data = bytearray(store.path(k1).read_bytes())
    data[40] ^= 0xFF
    store.path(k1).write_bytes(bytes(data))
    data = bytearray(store.path(k2).read_bytes())
    data[-100] ^= 0xFF
    store.path(k2).write_bytes(bytes(data))
    third = eng.prefill_prompt(prompt, ratio=1.0)
    assert (third.stats.hits, third.stats.misses, third.stats.corrupt) == (2, 1, 1)
    torch.testing.assert_close(third.logits, first.logits, atol=1e-5, rtol=0)
    assert store.get(k1) is not None and store.get(k2) is not None  # both written back, intact
    assert eng.prefill_prompt(prompt, ratio=1.0).stats.corrupt == 0


@pytest.mark.parametrize("selector", ["deviation", "query"])
def test_engine_gives_the_same_blend_with_either_kernel_backend(selector):
    pytest.importorskip("triton")
    model = models.tiny_model("llama")
    prompt = make_prompt(seed=17, sizes=(9, 6))
    eng = BlendEngine(model, None, MemoryStore(), BlendConfig(selector=selector), template=TEMPLATE)
    eng.prefill_prompt(prompt)
    out = {}
    for backend in ("torch", "triton"):
        with ops.use_backend(backend):
            out[backend] = (eng.prefill_prompt(prompt, ratio=1.0), eng.prefill_prompt(prompt, ratio=0.3))
    for backend, (full, _) in out.items():
        torch.testing.assert_close(full.logits, full_logits(model, prompt), atol=1e-4, rtol=0, msg=backend)
    torch.testing.assert_close(out["triton"][1].logits, out["torch"][1].logits, atol=1e-4, rtol=0)
    assert out["triton"][1].selected.tolist() == out["torch"][1].selected.tolist()


@pytest.mark.slow
def test_smollm2_answers_from_stored_chunks(smollm2, tmp_path):
    from pathlib import Path

    from ragkv.store import open_store

    model, tokenizer = smollm2
    docs = Path(__file__).parents[1] / "examples" / "data" / "docs"
    contexts = [(docs / "sourdough.md").read_text(), (docs / "lighthouse.md").read_text()]
    store = open_store(f"disk://{tmp_path}/store")
    eng = BlendEngine(model, tokenizer, store)
    keys, computed = eng.ensure(contexts)
    assert computed == 2 and all(store.contains(k) for k in keys)
    # a fresh engine over the same store: everything is served from disk
    eng2 = BlendEngine(model, tokenizer, open_store(f"disk://{tmp_path}/store"))
    res = eng2.prefill("Who designed the Harwick Point Lighthouse?", contexts)
    assert res.stats.hits == 2 and res.stats.misses == 0
    answer = tokenizer.decode(eng2.adapter.generate(res.input_ids, res.cache, tokenizer, max_new_tokens=24))
    assert "Tolland" in answer, answer


def test_entries_are_pinned_while_a_request_reads_them():
    model = models.tiny_model("llama")
    prompt = make_prompt(seed=19)
    store = MemoryStore()
    eng = BlendEngine(model, None, store, template=TEMPLATE, config=BlendConfig(pipelined=False))
    eng.prefill_prompt(prompt)
    seen = []
    orig = store._load  # every read of a backend goes through its _load hook

    def spy(key, layers):
        seen.append(store.is_pinned(key))
        return orig(key, layers)

    store._load = spy
    eng.prefill_prompt(prompt, ratio=0.3)
    assert seen and all(seen)
    assert not any(store.is_pinned(eng.keys.chunk_key(ids)) for ids in prompt.chunk_ids)


@pytest.mark.parametrize("sink,gap", [("none", 0), ("bos", 0), ("template", 0), ("template", 300)])
def test_every_precompute_policy_blends_exactly_at_ratio_one(sink, gap):
    from ragkv.policy import PrecomputePolicy

    model = models.tiny_model("llama")
    prompt = make_prompt(seed=23)
    eng = BlendEngine(model, None, MemoryStore(), template=TEMPLATE, policy=PrecomputePolicy(sink, gap, int(gap > 0)))
    eng.prefill_prompt(prompt)
    sink_len = {"none": 0, "bos": 1, "template": 4}[sink]
    meta = eng.store.get_meta(eng.keys.chunk_key(prompt.chunk_ids[1]))
    assert meta.start_pos == sink_len + gap == eng.keys.chunk_start
    first = eng.keys.lead_key(prompt.chunk_ids[0]) if gap else eng.keys.chunk_key(prompt.chunk_ids[0])  # gap 0: its own lead
    assert eng.store.get_meta(first).start_pos == sink_len
    res = eng.prefill_prompt(prompt, ratio=1.0)
    assert res.stats.hits == 3
    torch.testing.assert_close(res.logits, full_logits(model, prompt), atol=1e-4, rtol=0)
    other = BlendEngine(model, None, MemoryStore(), template=TEMPLATE, policy=PrecomputePolicy(sink, gap + 1, int(gap > 0)))
    assert other.keys.chunk_key(prompt.chunk_ids[0]) != eng.keys.chunk_key(prompt.chunk_ids[0])  # policies never mix


def test_default_policy_gap_follows_the_context_and_long_chunks_are_refused():
    from ragkv.policy import PrecomputePolicy

    model = models.tiny_model("llama")  # 2048 positions
    eng = engine(model)
    assert eng.prefiller.policy.gap == 512 and eng.keys.chunk_start == len(TEMPLATE.prefix_ids) + 512
    assert PrecomputePolicy().resolve(8192).gap == 1024 and PrecomputePolicy().resolve(None).gap == 1024
    with pytest.raises(ValueError, match=r"longer than the model's window \(2048 tokens\)"):
        eng.prefiller.prefill([list(range(10, 1600))])
    assert eng.config.selector.layers_for(eng.adapter.num_layers) == [1]  # (1, 3, 6) cut to a 4-layer model


def test_auto_ratio_recomputes_what_the_load_hides_never_below_the_floor():
    from ragkv.controller import LayerCost, RatioController

    ctl = RatioController(LayerCost(c0=0.001, c1=0.0001))
    # load 0.011 s per layer hides the recompute of (0.011 - 0.001 - 0.0001*10) / 0.0001 = 90 tokens
    assert ctl.hidden_ratio(1100, 1e5, chunk_tokens=200, suffix_tokens=10) == pytest.approx(0.45)
    assert ctl.choose(1100, 1e5, 200, 10, floor=0.15) == pytest.approx(0.45)
    assert ctl.choose(100, 1e9, 200, 10, floor=0.15) == 0.15  # a fast tier: the floor
    assert ctl.choose(10**9, 1.0, 200, 10, floor=0.15) == 1.0

    # a measured slope <= 0 (timer noise on a tiny model): the floor, not "recompute everything"
    assert RatioController(LayerCost(c0=0.01, c1=0.0)).choose(1100, 1e5, 200, 10, floor=0.2) == 0.2

    # the engine: measured store bandwidth against a known layer cost (no timing in the assertions:
    # a memory read of 3 layers takes far less than 27 s, a slow store's at least 3 x 0.05 s)
    model = models.tiny_model("llama")
    prompt = make_prompt(seed=29, sizes=(60, 60, 60))
    store = MemoryStore()
    eng = BlendEngine(model, None, store, template=TEMPLATE)
    eng.prefill_prompt(prompt)
    eng._controller = RatioController(LayerCost(c0=0.0, c1=1.0))  # 1 s per recomputed token: nothing hides
    fast = eng.prefill_prompt(prompt, ratio="auto")
    assert fast.stats.ratio == 0.15 and fast.stats.recomputed_tokens == math.ceil(0.15 * 180)
    slow = BlendEngine(model, None, SlowStore(store, 0.05), config(ratio_floor=0.2), template=TEMPLATE)
    slow._controller = RatioController(LayerCost(c0=0.0, c1=1e-5))  # 180 tokens: 1.8 ms < 150 ms of load
    res = slow.prefill_prompt(prompt, ratio="auto")
    assert res.stats.ratio == 1.0 and res.stats.hits == 3 and res.stats.recomputed_tokens == 180
    with pytest.raises(ValueError, match="'auto'"):
        eng.prefill_prompt(prompt, ratio="fast")


@pytest.mark.parametrize("name", sorted(SELECTORS))
def test_auto_ratio_works_with_every_selector(name):
    """ratio='auto' picks the ratio before selection; every selector then recomputes that share."""
    from ragkv.controller import LayerCost, RatioController

    model = models.tiny_model("llama")
    prompt = make_prompt(seed=31, sizes=(50, 70, 60))
    store = MemoryStore()
    BlendEngine(model, None, store, template=TEMPLATE).prefill_prompt(prompt)  # stores the chunks
    eng = BlendEngine(model, None, store, BlendConfig(selector=name, ratio_floor=0.25), template=TEMPLATE)
    eng._controller = RatioController(LayerCost(c0=0.0, c1=1.0))  # nothing hides: the floor
    res = eng.prefill_prompt(prompt, ratio="auto")
    assert res.stats.hits == 3 and res.stats.ratio == 0.25
    assert res.stats.recomputed_tokens == math.ceil(0.25 * 180)


# ---------------------------------------------------------------- selection strategies


@pytest.mark.parametrize("selector", [DeviationSelector(), DeviationSelector(check_layers=(2,), signal="kv"),
                                      QuerySelector(), QuerySelector(rows=2, offset_decay=0.0), StartsSelector()])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_exact_caches_make_every_selector_return_full_prefill(selector, attn):
    model = models.tiny_model("llama", attn_implementation=attn)
    prompt = make_prompt(seed=31, sizes=(23, 17, 30))
    eng = BlendEngine(model, None, MemoryStore(), BlendConfig(selector=selector), template=TEMPLATE)
    _store_exact_caches(eng, model, prompt)
    for ratio in (0.0, 0.1, 0.4):
        res = eng.prefill_prompt(prompt, ratio=ratio)
        assert res.stats.hits == 3 and res.stats.recomputed_tokens == math.ceil(ratio * 70 - 1e-9)
        torch.testing.assert_close(res.logits, full_logits(model, prompt), atol=1e-4, rtol=0)


@pytest.mark.parametrize("q_pos", [[27, 28, 29], [3, 17, 29], [0, 1, 2]])
def test_probe_attention_is_causal_by_position_and_hands_out_its_probabilities(q_pos):
    """The probe's explicit attention (masked only where some row cannot see) equals the reference
    attention by position, and the probabilities it hands out are that attention's."""
    from ragkv.kernels.blend_attention import blend_attention_torch

    g = torch.Generator().manual_seed(len(q_pos) + q_pos[0])
    hkv, group, n, t, d = 2, 3, len(q_pos), 30, 16
    q = torch.randn(1, hkv * group, n, d, generator=g)
    k, v = torch.randn(1, hkv, t, d, generator=g), torch.randn(1, hkv, t, d, generator=g)
    pos, seen = torch.tensor(q_pos), {}

    class Layer:
        layer_idx = 4

    out, _ = attention_mod.probe_attention(Layer(), q, k, v, None, scaling=0.3, ragkv_q_pos=pos,
                                           ragkv_capture=lambda li, probs: seen.update(li=li, probs=probs))
    ref = blend_attention_torch(q[0], k[0], v[0], pos, sm_scale=0.3)  # [Hq, n, D]
    torch.testing.assert_close(out[0].transpose(0, 1), ref, atol=1e-5, rtol=1e-5)
    logits = torch.einsum("hnd,htd->hnt", q[0], k[0].repeat_interleave(group, 0)) * 0.3
    logits[:, torch.arange(t)[None, :] > pos[:, None]] = float("-inf")
    assert seen["li"] == 4
    torch.testing.assert_close(seen["probs"], logits.softmax(-1), atol=1e-6, rtol=1e-5)
    assert (seen["probs"][:, torch.arange(t)[None, :] > pos[:, None]] == 0).all()


def test_position_attention_plan_is_built_once_per_active_set(monkeypatch):
    """The CPU attention's blocks and masks depend on the active rows only: one plan per active set,
    shared by every layer that runs it (+ one for the last layer's last token), and the blend is still
    exact."""
    model = models.tiny_model("llama", attn_implementation="sdpa")
    prompt = make_prompt(seed=31, sizes=(23, 17, 30))
    built, real = [], ops.blend_attention_plan
    monkeypatch.setattr(ops, "blend_attention_plan", lambda q_pos, *a: built.append(q_pos) or real(q_pos, *a))
    rotary, rope_calls = model.model.rotary_emb, []
    monkeypatch.setattr(rotary, "forward", lambda x, position_ids, f=rotary.forward: rope_calls.append(1) or f(x, position_ids))
    # active sets with a plan: query's selection and the last token; deviation's two narrowed sets and the
    # last token (its whole-prompt layer 0 is a plain causal prefill). Rotary embeddings: those, the
    # probe's suffix (query) and the whole prompt (deviation)
    for selector, active_sets, ropes in ((QuerySelector(), 2, 3), (DeviationSelector(check_layers=(0, 1)), 3, 4)):
        eng = BlendEngine(model, None, MemoryStore(), BlendConfig(selector=selector), template=TEMPLATE)
        _store_exact_caches(eng, model, prompt)
        built.clear()
        rope_calls.clear()
        res = eng.prefill_prompt(prompt, ratio=0.2)
        assert len(rope_calls) == ropes  # once per active set, not once per layer
        torch.testing.assert_close(res.logits, full_logits(model, prompt), atol=1e-4, rtol=0)
        assert len(built) == active_sets < eng.adapter.num_layers


def test_query_selector_picks_what_the_question_attends_to():
    """With exact caches the probe sees full prefill's attention: the selected tokens must be the
    top tokens of the suffix's attention computed independently by HF's eager attention."""
    model = models.tiny_model("llama", attn_implementation="eager")
    prompt = make_prompt(seed=37, sizes=(30, 25, 35))
    P, C = len(prompt.prefix_ids), 90
    sel = QuerySelector(rows=None, offset_decay=0.0)  # the attention of every suffix row alone
    eng = BlendEngine(model, None, MemoryStore(), BlendConfig(selector=sel), template=TEMPLATE)
    _store_exact_caches(eng, model, prompt)
    with torch.no_grad():
        out = model(torch.tensor([prompt.input_ids]), output_attentions=True)
    S = len(prompt.suffix_ids)
    score = torch.zeros(C)
    for att in out.attentions:  # [1, heads, T, T]
        a = att[0, :, -S:, P : P + C].float().mean((0, 1))  # mean over heads and suffix rows
        score += a / a.sum()
    want = set((torch.topk(score, 9).indices + P).tolist())
    res = eng.prefill_prompt(prompt, ratio=0.1)  # ceil(0.1 * 90) = 9 tokens
    assert set(res.selected.tolist()) == want
    assert res.stats.t_select > 0
    # the suffix's strongest chunk token is among them, whatever the ratio
    top = int(torch.argmax(score)) + P
    assert top in eng.prefill_prompt(prompt, ratio=0.02).selected.tolist()


def test_query_offset_decay_weights_the_question_attention_by_each_tokens_offset_in_its_chunk():
    """offset_decay=b multiplies a token's attention score by (1 + offset in its chunk) ** -b: with even
    attention the chunks' first tokens win; a token the question reads much more still wins; an
    exact lead chunk (its stored K/V are full prefill's) ranks last whatever it is given."""
    def selected(attention, starts, lead=False, ratio=2 / 8):
        att = torch.tensor(attention)
        req = SelectionRequest(prefix_len=0, chunk_len=8, total=9, chunk_bounds=((0, 4), (4, 4)), ratio=ratio,
                               num_layers=2, lead=lead,
                               probe=lambda observe: [observe(li, att.view(1, 1, 8)) for li in range(2)])
        return QuerySelector(rows=None, offset_decay=starts).schedule(req).start.tolist()

    even = [1.0] * 8
    assert selected(even, starts=1.0) == [0, 4]
    assert selected(even, starts=1.0, lead=True) == [4, 5]
    read = [2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 3.5, 1.0]  # row 6 (offset 2): 3.5 / 3 beats row 4's 1 / 1
    assert selected(read, starts=1.0) == [0, 6]
    assert selected(read, starts=2.0) == [0, 4]  # 3.5 / 9 no longer does
    assert selected(read, starts=0.0, ratio=1 / 8) == [6]  # attention alone
    lead_read = [9.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert selected(lead_read, starts=0.0, lead=True, ratio=4 / 8) == [4, 5, 6, 7]  # exact rows last, prior or not
    for bad in (-1.0, True, "1", float("inf")):
        with pytest.raises(ValueError, match="offset_decay must be a number >= 0"):
            QuerySelector(offset_decay=bad)
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="rows must be an integer >= 1 or None"):
            QuerySelector(rows=bad)


def test_starts_recomputes_the_first_tokens_of_every_chunk_evenly():
    """The budget goes to the first tokens of every chunk, as many in each; a short chunk's surplus
    goes to the others; an exact lead chunk comes last."""
    def rows(ratio, lead=False, bounds=((0, 10), (10, 6), (16, 8))):
        req = SelectionRequest(prefix_len=3, chunk_len=24, total=30, chunk_bounds=bounds, ratio=ratio, num_layers=4,
                               lead=lead)
        sched = StartsSelector().schedule(req)
        assert sched.checks == {}  # every layer: no whole-prompt layer, nothing scored
        return sched.start.tolist()

    assert rows(0.0) == []
    assert rows(6 / 24) == [0, 1, 10, 11, 16, 17]
    assert rows(6 / 24, lead=True) == [10, 11, 12, 16, 17, 18]
    assert rows(20 / 24, lead=True) == [*range(6), *range(10, 24)]  # chunks 2 and 3 whole, then the lead chunk
    assert rows(9 / 24, bounds=((0, 2), (2, 22))) == [0, 1, *range(2, 9)]
    assert rows(1.0) == list(range(24))


def test_query_probe_reads_each_stored_layer_once(monkeypatch):
    model = models.tiny_model("llama")
    prompt = make_prompt(seed=41)
    store = MemoryStore()
    eng = BlendEngine(model, None, store, BlendConfig(selector=QuerySelector()), template=TEMPLATE)
    eng.prefill_prompt(prompt)
    reads = []
    orig = store._load

    def spy(key, layers):
        reads.append((key, None if layers is None else tuple(layers)))
        return orig(key, layers)

    store._load = spy
    res = eng.prefill_prompt(prompt, ratio=0.2)
    layer_reads = [r for r in reads if r[1] is not None]
    assert res.stats.hits == 3 and len(layer_reads) == len(set(layer_reads)) == 4 * model.config.num_hidden_layers


def test_every_entry_point_defaults_to_the_one_default_selector():
    """BlendConfig, `ragkv eval`, `ragkv serve` and the vLLM connector share one default selector
    (`ragkv eval` resolves its own when run: test_eval_cache)."""
    from ragkv.blend.config import CHAT_SELECTOR, DEFAULT_SELECTOR
    from ragkv.cli import eval_cmd
    from ragkv.integrations.serve.cli import serve
    from ragkv.integrations.vllm.engines import ConnectorSettings

    assert isinstance(BlendConfig().selector, SELECTORS[DEFAULT_SELECTOR])
    assert "DEFAULT_SELECTOR" in next(p.help for p in eval_cmd.params if p.name == "selectors")
    assert CHAT_SELECTOR == DEFAULT_SELECTOR == "query"
    assert next(p.default for p in serve.params if p.name == "selector") == CHAT_SELECTOR
    assert ConnectorSettings(store="memory://").selector == CHAT_SELECTOR
    assert CHAT_SELECTOR in SELECTORS


def test_selectors_are_chosen_by_name_and_unknown_names_are_refused():
    assert isinstance(BlendConfig(selector="query").selector, QuerySelector)
    with pytest.raises(ValueError, match="unknown selector 'psychic'; valid: deviation, query, starts"):
        BlendConfig(selector="psychic")


# ---------------------------------------------------------------- no process-wide side effects


def test_transformers_attention_registry_is_left_as_it_was():
    """A blended request used to replace ALL_ATTENTION_FUNCTIONS['sdpa'] with a wrapper, so a user's
    later AttentionInterface.register('sdpa', f) was ignored."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    model = models.tiny_model("llama")
    prompt = make_prompt(seed=43)
    eng = engine(model)
    eng.prefill_prompt(prompt)
    eng.prefill_prompt(prompt, ratio=0.3)
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is before
    assert model.config._attn_implementation == "sdpa"
    calls = []

    def mine(module, *args, **kwargs):
        calls.append(module.layer_idx)
        return before(module, *args, **kwargs)

    AttentionInterface.register("sdpa", mine)
    try:
        with torch.no_grad():
            model(torch.tensor([prompt.input_ids]))
        assert sorted(set(calls)) == list(range(model.config.num_hidden_layers))  # the user's function ran
        calls.clear()
        res = eng.prefill_prompt(prompt, ratio=0.3)  # ... and blending still works beside it
        torch.testing.assert_close(res.logits, eng.prefill_prompt(prompt, ratio=0.3).logits)
    finally:
        AttentionInterface.register("sdpa", before)


# ----------------------------------------------------------------------------- Qwen2.5's shape
# Qwen2.5-Coder-0.5B: q/k/v biases, rope theta 1e6, GQA 14 query heads over 2 K/V heads, untied lm_head.
QWEN25 = dict(num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def test_qwen25_shaped_model_rerotates_exactly_and_blends_to_full_prefill_at_ratio_one():
    model = models.tiny_model("qwen2", **QWEN25)
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.bias is not None and attn.num_key_value_groups == 7 and not model.config.tie_word_embeddings
    ids = torch.randint(10, 500, (41,), generator=torch.Generator().manual_seed(7)).tolist()
    (stored,) = prefill_kv(ModelAdapter.of(model), [], [ids])  # computed alone at positions 0..40 (the key bias rotated too)
    inv_freq = ModelAdapter.of(model).inv_freq
    for offset in (3, 1500):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model.model(input_ids=torch.tensor([ids]), position_ids=torch.arange(offset, offset + 41)[None],
                        use_cache=True, **cache_arg(model, cache))
        for li, (k0, _) in enumerate(stored):
            moved = ops.rope_shift(k0, torch.full((41,), offset), inv_freq)
            torch.testing.assert_close(moved, cache.layers[li].keys[0], atol=2e-5, rtol=1e-4,
                                       msg=f"layer {li} offset {offset}")
    prompt = make_prompt(seed=37, sizes=(19, 33, 11))
    eng = engine(model)
    eng.prefill_prompt(prompt)
    res = eng.prefill_prompt(prompt, ratio=1.0)
    assert res.stats.hits == 3
    want = full_logits(model, prompt)
    torch.testing.assert_close(res.logits, want, atol=1e-4, rtol=0)
    for name in SELECTORS:  # exact stored K/V: every selector at any ratio is full prefill
        exact = BlendEngine(model, None, MemoryStore(), BlendConfig(selector=name), template=TEMPLATE)
        _store_exact_caches(exact, model, prompt)
        torch.testing.assert_close(exact.prefill_prompt(prompt, ratio=0.15).logits, want, atol=1e-4, rtol=0,
                                   msg=name)


@pytest.mark.slow
@pytest.mark.qwen
def test_qwen_blends_from_stored_chunks(qwen05, tmp_path):
    """The real Qwen2.5-Coder-0.5B in fp32: ratio 1 is full prefill, and the default blend answers
    from chunks read from disk."""
    from pathlib import Path

    from ragkv.store import open_store

    model, tokenizer = qwen05
    docs = Path(__file__).parents[1] / "examples" / "data" / "docs"
    contexts = [(docs / "sourdough.md").read_text(), (docs / "lighthouse.md").read_text()]
    eng = BlendEngine(model, tokenizer, open_store(f"disk://{tmp_path}/store"))
    eng.ensure(contexts)
    question = "Who designed the Harwick Point Lighthouse?"
    prompt = eng.build_prompt(question, contexts)
    res = eng.prefill_prompt(prompt, ratio=1.0)
    assert res.stats.hits == 2 and res.stats.misses == 0
    torch.testing.assert_close(res.logits, full_logits(model, prompt), atol=2e-3, rtol=0)
    res = eng.prefill(question, contexts)  # the default selector and ratio
    answer = tokenizer.decode(eng.adapter.generate(res.input_ids, res.cache, tokenizer, max_new_tokens=24))
    assert "Tolland" in answer, answer
