"""The blend on vLLM's own model (ragkv.integrations.vllm.layers.VllmLayers), checked against vLLM's own
prefill of the same prompt: SmolLM2 fp32, captured from vLLM's decoder layers with forward hooks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from vllm_data import DOCS

from ragkv.adapter import ModelAdapter
from ragkv.blend.cache import Segment
from ragkv.blend.request import BlendRequest
from ragkv.blend.result import BlendStats
from ragkv.blend.select import Schedule, Selector

QUESTION = "Who built the lighthouse at Kerran Point?"


@dataclass(frozen=True)
class FixedRows(Selector):
    """Recompute these chunk rows (and the suffix) in every layer; no checks."""

    name: ClassVar[str] = "fixed"
    rows: tuple[int, ...] = ()

    def schedule(self, req):
        return Schedule(torch.tensor(self.rows, dtype=torch.long), {})


def vllm_prefill(llm, model, ids: list[int]) -> dict:
    """vLLM's own prefill of ``ids`` (the connector skipped, vLLM's prefix cache not read): per layer
    the decoder layer's output (hidden + residual) and the K/V [kv_heads, T, head_dim] its attention
    layer was given (rotated, what vLLM caches), and the top-20 next-token log-probs. Chunked prefill
    runs it over several steps: each step's rows are appended (its real rows: the run of positions
    that continues the prompt; a backend may pad a step)."""
    from vllm import SamplingParams

    T, out, kv, rows = len(ids), {}, {}, {}
    a = ModelAdapter.of(model)
    heads = (-1, a.num_kv_heads, a.head_dim)

    def on_positions(li):
        def hook(mod, args):
            pos = args[0].flatten()
            n = int((pos == torch.arange(pos[0], pos[0] + len(pos))).long().cumprod(0).sum())
            assert int(pos[0]) == sum(len(t) for t in out.get(li, [])), "steps out of order"
            rows[li] = n
        return hook

    def on_layer(li):
        return lambda mod, args, res: out.setdefault(li, []).append((res[0][:rows[li]] + res[1][:rows[li]]).clone())

    def on_attn(li):
        return lambda mod, args, res: kv.setdefault(li, []).append(
            tuple(t[:rows[li]].reshape(heads).transpose(0, 1).clone() for t in args[1:3]))

    hooks = []
    for li, layer in enumerate(model.model.layers):
        hooks += [layer.register_forward_pre_hook(on_positions(li)), layer.register_forward_hook(on_layer(li)),
                  layer.self_attn.attn.register_forward_hook(on_attn(li))]
    try:
        res = llm.generate({"prompt_token_ids": ids}, SamplingParams(
            max_tokens=1, temperature=0, logprobs=20, skip_reading_prefix_cache=True,
            extra_args={"kv_transfer_params": {"ragkv_skip": True}}), use_tqdm=False)[0]
    finally:
        for h in hooks:
            h.remove()
    assert len(out) == len(kv) == a.num_layers
    hidden = {li: torch.cat(parts) for li, parts in out.items()}
    kv = {li: tuple(torch.cat(p, dim=1) for p in zip(*parts)) for li, parts in kv.items()}
    assert all(h.shape[0] == T for h in hidden.values()) and all(k.shape[1] == T for k, _ in kv.values())
    return {"hidden": hidden, "kv": kv, "steps": len(out[0]),
            "logprobs": {t: lp.logprob for t, lp in res.outputs[0].logprobs[0].items()}}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_ratio_one_on_vllms_modules_is_vllms_own_prefill(vllm_env, vllm_model):
    """Every chunk token recomputed: vLLM's modules and weights give vLLM's own next-token
    distribution (top 20 log-probs) and, through the connector, its greedy answer token for token."""
    from test_connector import generate

    llm, engine = vllm_env
    prompt = engine.build_prompt(QUESTION, DOCS[:3])
    engine.ensure(DOCS[:3])
    own = vllm_prefill(llm, vllm_model, prompt.input_ids)
    res = engine.prefill_prompt(prompt, ratio=1.0)
    ours = torch.log_softmax(res.logits, -1)
    worst = max(abs(float(ours[t]) - lp) for t, lp in own["logprobs"].items())
    assert worst < 1e-4, worst
    assert int(res.logits.argmax()) == max(own["logprobs"], key=own["logprobs"].get)
    # the K/V the connector writes into vLLM's cache: vLLM's own, position by position
    for li, (k, v) in enumerate(res.cache):
        ref_k, ref_v = own["kv"][li]
        T1 = k.shape[2]  # the prompt minus its last token
        assert rel_err(k[0], ref_k[:, :T1]) < 1e-5 and rel_err(v[0], ref_v[:, :T1]) < 1e-5, li
    assert own["steps"] > 1  # chunked prefill: vLLM's own prefill took several steps
    llm.reset_prefix_cache()  # vLLM cached its own prefill of this prompt: the connector would offer nothing
    toks, _, info = generate(llm, prompt.input_ids, ratio=1.0)
    skip, _, _ = generate(llm, prompt.input_ids, extra={"ragkv_skip": True})
    assert info["offered"] and toks == skip and len(toks) == 16


def bottom_right_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """What a varlen kernel does with the active rows as one query block: row j of n sees keys
    0..T - n + j (the causal mask aligned to the bottom right), whatever the row's position."""
    n, T = query.shape[2], key.shape[2]
    allowed = torch.arange(T)[None, :] <= torch.arange(T - n, T)[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scaling,
                                                           enable_gqa=True)
    return out.transpose(1, 2), None


