"""Neighbour-conditioned chunk caches (``PrecomputePolicy(context=k)``): which chunks a chunk is
prefilled behind (ragkv.neighbours), that the stored K/V are exactly the chunk's rows of one forward
over sink + neighbours + chunk at the policy's positions, and that the precompute job, its shards and
the read path's write-back of misses all pick neighbours the same way."""

from __future__ import annotations

import pytest
import torch
from blend_testlib import TEMPLATE, make_prompt
from click.testing import CliRunner

from ragkv import models
from ragkv.adapter import ModelAdapter
from ragkv.blend import BlendEngine
from ragkv.chunking import chunk_document
from ragkv.cli import main
from ragkv.neighbours import lexical_neighbours, neighbour_contexts
from ragkv.policy import PrecomputePolicy
from ragkv.precompute import precompute
from ragkv.prefill import Prefiller, prefill_kv
from ragkv.store import open_store
from ragkv.store.memory import MemoryStore

SINK = list(TEMPLATE.prefix_ids)


def test_the_nearest_chunk_shares_the_rare_tokens_not_the_common_ones():
    common = [1, 2, 3]  # in every chunk: weighs nothing, so sharing only it makes no neighbour
    chunks = [[*common, 10, 11, 12, 13], [*common, 20, 21], [*common, 10, 11, 12, 30], [*common, 40], [*common, 20, 50]]
    assert lexical_neighbours(chunks, 1) == [[2], [4], [0], [], [1]]
    assert lexical_neighbours(chunks, 2) == [[2], [4], [0], [], [1]]
    chunks[3] = [*common, 10, 40]  # now 3 shares one rare token with 0 and 2: ranked after 0 <-> 2
    assert lexical_neighbours(chunks, 2)[0] == [2, 3] and lexical_neighbours(chunks, 2)[3][0] in (0, 2)
    assert lexical_neighbours(chunks, 0) == [[]] * 5
    with pytest.raises(ValueError, match="k must be >= 0"):
        lexical_neighbours(chunks, -1)


def test_a_chunk_is_never_its_own_neighbour_nor_an_identical_copy_and_unrelated_chunks_are_not_neighbours():
    chunks = [[5, 6, 7], [5, 6, 7], [5, 6, 8], [90, 91]]
    assert lexical_neighbours(chunks, 3) == [[2], [2], [0, 1], []]
    assert lexical_neighbours([], 2) == []


def test_scores_in_blocks_equal_scores_in_one_block():
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randint(0, 300, (40,), generator=g).tolist() for _ in range(37)]
    every = lexical_neighbours(chunks, 3, block=1000)
    assert lexical_neighbours(chunks, 3, block=5) == every
    assert lexical_neighbours(chunks, 3, block=4, rows=[30, 2, 11]) == [every[30], every[2], every[11]]


def test_contexts_put_the_most_similar_neighbour_right_before_the_chunk():
    a, b, c, d = [10, 11, 12, 13], [10, 11, 12, 99], [10, 11, 50, 51], [70, 71]
    assert neighbour_contexts([a], [a, b, c, d], 2) == [c + b]  # b (nearest) last
    assert neighbour_contexts([a], [a], 1) == [[]]  # nothing else in the pool
    assert neighbour_contexts([a, b, d], [], 1) == [b, a, []]  # the chunks themselves are in the pool


def _reference(model, chunk, ctx, gap):
    """The chunk's rows of one forward over sink + context + chunk, context ending at len(sink) + gap."""
    s = len(SINK)
    ids = torch.tensor([SINK + ctx + chunk])
    pos = torch.cat([torch.arange(s), torch.arange(s + gap - len(ctx), s + gap + len(chunk))])[None]
    layers = ModelAdapter.of(model).prefill_layers(ids, pos)
    return [(k[0, :, s + len(ctx):], v[0, :, s + len(ctx):]) for k, v in layers]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_chunk_behind_its_context_is_the_chunk_rows_of_one_forward_also_batched(arch):
    model = models.tiny_model(arch)
    g = torch.Generator().manual_seed(3)
    chunks = [torch.randint(10, 500, (n,), generator=g).tolist() for n in (13, 29, 7)]
    contexts = [chunks[1], [], chunks[0] + chunks[1]]  # different lengths in one batch (padding)
    gap = 40
    got = prefill_kv(ModelAdapter.of(model), SINK, chunks, gap=gap, contexts=contexts)
    for chunk, ctx, layers in zip(chunks, contexts, got):
        want = _reference(model, chunk, ctx[-gap:], gap)
        for (k, v), (wk, wv) in zip(layers, want):
            assert k.shape == wk.shape == (model.config.num_key_value_heads, len(chunk), k.shape[-1])
            torch.testing.assert_close(k, wk, atol=1e-5, rtol=0)
            torch.testing.assert_close(v, wv, atol=1e-5, rtol=0)
    alone = prefill_kv(ModelAdapter.of(model), SINK, chunks[:1], gap=gap)  # no context: not the same K/V
    assert not torch.allclose(alone[0][1][0], got[0][1][0], atol=1e-3)
    with pytest.raises(ValueError, match="2 contexts for 3 chunks"):
        prefill_kv(ModelAdapter.of(model), SINK, chunks, gap=gap, contexts=contexts[:2])


