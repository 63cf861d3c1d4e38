"""Shared fixtures: the real SmolLM2 model (loaded once per session) and tiny random models."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# Triton kernels run on CPU tensors only under the interpreter, which must be chosen before triton is
# imported; on a CUDA machine the real kernels run.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ragkv import models

# shared test helpers (redis_server.py) live beside this file; make them importable from every test dir
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the real SmolLM2-135M-Instruct, from the converted directory."""
    torch.manual_seed(0)
    return models.load("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """Only SmolLM2's tokenizer (no weights): for tests about text, chunks, keys and templates."""
    return models.load_tokenizer("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_template(smollm2_tokenizer):
    from ragkv.prompt import PromptTemplate

    return PromptTemplate.for_tokenizer(smollm2_tokenizer)


@pytest.fixture(params=["llama", "mistral", "qwen2"])
def tiny(request):
    return models.tiny_model(request.param)
