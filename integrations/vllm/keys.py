"""The connector's cache keys, from the model directory alone: no model object in any vLLM process.

ragkv keys every entry by the model's fingerprint (``ragkv.models.fingerprint``: the digest of the
transformers model's ``state_dict`` in its dtype, its config and its tokenizer). ``checkpoint_digest``
computes that same digest from the checkpoint files, one tensor at a time, so keys made here equal
the keys ``ragkv precompute`` and the HF engine make for the same directory and dtype (a test holds
them to it). A checkpoint this reads differently from transformers gives other keys: misses, never
another model's K/V (entries also carry the fingerprint, checked at every read).

Interim: reading every weight costs about a second per GB in each process that builds keys. The
scheduler side needs only ``ChunkKeys``: the store, the prompt template (tokenizer) and this digest.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from ragkv.keys import chunk_key
from ragkv.models import digest_update, fingerprint_of
from ragkv.policy import PrecomputePolicy
from ragkv.prompt import PromptTemplate

_IGNORED = ("rotary_emb.inv_freq",)  # saved by old checkpoints, not part of a transformers model's state_dict
_digests: dict[tuple, str] = {}
_lock = threading.Lock()


def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"{model_dir}: no model.safetensors or model.safetensors.index.json; ragkv's vLLM "
                            "connector keys chunks by the safetensors checkpoint (it never unpickles .bin files)")


def checkpoint_digest(model_dir: str | Path, dtype: torch.dtype, tied_embeddings: bool) -> str:
    """``ragkv.models``' weights digest of the transformers model loaded from ``model_dir`` in
    ``dtype``: every checkpoint tensor (floating ones cast to ``dtype``) by name, plus
    ``lm_head.weight`` = the input embeddings when they are tied and not saved."""
    from safetensors import safe_open

    source = {}  # state_dict name -> (open checkpoint file, its name there)
    for path in _checkpoint_files(Path(model_dir)):
        f = safe_open(str(path), framework="pt")
        source.update({name: (f, name) for name in f.keys() if not name.endswith(_IGNORED)})  # noqa: SIM118 (safe_open)
    if tied_embeddings and "lm_head.weight" not in source and "model.embed_tokens.weight" in source:
        source["lm_head.weight"] = source["model.embed_tokens.weight"]
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(source):
        f, stored = source[name]
        t = f.get_tensor(stored)
        digest_update(h, name, t.to(dtype) if t.is_floating_point() else t)
    return h.hexdigest()


def model_digest(model_dir: str, dtype: torch.dtype, tokenizer) -> str:
    """The fingerprint digest (``ragkv.models.fingerprint(model, tokenizer).digest()``) of the
    transformers model ``model_dir`` would load in ``dtype``, without loading it (once per process)."""
    from transformers import AutoConfig

    key = (str(Path(model_dir).resolve()), str(dtype), type(tokenizer).__name__, len(tokenizer))
    with _lock:
        if key not in _digests:
            cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
            tied = bool(getattr(cfg.get_text_config(), "tie_word_embeddings", False))
            weights = checkpoint_digest(model_dir, dtype, tied)
            fp = fingerprint_of(cfg, weights, str(dtype).removeprefix("torch."), tokenizer)
            _digests[key] = fp.digest()
        return _digests[key]


@dataclass
class ChunkKeys:
    """What the scheduler side needs to look chunks up, with keys computed as BlendEngine computes
    them (same fingerprint, policy and namespace): the store, the prompt template and the model's
    context length. No model, no weights in memory."""

    store: object
    template: PromptTemplate
    fingerprint: str
    policy_id: str
    namespace: str = ""
    max_positions: int | None = None

    @classmethod
    def build(cls, store, tokenizer, hf_config, fingerprint: str, namespace: str = "",
              policy: PrecomputePolicy | None = None) -> ChunkKeys:
        template = PromptTemplate.for_tokenizer(tokenizer)
        policy = (policy or PrecomputePolicy()).resolve(SimpleNamespace(config=hf_config))  # (reads the config only)
        return cls(store, template, fingerprint, policy.policy_id(template), namespace,
                   getattr(hf_config, "max_position_embeddings", None))

    def chunk_key(self, ids) -> str:
        return chunk_key(self.fingerprint, ids, self.policy_id, self.namespace)
