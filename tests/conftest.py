"""Shared fixtures: the real SmolLM2 model (loaded once per session) and tiny random models."""

from __future__ import annotations

import pytest
import torch

from ragkv import models


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the real SmolLM2-135M-Instruct, from the converted directory."""
    torch.manual_seed(0)
    return models.load("smollm2-135m")


@pytest.fixture(params=["llama", "mistral", "qwen2"])
def tiny(request):
    return models.tiny_model(request.param)
