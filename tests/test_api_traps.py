"""API traps a careless caller falls into: each is a clear error or does what the caller asked."""

from __future__ import annotations

import pytest
import torch
from blend_testlib import TEMPLATE, make_prompt

from ragkv import models
from ragkv.blend import BlendConfig
from ragkv.integrations.hf import BlendedGenerator
from ragkv.store.memory import MemoryStore


@pytest.fixture
def gen(tiny_smollm2):
    model, tok = tiny_smollm2
    return BlendedGenerator(model, tok, MemoryStore())


def test_ratio_and_config_cannot_both_be_given(tiny_smollm2):
    model, tok = tiny_smollm2
    with pytest.raises(TypeError):
        BlendedGenerator(model, tok, MemoryStore(), ratio=0.15, config=BlendConfig(ratio=0.3))
    with pytest.raises(TypeError, match="config must be a BlendConfig"):
        BlendedGenerator(model, tok, MemoryStore(), 0.3)


def test_sampling_parameters_are_never_overwritten(gen, monkeypatch):
    seen = {}
    real = gen.model.generate

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(gen.model, "generate", spy)
    torch.manual_seed(0)
    gen.generate("why?", ["some context text"], max_new_tokens=3, temperature=0.7, top_p=0.8)
    assert seen["temperature"] == 0.7 and seen["top_p"] == 0.8 and seen["do_sample"] is True
    gen.generate("why?", ["some context text"], max_new_tokens=3)
    assert seen["do_sample"] is False and seen["temperature"] is None  # greedy by default
    gen.generate("why?", ["some context text"], max_new_tokens=3, do_sample=False, top_k=5)
    assert seen["do_sample"] is False and seen["top_k"] == 5  # explicit do_sample wins


def test_generation_kwargs_defaults():
    from ragkv.decode import generation_kwargs

    model = models.tiny_model("llama")
    assert generation_kwargs(model)["do_sample"] is False
    kw = generation_kwargs(model, None, temperature=0.5, max_new_tokens=7)
    assert kw["do_sample"] is True and kw["temperature"] == 0.5 and kw["max_new_tokens"] == 7


@pytest.mark.parametrize("question", [None, 42, "", "   "])
def test_a_missing_question_is_a_clear_error(gen, question):
    with pytest.raises(ValueError, match="question must be a non-empty string"):
        gen.generate(question, ["some context text"])


def test_storage_format_is_validated_up_front():
    from ragkv.policy import StorageFormat

    with pytest.raises(ValueError, match="storage dtype 'int4'"):
        StorageFormat("int4")
    with pytest.raises(ValueError, match="only meaningful with storage dtype int8"):
        StorageFormat("float16", "token")
    with pytest.raises(ValueError, match="quant_axis 'row'"):
        StorageFormat("int8", "row")


def test_bad_check_layers_fail_when_the_engine_is_built():
    from ragkv.blend import BlendEngine, DeviationSelector

    with pytest.raises(ValueError, match=">= 0"):
        DeviationSelector(check_layers=(-1,))
    with pytest.raises(ValueError, match="check layer 9 >= number of layers 4"):
        BlendEngine(models.tiny_model("llama"), None, MemoryStore(), BlendConfig(selector=DeviationSelector((9,))),
                    template=TEMPLATE)


def test_a_bad_check_layer_never_deletes_stored_entries():
    """`ragkv eval --check-layers=-1` used to read layer -1, call every entry corrupt and delete it."""
    from ragkv.blend import BlendEngine, DeviationSelector

    model, store = models.tiny_model("llama"), MemoryStore()
    eng = BlendEngine(model, None, store, template=TEMPLATE)
    prompt = make_prompt(seed=3)
    eng.prefill_prompt(prompt)
    keys = set(store.keys())
    with pytest.raises(ValueError):
        eng.with_config(selector=DeviationSelector(check_layers=(-1,)))
    assert set(store.keys()) == keys and len(keys) == 4
