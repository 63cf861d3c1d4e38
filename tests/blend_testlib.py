"""Shared pieces of the read-path tests on tiny models: a fixed prompt layout, random prompts, and a
slow store wrapper."""

from __future__ import annotations

import time

import torch

from ragkv.prompt import Prompt, PromptTemplate

TEMPLATE = PromptTemplate(None, prefix_ids=[1, 5, 6, 9], tail_ids=[7, 8])


def make_prompt(seed: int = 0, sizes=(13, 29, 7), suffix=(40, 41, 42, 7, 8)) -> Prompt:
    """Random chunk token ids of the given sizes between TEMPLATE's prefix and a fixed suffix."""
    g = torch.Generator().manual_seed(seed)
    chunks = [torch.randint(10, 500, (n,), generator=g).tolist() for n in sizes]
    return Prompt(list(TEMPLATE.prefix_ids), chunks, list(suffix))


class SlowStore:
    """A store whose layer reads take ``delay_s`` seconds each (a slow tier); the rest delegates."""

    def __init__(self, inner, delay_s: float):
        self.inner, self.delay_s = inner, delay_s

    def get_layer(self, key, i):
        time.sleep(self.delay_s)
        return self.inner.get_layer(key, i)

    def __getattr__(self, name):
        return getattr(self.inner, name)
