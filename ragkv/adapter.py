"""What the blend engine needs from a HuggingFace decoder-only model, found by structure, with every
capability the engine relies on checked up front.

The engine drives the model's *own* modules (embedding, decoder layers with their attention
implementation, final norm, LM head); it never re-implements attention per model family. It does rely on:
  - the Llama-family layout: ``model.model.{embed_tokens, layers, norm, rotary_emb}`` + ``model.lm_head``
    (Llama, Mistral, Qwen2, Qwen3, Phi-3-style models with RoPE share it);
  - decoder layers that call ``cache.update(k, v, layer_idx, ...)`` and use the 4-D additive mask they get;
  - a RoPE whose rotation depends on position only, so a cached key moves to a new position by a pure
    rotation: default, linear, llama3, yarn (attention scaling already inside the stored key).
Anything else is refused with ``UnsupportedModelError`` naming the reason, never run silently wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# rotation depends on position only -> exact re-rotation; the others depend on sequence length
# (dynamic NTK, longrope's short/long switch) or are not rotations of the full key we can shift.
SHIFTABLE_ROPE = {"default", "linear", "llama3", "yarn"}


class UnsupportedModelError(ValueError):
    """The model cannot be blended exactly (architecture, positional scheme or attention pattern)."""


@dataclass
class ModelAdapter:
    model: torch.nn.Module
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_type: str
    inv_freq: torch.Tensor  # [head_dim // 2] fp32, exactly the buffer the model rotates with
    sliding_window: int | None

    @property
    def body(self):
        return self.model.model

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return self.model.device

    @classmethod
    def of(cls, model) -> ModelAdapter:
        cached = getattr(model, "_ragkv_adapter", None)
        if cached is not None:
            return cached
        adapter = cls._build(model)
        model._ragkv_adapter = adapter
        return adapter

    @classmethod
    def _build(cls, model) -> ModelAdapter:
        name = type(model).__name__
        cfg = model.config
        body = getattr(model, "model", None)
        missing = [a for a in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(body, a)]
        if body is None or missing or not hasattr(model, "lm_head"):
            raise UnsupportedModelError(
                f"{name}: ragkv blends decoder-only models with the Llama-family layout "
                f"(model.model.embed_tokens/layers/norm/rotary_emb + lm_head); missing {missing or ['model']}"
            )
        if getattr(cfg, "is_encoder_decoder", False):
            raise UnsupportedModelError(f"{name}: encoder-decoder models are not supported")
        for attr, why in (
            ("kv_lora_rank", "multi-head latent attention (MLA) caches a compressed latent, not per-head K/V"),
            ("alibi", "ALiBi biases attention by distance and has no rotation to re-apply"),
            ("position_embedding_type", "absolute/learned position embeddings cannot be re-positioned"),
        ):
            val = getattr(cfg, attr, None)
            if val not in (None, False, "rope"):
                raise UnsupportedModelError(f"{name}: {why} ({attr}={val!r})")
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        if rope and all(isinstance(v, dict) for v in rope.values()):
            raise UnsupportedModelError(f"{name}: per-layer-type RoPE ({sorted(rope)}) is not supported")
        rope_type = rope.get("rope_type", "default")
        if rope_type not in SHIFTABLE_ROPE:
            raise UnsupportedModelError(
                f"{name}: rope_type {rope_type!r} depends on sequence length, so cached keys cannot be "
                f"re-rotated exactly; supported: {sorted(SHIFTABLE_ROPE)}"
            )
        if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
            raise UnsupportedModelError(f"{name}: partial rotary embeddings are not supported yet")
        num_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        inv_freq = body.rotary_emb.inv_freq.detach().float()
        if inv_freq.numel() * 2 != head_dim:
            raise UnsupportedModelError(f"{name}: rotary dim {inv_freq.numel() * 2} != head_dim {head_dim}")
        layer_types = getattr(cfg, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            raise UnsupportedModelError(
                f"{name}: layer types {sorted(set(layer_types))}: only full-attention layers are supported"
            )
        window = getattr(cfg, "sliding_window", None)
        if getattr(cfg, "use_sliding_window", True) is False:
            window = None
        return cls(
            model=model,
            num_layers=cfg.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rope_type=rope_type,
            inv_freq=inv_freq,
            sliding_window=window,
        )

    def check_length(self, total_tokens: int) -> None:
        """Refuse prompts whose attention a sliding window would cut: fused K/V assume full attention."""
        if self.sliding_window is not None and total_tokens > self.sliding_window:
            raise UnsupportedModelError(
                f"prompt of {total_tokens} tokens exceeds the model's sliding window ({self.sliding_window}); "
                "blending assumes every token sees the whole context"
            )
        limit = getattr(self.model.config, "max_position_embeddings", None)
        if limit is not None and total_tokens > limit:
            raise ValueError(f"prompt of {total_tokens} tokens exceeds the model's context ({limit} tokens)")
