"""BlendedGenerator: exactness at ratio=1, reuse on the second call, streaming, batches, bad input."""

from __future__ import annotations

import math
from threading import Thread

import pytest
import torch
from integration_data import CONTEXTS, QUESTION

from ragkv.decode import pad_token_id

pytestmark = pytest.mark.slow
NEW = 4


def test_ratio_one_equals_plain_generate(make_gen, smollm2):
    model, _ = smollm2
    gen = make_gen(ratio=1.0)
    out = gen.generate(QUESTION, CONTEXTS, max_new_tokens=NEW)
    ids = torch.tensor([gen.engine.build_prompt(QUESTION, CONTEXTS).input_ids])
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                             temperature=None, top_p=None, top_k=None, pad_token_id=pad_token_id(model, gen.engine.tokenizer))
    assert out.token_ids == ref[0, ids.shape[1]:].tolist()
    assert out.misses == len(CONTEXTS) and out.hits == 0


def test_second_call_hits_and_recomputes_only_selected(make_gen):
    gen = make_gen(ratio=0.15)
    first = gen.generate(QUESTION, CONTEXTS, max_new_tokens=1)
    assert (first.hits, first.misses, first.reused_tokens) == (0, 3, 0)
    second = gen.generate(QUESTION, CONTEXTS, max_new_tokens=1)
    n_chunk = sum(len(gen.engine.template.chunk_ids(c)) for c in CONTEXTS)
    assert (second.hits, second.misses) == (3, 0)
    assert second.reused_tokens == n_chunk
    assert second.recomputed_tokens == math.ceil(0.15 * n_chunk)
    assert 0 < second.ttft <= second.t_total
    assert second.stats_dict()["ttft"] == second.ttft


def test_streaming_yields_the_same_text(make_gen):
    from transformers import TextIteratorStreamer

    gen = make_gen()
    plain = gen.generate(QUESTION, CONTEXTS, max_new_tokens=NEW)
    streamer = TextIteratorStreamer(gen.tokenizer, skip_prompt=True, skip_special_tokens=True)
    box = {}
    thread = Thread(target=lambda: box.update(res=gen.generate(QUESTION, CONTEXTS, max_new_tokens=NEW,
                                                                    streamer=streamer)))
    thread.start()
    pieces = list(streamer)
    thread.join()
    assert len(pieces) >= 1
    assert "".join(pieces).strip() == plain.text == box["res"].text
    assert box["res"].misses == 0


def test_batch_returns_one_result_per_question(make_gen):
    gen = make_gen()
    outs = gen.generate([QUESTION, "How far can the light be seen?"], [CONTEXTS[:2], CONTEXTS[1:]],
                        max_new_tokens=1)
    assert [len(o.token_ids) for o in outs] == [1, 1]
    assert (outs[0].misses, outs[1].hits, outs[1].misses) == (2, 1, 1)  # the shared chunk hits
    with pytest.raises(ValueError, match="one list of contexts per question"):
        gen.generate([QUESTION, QUESTION], [CONTEXTS])


def test_bad_input_gives_clear_errors(make_gen):
    gen = make_gen()
    with pytest.raises(ValueError, match="contexts is empty"):
        gen.generate(QUESTION, [])
    with pytest.raises(TypeError, match="context 1 is a int, expected str"):
        gen.generate(QUESTION, [CONTEXTS[0], 42])
    with pytest.raises(TypeError, match="not one string"):
        gen.generate(QUESTION, CONTEXTS[0])
    with pytest.raises(ValueError, match="context 1 is empty"):
        gen.generate(QUESTION, [CONTEXTS[0], "  "])
    huge = "lighthouse " * (gen.engine.adapter.max_positions + 10)
    with pytest.raises(ValueError, match=r"context 1 \('lighthouse lighthouse.*longer than the model's window"):
        gen.generate(QUESTION, [CONTEXTS[0], huge])
    key = gen.engine.keys.chunk_key(gen.engine.template.chunk_ids(CONTEXTS[0]))
    assert not gen.engine.store.contains(key)  # refused before anything was computed


def test_generate_kwargs_pass_through(make_gen):
    from transformers import StoppingCriteria, StoppingCriteriaList

    class AfterTwo(StoppingCriteria):  # stop once two tokens are generated
        n = 0

        def __call__(self, input_ids, scores, **kwargs):
            self.n += 1
            return torch.full((input_ids.shape[0],), self.n >= 2, dtype=torch.bool)

    gen = make_gen()
    out = gen.generate(QUESTION, CONTEXTS, max_new_tokens=10, stopping_criteria=StoppingCriteriaList([AfterTwo()]))
    assert len(out.token_ids) == 2
    sampled = []
    for _ in range(2):
        torch.manual_seed(7)
        sampled.append(gen.generate(QUESTION, CONTEXTS, max_new_tokens=4, do_sample=True, temperature=0.9,
                                    top_p=0.9).token_ids)
    assert sampled[0] == sampled[1] and len(sampled[0]) == 4


@pytest.mark.slow
def test_auto_ratio_through_the_wrapper(make_gen):
    gen = make_gen(ratio="auto")
    gen.generate(QUESTION, CONTEXTS, max_new_tokens=4)
    out = gen.generate(QUESTION, CONTEXTS, max_new_tokens=4)
    assert out.misses == 0 and out.stats.ratio >= 0.15
