"""The model's identity in every cache key: the same from a model in memory and from its checkpoint.

    fingerprint(model)               a transformers model in memory (the HF engine, ``ragkv precompute``)
    fingerprint_dir(path, dtype)     a safetensors checkpoint directory, read in milliseconds without
                                     loading the weights (vLLM's scheduler, ragkv's vLLM connector)

Both give the same ``ModelFingerprint`` for the same checkpoint run in the same dtype: its config
(architecture, layers, KV heads, head dim, RoPE), the dtype, and a digest of every tensor's name,
shape and a sample of its values *as the model computes with them* (the checkpoint's values cast to
the run's dtype, exactly as loaders cast them): ``SAMPLE`` elements from the start, the middle and the
end of each tensor. Reading samples instead of every weight keeps this in milliseconds for any model
size (hashing all of SmolLM2-135M took 0.5 s; an 8B model would take a minute).

What it cannot see: two checkpoints that differ only in elements no sample touches (e.g. a handful of
edited embedding rows) share keys. Give such a variant its own ``namespace``.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from collections.abc import Iterable
from pathlib import Path

import torch

from ragkv.keys import ModelFingerprint

SAMPLE = 16  # elements read at the start, the middle and the end of every tensor
_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


def _spans(numel: int) -> list[tuple[int, int]]:
    """The element ranges sampled from a tensor of ``numel`` elements (merged where they overlap)."""
    out: list[tuple[int, int]] = []
    for start in (0, max(0, numel // 2 - SAMPLE // 2), max(0, numel - SAMPLE)):
        end = min(numel, start + SAMPLE)
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        elif end > start:
            out.append((start, end))
    return out


def _digest(tensors: Iterable[tuple[str, tuple[int, ...], torch.Tensor]]) -> str:
    """blake2b over (name, shape, sampled values) of each tensor, in name order; values given in the
    run's dtype."""
    h = hashlib.blake2b(digest_size=16)
    for name, shape, values in sorted(tensors, key=lambda t: t[0]):
        h.update(json.dumps([name, list(shape), str(values.dtype)]).encode())
        h.update(values.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _skipped(config, name: str) -> bool:
    """Tensors a checkpoint does not hold but the model in memory does: a head tied to the embeddings."""
    return name == "lm_head.weight" and bool(getattr(_text(config), "tie_word_embeddings", False))


def _text(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _from_config(config, weights: str, dtype: torch.dtype | str, model_class: str = "") -> ModelFingerprint:
    cfg = _text(config)
    archs = getattr(config, "architectures", None) or getattr(cfg, "architectures", None) or [model_class]
    heads = cfg.num_attention_heads
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    if not rope:  # (configs of transformers < 5 spell it rope_theta + rope_scaling)
        rope = {"rope_theta": getattr(cfg, "rope_theta", None), **(getattr(cfg, "rope_scaling", None) or {})}
    return ModelFingerprint(
        architecture=archs[0] or type(config).__name__,
        weights=weights,
        dtype=str(dtype).removeprefix("torch."),
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        rope={k: v for k, v in sorted(rope.items()) if isinstance(v, (int, float, str, bool)) and v is not None},
    )


_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (dtype, ModelFingerprint)


def fingerprint(model) -> ModelFingerprint:
    """The fingerprint of a transformers model in memory (cached per model object and dtype; weights
    edited in place after the first call are not noticed: use a fresh model object then)."""
    dtype = model.dtype
    cached = _cache.get(model)
    if cached is None or cached[0] != dtype:
        samples = []
        with torch.no_grad():
            for name, t in model.state_dict().items():
                if _skipped(model.config, name):
                    continue
                flat = t.detach().reshape(-1)
                values = torch.cat([flat[a:b] for a, b in _spans(flat.numel())]) if flat.numel() else flat
                samples.append((name, tuple(t.shape), values.cpu()))
        fp = _from_config(model.config, _digest(samples), dtype, type(model).__name__)
        cached = _cache[model] = (dtype, fp)
    return cached[1]


def fingerprint_dir(path: str | Path, dtype: torch.dtype | str, config=None) -> ModelFingerprint:
    """The fingerprint of the safetensors checkpoint in ``path`` run in ``dtype``, without loading its
    weights (reads the file headers and a few bytes per tensor). ``config``: the config the model
    runs with (e.g. vLLM's ``hf_config``, with any overrides); default: the directory's own."""
    from ragkv.models import parse_dtype

    path, dtype = Path(path), parse_dtype(dtype)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors checkpoint; ragkv fingerprints safetensors checkpoints "
                                "(re-save the model with save_pretrained(..., safe_serialization=True))")
    if config is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path, local_files_only=True)
    samples = []
    for file in files:
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
            base = 8 + size
            for name, info in header.items():
                if name == "__metadata__" or _skipped(config, name):
                    continue
                if info["dtype"] not in _ST_DTYPES:
                    raise ValueError(f"{file}: tensor {name} has dtype {info['dtype']}, which ragkv cannot read")
                stored, numel = _ST_DTYPES[info["dtype"]], 1
                for n in info["shape"]:
                    numel *= n
                width, start = stored.itemsize, base + info["data_offsets"][0]
                parts = []
                for a, b in _spans(numel):
                    f.seek(start + a * width)
                    parts.append(torch.frombuffer(bytearray(f.read((b - a) * width)), dtype=stored))
                values = torch.cat(parts) if parts else torch.empty(0, dtype=stored)
                samples.append((name, tuple(info["shape"]), values.to(dtype)))
    return _from_config(config, _digest(samples), dtype)
