"""The model fingerprint: the same from a model in memory and from its checkpoint files (what the HF
engine and vLLM's scheduler compute), and different for anything that changes the K/V."""

import time

import pytest
import torch

from ragkv import gguf, models
from ragkv.fingerprint import fingerprint, fingerprint_dir


def _saved(model, path, **kw):
    model.save_pretrained(path, **kw)
    return path


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_checkpoint_and_the_model_loaded_from_it_have_one_fingerprint(kind, dtype, tmp_path):
    from transformers import AutoModelForCausalLM

    src = models.tiny_model(kind, seed=3)  # qwen2: q/k/v biases, an untied head
    path = _saved(src, tmp_path / "ckpt")
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)  # what the HF engine runs
    assert fingerprint(loaded) == fingerprint_dir(path, dtype)
    assert fingerprint(loaded).dtype == str(dtype).removeprefix("torch.")
    sharded = _saved(src, tmp_path / "sharded", max_shard_size="100KB")  # a checkpoint in several files
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert fingerprint_dir(sharded, dtype) == fingerprint_dir(path, dtype)


def test_a_tied_head_is_not_in_the_checkpoint_and_not_in_the_fingerprint(tmp_path):
    model = models.tiny_model("llama", tie_word_embeddings=True)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert fingerprint(model) == fingerprint_dir(_saved(model, tmp_path / "c"), torch.float32)


def test_whatever_changes_the_kv_changes_the_fingerprint(tmp_path):
    base = models.tiny_model("llama", seed=0)
    fp = fingerprint(base)
    assert fingerprint(models.tiny_model("llama", seed=0)) == fp  # stable
    assert fingerprint(models.tiny_model("llama", seed=1)) != fp  # other weights
    assert fingerprint(models.tiny_model("llama", seed=0).to(torch.float16)).digest() != fp.digest()  # dtype
    tuned = models.tiny_model("llama", seed=0)
    with torch.no_grad():  # one projection of one layer changed (as a merged adapter would)
        tuned.model.layers[2].self_attn.v_proj.weight.mul_(1.01)
    assert fingerprint(tuned).weights != fp.weights
    roped = models.tiny_model("llama", seed=0, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    assert fingerprint(roped).rope != fp.rope and fingerprint(roped).digest() != fp.digest()
    # the config a checkpoint runs with (e.g. a rope override) counts, not only the one on disk
    path = _saved(base, tmp_path / "c")
    assert fingerprint_dir(path, torch.float32, config=roped.config) != fingerprint_dir(path, torch.float32)


def test_a_directory_without_safetensors_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors checkpoint"):
        fingerprint_dir(tmp_path, torch.float32)


@pytest.mark.slow
def test_smollm2_from_its_directory_in_milliseconds_equals_the_loaded_model(smollm2):
    model, _ = smollm2
    path = gguf.convert_smollm2()
    t = time.perf_counter()
    from_files = fingerprint_dir(path, model.dtype)
    took = time.perf_counter() - t
    assert from_files == fingerprint(model)
    gguf_model, _ = gguf.load_gguf(gguf.smollm2_gguf_path(), dtype=model.dtype)
    assert fingerprint(gguf_model) == from_files  # the same weights loaded from the GGUF
    print(f"fingerprint_dir(SmolLM2-135M): {took * 1e3:.1f} ms")
