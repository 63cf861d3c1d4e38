"""Lead entries (PrecomputePolicy.lead): every chunk also stored right behind the sink, read for a
prompt's first chunk; a store without them serves the gap entry instead."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from blend_testlib import TEMPLATE, make_prompt

from ragkv import models
from ragkv.blend import BlendConfig, BlendEngine, StartsSelector
from ragkv.chunking import chunk_document
from ragkv.policy import PrecomputePolicy
from ragkv.precompute import precompute
from ragkv.prefill import Prefiller
from ragkv.store.memory import MemoryStore


def full(model, prompt):
    """Full prefill: next-token logits and per layer K [kv_heads, T, head_dim]."""
    with torch.no_grad():
        out = model(torch.tensor([prompt.input_ids]), use_cache=True)
    return out.logits[0, -1].float(), [layer.keys[0] for layer in out.past_key_values.layers]


def engine(model, store=None, **policy) -> BlendEngine:
    return BlendEngine(model, None, MemoryStore() if store is None else store, BlendConfig(pipelined=False),
                       template=TEMPLATE, policy=PrecomputePolicy(**policy))


def test_lead_entry_is_the_first_chunks_full_prefill_kv():
    model = models.tiny_model("llama")
    prompt = make_prompt(seed=3)
    eng = engine(model)
    first = prompt.chunk_ids[0]
    (lead,) = eng.prefiller.prefill([first], "lead")
    _, keys = full(model, prompt)
    P = len(prompt.prefix_ids)
    for li, (k, _) in enumerate(lead):
        torch.testing.assert_close(k, keys[li][:, P : P + len(first)], atol=1e-5, rtol=0, msg=f"layer {li}")
    assert eng.keys.layout("lead") == (len(TEMPLATE.prefix_ids), eng.keys.lead_id)
    assert eng.keys.lead_key(first) != eng.keys.chunk_key(first)


def test_one_chunk_prompt_at_ratio_zero_equals_full_prefill_only_with_lead():
    """With the first chunk's exact K/V and the exact prefix, naive reuse of a one-chunk prompt is full
    prefill; without the lead entry it is not (the gap entry was prefilled far from the sink)."""
    model = models.tiny_model("llama")
    prompt = make_prompt(seed=5, sizes=(21,))
    ref, _ = full(model, prompt)
    with_lead = engine(model)
    with_lead.prefill_prompt(prompt, ratio=0)  # computes and stores the entries
    res = with_lead.prefill_prompt(prompt, ratio=0)
    assert res.stats.hits == 1 and res.stats.misses == 0 and res.stats.lead
    torch.testing.assert_close(res.logits, ref, atol=1e-4, rtol=0)
    without = engine(model, lead=False)
    without.prefill_prompt(prompt, ratio=0)
    res = without.prefill_prompt(prompt, ratio=0)
    assert not res.stats.lead
    assert (res.logits - ref).abs().max() > 1e-3


def test_precompute_writes_both_entries_and_reruns_skip_them(tiny_smollm2):
    model, tok = tiny_smollm2
    eng = BlendEngine(model, tok, MemoryStore(), policy=PrecomputePolicy(context=0))
    docs = ["The lighthouse keeper counted the ships every night. " * 6, "Sourdough needs a starter. " * 8]
    s = precompute(eng.prefiller, texts=docs, chunk_tokens=32)
    assert s.new == 2 * s.chunks and s.failed == 0
    chunks = [eng.template.chunk_ids(c) for d in docs for c in chunk_document(d, eng.template, 32)]
    assert len({eng.keys.chunk_key(c) for c in chunks}) == s.chunks
    for ids in chunks:
        meta = eng.store.get_meta(eng.keys.lead_key(ids))
        assert meta.start_pos == len(eng.keys.sink_ids) and meta.policy == eng.keys.lead_id
        assert eng.store.get_meta(eng.keys.chunk_key(ids)).start_pos == eng.keys.chunk_start
    again = precompute(eng.prefiller, texts=docs, chunk_tokens=32)
    assert again.new == 0 and again.skipped == 2 * again.chunks


def test_precompute_with_lead_over_a_store_without_adds_only_the_lead_entries(tiny_smollm2):
    """Upgrading a store written without lead entries: the rerun computes the lead entries only."""
    model, tok = tiny_smollm2
    store = MemoryStore()
    docs = ["The lighthouse keeper counted the ships every night. " * 6, "Sourdough needs a starter. " * 8]
    old = precompute(Prefiller(model, tok, store, policy=PrecomputePolicy(context=0, lead=False)), texts=docs,
                     chunk_tokens=32)
    assert old.new == old.chunks > 1
    gap_keys = list(store.keys())
    gap_entries = {k: store.get_meta(k) for k in gap_keys}
    eng = BlendEngine(model, tok, store, policy=PrecomputePolicy(context=0))
    up = precompute(eng.prefiller, texts=docs, chunk_tokens=32)
    assert up.new == up.skipped == up.chunks == old.chunks and up.failed == 0
    assert {k: store.get_meta(k) for k in gap_entries} == gap_entries  # untouched
    assert sum(m.policy == eng.keys.lead_id for m in map(store.get_meta, list(store.keys()))) == up.chunks


def test_a_store_without_lead_entries_serves_the_gap_entry_and_gains_nothing():
    """A store written without lead: a reader with lead reads the first chunk's gap entry (exactly what a
    reader without lead gets), computes nothing and writes nothing."""
    model = models.tiny_model("llama")
    prompt = make_prompt(seed=7)
    store = MemoryStore()
    old = engine(model, store, lead=False)
    expected = old.prefill_prompt(prompt, ratio=0.15)  # writes the gap entries only
    n = len(list(store.keys()))
    res = engine(model, store).prefill_prompt(prompt, ratio=0.15)
    assert res.stats.hits == 3 and res.stats.misses == 0 and not res.stats.lead
    assert len(list(store.keys())) == n and not store.contains(old.keys.lead_key(prompt.chunk_ids[0]))
    torch.testing.assert_close(res.logits, expected.logits, atol=0, rtol=0)


def test_a_first_chunk_missing_everywhere_is_computed_as_its_lead_entry():
    model = models.tiny_model("llama")
    prompt = make_prompt(seed=9)
    eng = engine(model)
    res = eng.prefill_prompt(prompt, ratio=0.15)
    assert res.stats.misses == 3 and res.stats.lead
    first, *rest = prompt.chunk_ids
    assert eng.store.contains(eng.keys.lead_key(first)) and not eng.store.contains(eng.keys.chunk_key(first))
    assert all(eng.store.contains(eng.keys.chunk_key(c)) and not eng.store.contains(eng.keys.lead_key(c)) for c in rest)
    again = eng.prefill_prompt(prompt, ratio=0.15)  # from the store now: the same logits
    assert again.stats.hits == 3 and again.stats.lead
    torch.testing.assert_close(again.logits, res.logits, atol=1e-5, rtol=0)
    # the same chunk second in another prompt reads its gap entry (computed now)
    swapped = type(prompt)(prompt.prefix_ids, [rest[0], first, *rest[1:]], prompt.suffix_ids)
    eng.prefill_prompt(swapped, ratio=0.15)
    assert eng.store.contains(eng.keys.chunk_key(first))


def test_ensure_writes_both_entries_of_every_chunk(tiny_smollm2):
    model, tok = tiny_smollm2
    eng = BlendEngine(model, tok, MemoryStore())
    docs = ["Tea is brewed from the leaves of Camellia sinensis.", "Rivers carry boats to the sea."]
    keys, computed = eng.ensure(docs)
    chunks = eng.template.chunks(docs, None)
    assert computed == 2 and keys == [eng.keys.chunk_key(c) for c in chunks]
    assert sorted(eng.store.keys()) == sorted(k for c in chunks for k, _ in eng.keys.entry_keys(c))
    assert len(list(eng.store.keys())) == 4
    assert eng.ensure(docs) == (keys, 0)


def test_gap_zero_needs_no_lead_entry(tiny_smollm2):
    """With gap 0 every chunk entry already sits right behind the sink: one entry per chunk, and the
    first chunk reads it (no lead key is ever written or looked up)."""
    model, tok = tiny_smollm2
    eng = BlendEngine(model, tok, MemoryStore(), policy=PrecomputePolicy(gap=0, context=0, lead=True))
    assert not eng.keys.lead and eng.keys.chunk_start == eng.keys.lead_start
    docs = ["The lighthouse keeper counted the ships every night. " * 6]
    s = precompute(eng.prefiller, texts=docs, chunk_tokens=32)
    assert s.new == s.chunks > 0
    chunks = chunk_document(docs[0], eng.template, 32)
    res = eng.prefill("Who counted the ships?", chunks, ratio=0.15)
    assert res.stats.hits == len(chunks) and res.stats.misses == 0 and not res.stats.lead


@dataclass(frozen=True)
class LeadSpy(StartsSelector):
    """`starts`, recording what each request told it in SelectionRequest.lead."""

    seen: list = field(default_factory=list, compare=False)

    def schedule(self, req):
        self.seen.append(req.lead)
        return super().schedule(req)


def test_selectors_are_told_when_the_first_chunk_is_its_lead_entry():
    """SelectionRequest.lead: True when the first chunk was read (or computed) as its lead entry, False
    when a store without lead entries served its gap entry; `starts` then spends nothing on it."""
    spy = LeadSpy()
    model = models.tiny_model("llama")
    prompt = make_prompt(seed=7, sizes=(20, 20))
    old = MemoryStore()
    engine(model, old, lead=False).prefill_prompt(prompt, ratio=0)  # a store written without lead entries
    for store, lead in ((MemoryStore(), True), (old, False)):
        eng = BlendEngine(model, None, store, BlendConfig(selector=spy, pipelined=False), template=TEMPLATE)
        assert list(eng.keys.sink_ids) == prompt.prefix_ids  # (the template sink: a lead entry is exact)
        eng.prefill_prompt(prompt, ratio=0)  # (the store now holds what this reader needs)
        res = eng.prefill_prompt(prompt, ratio=0.5)
        assert spy.seen[-1] is lead and res.stats.lead is lead
        P = len(prompt.prefix_ids)
        # 20 of the 40 chunk tokens: the whole second chunk behind an exact lead chunk, else 10 of each
        expected = [*range(P + 20, P + 40)] if lead else [*range(P, P + 10), *range(P + 20, P + 30)]
        assert res.selected.tolist() == expected


def test_a_lead_entry_behind_a_shorter_sink_is_not_called_exact():
    """Under sink='bos' a lead entry sat behind the prefix's first token only: not full prefill's K/V,
    so selectors are not told the first chunk is exact."""
    spy = LeadSpy()
    model = models.tiny_model("llama")
    prompt = make_prompt(seed=7, sizes=(20, 20))
    eng = BlendEngine(model, None, MemoryStore(), BlendConfig(selector=spy, pipelined=False), template=TEMPLATE,
                      policy=PrecomputePolicy(sink="bos"))
    res = eng.prefill_prompt(prompt, ratio=0.5)
    assert res.stats.lead and spy.seen == [False]