@pytest.mark.parametrize("mask", ["by position", "bottom right"])
def test_recomputed_rows_attend_by_original_position(vllm_env, vllm_model, monkeypatch, mask):
    """Stored K/V = vLLM's own full-prefill K/V (exact), a scattered set of chunk rows recomputed in
    every layer, early rows included: each recomputed row's hidden state in every layer, and the
    last token's logits, are vLLM's full-prefill ones. A bottom-right-aligned causal mask (an early
    row sees later keys) fails the same check."""
    import ragkv.blend.attention

    llm, engine = vllm_env
    prompt = engine.build_prompt(QUESTION, DOCS[:4])
    own = vllm_prefill(llm, vllm_model, prompt.input_ids)
    P, C = len(prompt.prefix_ids), sum(map(len, prompt.chunk_ids))
    rows = (0, 1, 3, 8, C // 2, C // 2 + 1, C - 2)  # chunk rows; row 0 is the first chunk's first token

    def exact(ids, start, **kw):
        layers = [(k[:, start:start + len(ids)], v[:, start:start + len(ids)]) for k, v in own["kv"].values()]
        return Segment(f"exact-{start}", ids, start, stored_start=start, layers=layers, **kw)

    segments = [exact(prompt.prefix_ids, 0, is_prefix=True)]
    segments += [exact(ids, start) for ids, start in zip(prompt.chunk_ids, prompt.chunk_positions())]
    a = engine.adapter
    seen, run_layer = {}, a.run_layer

    def spy(li, hidden, positions, cache, **kw):
        out = run_layer(li, hidden, positions, cache, **kw)
        seen[li] = (positions.clone(), (out[0] + out[1]).clone())
        return out

    monkeypatch.setattr(a, "run_layer", spy)
    if mask == "bottom right":
        monkeypatch.setattr(ragkv.blend.attention, "position_attention", bottom_right_attention)
    res = BlendRequest(engine.with_config(selector=FixedRows(rows)), prompt, segments, 0.0, BlendStats()).run()

    active = torch.tensor([P + r for r in rows] + list(range(P + C, prompt.num_tokens)))
    assert torch.equal(seen[0][0], active) and torch.equal(res.selected, active[:len(rows)])
    errs = [rel_err(h, own["hidden"][li][pos]) for li, (pos, h) in sorted(seen.items())]
    ours = torch.log_softmax(res.logits, -1)
    logit_err = max(abs(float(ours[t]) - lp) for t, lp in own["logprobs"].items())
    print(f"{mask}: worst layer error {max(errs):.2e} (layer {errs.index(max(errs))}), log-prob error {logit_err:.2e}")
    if mask == "by position":
        assert max(errs) < 1e-5 and logit_err < 1e-4
    else:  # the first recomputed rows see the rest of the prompt: wrong from layer 0 on
        assert errs[0] > 1e-2 and logit_err > 1e-3


def test_ratio_auto_times_vllms_layers(vllm_env):
    """ratio="auto" (the loading controller) measures the recompute cost on vLLM's layers."""
    _, engine = vllm_env
    engine.ensure(DOCS[:2])
    res = engine.prefill_prompt(engine.build_prompt(QUESTION, DOCS[:2]), ratio="auto")
    assert engine._controller.cost.c1 > 0
    assert engine.config.ratio_floor <= res.stats.ratio <= 1.0 and res.stats.hits == 2


def test_other_vllm_releases_and_layer_structures_are_refused_by_name(vllm_model, monkeypatch):
    import vllm

    from ragkv.adapter import UnsupportedModelError
    from ragkv.integrations.vllm import plugin
    from ragkv.integrations.vllm.layers import VllmLayers

    attn = vllm_model.model.layers[3].self_attn
    monkeypatch.setattr(attn, "qk_norm", True, raising=False)
    with pytest.raises(UnsupportedModelError, match=r"BlendLlamaForCausalLM on vLLM 0\.32\.0: layer 3 uses qk_norm"):
        VllmLayers(vllm_model)
    monkeypatch.undo()

    class OtherAttention(type(attn)):  # e.g. another plugin's subclass with a forward of its own
        def forward(self, positions, hidden_states):
            return super().forward(positions, hidden_states)

    monkeypatch.setattr(attn, "__class__", OtherAttention)
    with pytest.raises(UnsupportedModelError, match=r"layer 3's OtherAttention\.forward is not one ragkv repeats"):
        VllmLayers(vllm_model)
    monkeypatch.undo()
    monkeypatch.setattr(vllm, "__version__", "0.33.1")
    with pytest.raises(UnsupportedModelError, match=r"this is vLLM 0\.33\.1"):
        VllmLayers(vllm_model)
    registered = []
    monkeypatch.setattr(vllm.ModelRegistry, "register_model", lambda *a: registered.append(a))
    plugin.register()  # leaves vLLM's classes alone on a release it was not checked against
    assert registered == []
    monkeypatch.undo()
    assert VllmLayers(vllm_model).num_layers == 30


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_check_accepts_vllms_own_cache_in_the_model_dtype_and_refuses_a_scaled_one(vllm_model, dtype):
    """vLLM keeps its rotary cos/sin cache in the model's dtype: a bf16 model's cache is bf16-rounded
    and must still be recognised (it was refused once, so the connector could not run in bf16), while
    a rotary whose angles differ (a scaled base) is refused by name."""
    import copy
    from types import SimpleNamespace

    from ragkv.adapter import UnsupportedModelError
    from ragkv.integrations.vllm.layers import VllmLayers

    owner = SimpleNamespace(model=vllm_model, device=torch.device("cpu"))
    rot = copy.deepcopy(vllm_model.model.layers[0].self_attn.rotary_emb)  # (the fp32 model's)
    rot.cos_sin_cache = rot.cos_sin_cache.to(dtype)  # what vLLM builds for a model in ``dtype``
    inv = VllmLayers._inv_freq(owner, rot)
    assert torch.equal(inv, rot._compute_inv_freq(rot.base).float())
    rot.base = rot.base * 4  # the cache stays the old base's: the frequencies ragkv would re-rotate with differ
    with pytest.raises(UnsupportedModelError, match="rotary cos/sin cache"):
        VllmLayers._inv_freq(owner, rot)