def test_the_context_policy_is_part_of_every_key_and_checked():
    model = models.tiny_model("llama")
    plain = BlendEngine(model, None, MemoryStore(), template=TEMPLATE, policy=PrecomputePolicy(context=0))
    near = BlendEngine(model, None, MemoryStore(), template=TEMPLATE, policy=PrecomputePolicy(context=1))
    assert near.keys.policy_id != plain.keys.policy_id and "-ctx1-" in near.keys.policy_id
    assert near.keys.chunk_key([11, 12]) != plain.keys.chunk_key([11, 12])
    for bad in (-1, 5, True, 1.0, "1"):
        with pytest.raises(ValueError, match="context must be an integer from 0 to 4"):
            PrecomputePolicy(context=bad)
    with pytest.raises(ValueError, match="gap 0 leaves no room"):
        PrecomputePolicy(gap=0, context=1)


def test_a_miss_at_query_time_is_prefilled_behind_its_nearest_chunk_of_the_prompt_and_blends_exactly_at_one():
    model = models.tiny_model("llama")
    prompt = make_prompt(seed=5, sizes=(13, 29, 7, 21))
    prompt.chunk_ids[3] = prompt.chunk_ids[0][:10] + prompt.chunk_ids[3][10:]  # chunk 3 is near chunk 0
    eng = BlendEngine(model, None, MemoryStore(), template=TEMPLATE, policy=PrecomputePolicy(context=1))
    res = eng.prefill_prompt(prompt, ratio=1.0)
    assert res.stats.misses == 4
    with torch.no_grad():
        full = model(torch.tensor([prompt.input_ids])).logits[0, -1].float()
    torch.testing.assert_close(res.logits, full, atol=1e-4, rtol=0)
    near = lexical_neighbours(prompt.chunk_ids, 1)
    assert near[0] == [3] and near[3] == [0]
    stored = eng.store.get(eng.keys.chunk_key(prompt.chunk_ids[3]))
    want = _reference(model, prompt.chunk_ids[3], prompt.chunk_ids[0], eng.prefiller.policy.gap)
    torch.testing.assert_close(stored.layers[1][0], want[1][0], atol=1e-5, rtol=0)


def test_precompute_prefills_each_chunk_behind_its_nearest_chunk_of_the_whole_corpus_in_every_shard(tiny_smollm2):
    model, tok = tiny_smollm2
    texts = ["Tea leaves are picked, withered, rolled and dried. Green tea is not oxidised. " * 6,
             "Rivers carry sediment to deltas, where it settles and builds new land. " * 6,
             "Black tea leaves are rolled and fully oxidised before drying, unlike green tea. " * 6]
    whole = open_store("memory")
    eng = BlendEngine(model, tok, whole, policy=PrecomputePolicy(context=1))
    s = precompute(eng.prefiller, texts=texts, chunk_tokens=64)
    assert s.failed == 0 and s.new == 2 * s.chunks  # each chunk's context entry and its lead entry
    chunks = [eng.template.chunk_ids(c) for t in texts for c in chunk_document(t, eng.template, 64)]
    ctx = neighbour_contexts(chunks, chunks, 1)
    for ids, c in zip(chunks, ctx):
        want = prefill_kv(ModelAdapter.of(model), eng.keys.sink_ids, [ids], gap=eng.prefiller.policy.gap, contexts=[c])[0]
        got = whole.get(eng.keys.chunk_key(ids))
        for li in (0, model.config.num_hidden_layers - 1):
            torch.testing.assert_close(got.layers[li][0].float(), want[li][0].float(), atol=1e-5, rtol=0)
    for i in range(2):  # each shard computes its own chunks but picks neighbours among all of them
        part = open_store("memory")
        precompute(Prefiller(model, tok, part, policy=PrecomputePolicy(context=1)), texts=texts, chunk_tokens=64,
                   shard=f"{i}/2")
        written = list(part.keys())
        assert written
        for key in written:
            torch.testing.assert_close(part.get(key).layers[1][1], whole.get(key).layers[1][1], atol=0, rtol=0)
    # keys=: only the chunks asked for (what a question set uses), neighbours still from every document
    some = open_store("memory")
    wanted = {eng.keys.chunk_key(chunks[0]), eng.keys.chunk_key(chunks[-1])}
    s = precompute(Prefiller(model, tok, some, policy=PrecomputePolicy(context=1)), texts=texts, chunk_tokens=64,
                   keys=wanted)
    leads = {eng.keys.lead_key(chunks[0]), eng.keys.lead_key(chunks[-1])}  # a chunk's lead entry comes with it
    assert set(some.keys()) == wanted | leads and s.new == 4
    for key in wanted | leads:
        torch.testing.assert_close(some.get(key).layers[1][1], whole.get(key).layers[1][1], atol=0, rtol=0)


def test_cli_refuses_a_bad_context(tmp_path):
    doc = tmp_path / "a.md"
    doc.write_text("some text")
    r = CliRunner().invoke(main, ["precompute", str(doc), "--store", f"disk://{tmp_path}/s", "--context", "9"])
    assert r.exit_code == 2 and "--context" in r.output and "0<=x<=4" in r.output
    r = CliRunner().invoke(main, ["precompute", str(doc), "--store", f"disk://{tmp_path}/s", "--context", "1",
                                  "--gap", "0"])
    assert r.exit_code == 2 and "gap 0 leaves no room" in r.output and "Traceback" not in r.output
