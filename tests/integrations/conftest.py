"""Fixtures for the integrations: a fresh BlendedGenerator over SmolLM2 and an in-memory store per test."""

from __future__ import annotations

import pytest
import torch
from integration_data import DOCS

from ragkv.store import open_store


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread while these tests run: on a shared 2-core machine two OpenMP threads
    oversubscribe and a SmolLM2 forward goes from ~0.5 s to ~9 s. Restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def make_gen(smollm2):
    from ragkv.blend import BlendConfig
    from ragkv.integrations.hf import BlendedGenerator

    model, tokenizer = smollm2

    def make(ratio: float = 0.15, store=None):
        return BlendedGenerator(model, tokenizer, store or open_store("memory"), BlendConfig(ratio=ratio))

    return make


@pytest.fixture(scope="session")
def docs() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(DOCS.glob("*.md"))}
