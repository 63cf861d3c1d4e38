"""Correcting the stored V of the chunk rows a blend does not recompute (``QuerySelector(correct="v")``)."""

from __future__ import annotations

import pytest
import torch
from blend_testlib import TEMPLATE, make_prompt

from ragkv import models
from ragkv.blend import BlendEngine
from ragkv.blend.select import QuerySelector
from ragkv.store.memory import MemoryStore


def test_each_chunks_other_rows_move_by_its_recomputed_rows_mean_v_deviation():
    model = models.tiny_model("llama")
    sizes = (13, 29, 17)
    prompt = make_prompt(3, sizes=sizes)
    eng = BlendEngine(model, None, MemoryStore(), template=TEMPLATE)
    naive, plain, fixed = (eng.with_config(selector=sel).prefill_prompt(prompt, ratio=r) for sel, r in
                           ((QuerySelector(), 0.0), (QuerySelector(), 0.3), (QuerySelector(correct="v"), 0.3)))
    assert torch.equal(plain.selected, fixed.selected) and plain.selected.numel() > 0

    def v0(res):  # layer 0's V in the handed-off cache, [kv_heads, T - 1, head_dim]
        return res.cache.layers[0].values[0].float()

    stored, before, after = v0(naive), v0(plain), v0(fixed)
    start, checked = len(TEMPLATE.prefix_ids) + sizes[0], 0  # the first chunk is its lead entry: exact, no correction
    for n in sizes[1:]:
        rows = torch.arange(start, start + n)
        picked = rows[torch.isin(rows, plain.selected)]
        rest = rows[~torch.isin(rows, plain.selected)]
        # layer 0's fresh rows are the same either way (computed from the embeddings alone)
        torch.testing.assert_close(after[:, picked], before[:, picked])
        if picked.numel():
            shift = (before[:, picked] - stored[:, picked]).mean(1, keepdim=True)
            torch.testing.assert_close(after[:, rest] - stored[:, rest], shift.expand(-1, rest.numel(), -1),
                                       atol=1e-5, rtol=1e-4)
            checked += 1
        else:
            torch.testing.assert_close(after[:, rest], stored[:, rest])
        start += n
    assert checked


def test_correct_names_a_known_correction():
    with pytest.raises(ValueError, match="correct must be one of none, v"):
        QuerySelector(correct="k")
