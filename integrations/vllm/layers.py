"""ragkv's model interface (the one ``ragkv.adapter.ModelAdapter`` offers for transformers models)
over vLLM's own model: the blend's layer calls run the parts of vLLM's decoder layers with vLLM's
weights and CPU kernels, in the process that runs the model. No second copy of the model.

    embed       model.embed_input_ids
    per layer   input_layernorm (fused add + RMSNorm), self_attn.qkv_proj, self_attn.rotary_emb (in
                place), [attention], self_attn.o_proj, post_attention_layernorm, mlp
    logits      model.model.norm (fused add), model.compute_logits

Only the attention differs from vLLM's forward, and only because it must: the recomputed rows are a
sparse subset of the prompt and attend to the fused K/V causally by ORIGINAL position (row i sees
keys at positions <= its own, ragkv.blend.attention); vLLM's kernels align the causal mask to the
bottom right of the query block, which lets an early recomputed row see later keys. Layers where
every position is active run a plain causal attention (torch SDPA, is_causal).

Hidden state. vLLM carries (hidden, residual) between layers and adds them inside the next layer's
fused add + RMSNorm; this adapter's hidden state is that pair stacked, ``[2, n, hidden_size]``
(``[0]``: the layer's output not yet added, ``[1]``: the residual stream), rows on dim 1 like HF's
``[1, n, hidden_size]``, so ragkv's request code narrows it the same way. ``embed`` starts the
residual at zeros: the first layer's fused add then gives exactly vLLM's ``residual = hidden``.

Relied on (vLLM 0.32, ``vllm/model_executor/models/llama.py``, ``qwen2.py``, ``mistral.py``), and
refused with ``UnsupportedModelError`` naming the vLLM version and what differs otherwise: the
decoder layer and attention ``forward`` of Llama, Qwen2 or Mistral exactly (this module repeats
their composition around its own attention), no QK norm, Llama-4 attention scaling, adaptive RMSNorm
or dual-chunk attention, a neox-style rotary of the full head dim whose frequencies are vLLM's
``RotaryEmbedding`` / ``Llama3RotaryEmbedding`` ones (checked against its cos/sin cache), full
attention (no sliding window, soft-cap or ALiBi), one tensor- and pipeline-parallel rank.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ragkv.adapter import UnsupportedModelError
from ragkv.prompt import check_window

TESTED_VLLM = ("0.32.",)  # the vLLM releases whose model code this module repeats


@dataclass(frozen=True)
class _Layer:  # what an HF attention function may read from the module it is given
    layer_idx: int


def _known_forwards() -> dict:
    """{vLLM class: the forward this module repeats} for the supported model families."""
    from vllm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer
    from vllm.model_executor.models.mistral import MistralAttention, MistralDecoderLayer
    from vllm.model_executor.models.qwen2 import Qwen2Attention, Qwen2DecoderLayer

    return {cls: cls.forward for cls in (LlamaDecoderLayer, LlamaAttention, Qwen2DecoderLayer, Qwen2Attention,
                                          MistralDecoderLayer, MistralAttention)}


def _refuse(model, what: str) -> UnsupportedModelError:
    import vllm

    return UnsupportedModelError(f"ragkv's native blend cannot run {type(model).__name__} on vLLM {vllm.__version__}: "
                                 f"{what}")


def _missing(obj, names: tuple[str, ...]) -> list[str]:
    return [n for n in names if not hasattr(obj, n)]


def check_vllm_version() -> None:
    """Raise UnsupportedModelError unless this vLLM is one whose model code this module was written
    against (``TESTED_VLLM``)."""
    import vllm

    if not vllm.__version__.startswith(TESTED_VLLM):
        raise UnsupportedModelError(
            f"ragkv's native blend repeats the decoder-layer code of vLLM {', '.join(v + 'x' for v in TESTED_VLLM)}; "
            f"this is vLLM {vllm.__version__}, whose layers it has not been checked against")


class VllmLayers:
    """ragkv's model interface over a vLLM Llama/Qwen2/Mistral model (see the module docstring)."""

    attn_implementation = "sdpa"  # mask None over every position = causal (the core's is_causal path)

    def __init__(self, model: torch.nn.Module):
        check_vllm_version()
        self.model = model
        body = getattr(model, "model", None)
        missing = _missing(model, ("model", "compute_logits", "embed_input_ids"))
        missing += _missing(body, ("layers", "norm", "start_layer", "end_layer")) if body is not None else []
        if missing:
            raise _refuse(model, f"missing {missing}")
        self.layers = list(body.layers)
        cfg = model.config
        if (body.start_layer, body.end_layer) != (0, len(self.layers)):
            raise _refuse(model, f"pipeline parallel (layers {body.start_layer}..{body.end_layer} of "
                                 f"{len(self.layers)} here): one rank must hold every layer")
        known = _known_forwards()
        for li, layer in enumerate(self.layers):
            self._check_layer(li, layer, known)
        attn = self.layers[0].self_attn
        self.num_layers = len(self.layers)
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        if (self.num_heads, self.num_kv_heads) != (cfg.num_attention_heads, kv_heads):
            raise _refuse(model, f"{self.num_heads} query / {self.num_kv_heads} kv heads on this rank of "
                                 f"{cfg.num_attention_heads} / {kv_heads}: tensor parallel")
        self.scaling = float(attn.scaling)
        self.dtype, self.device = body.norm.weight.dtype, body.norm.weight.device
        self.inv_freq = self._inv_freq(attn.rotary_emb)
        self.max_positions = getattr(cfg, "max_position_embeddings", None)
        self.lock = threading.RLock()  # one request per model at a time (BlendEngine.exclusive)

    def _check_layer(self, li: int, layer, known: dict) -> None:
        model = self.model
        missing = _missing(layer, ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp"))
        attn = getattr(layer, "self_attn", None)
        missing += _missing(attn, ("qkv_proj", "o_proj", "rotary_emb", "attn", "q_size", "kv_size", "num_heads",
                                   "num_kv_heads", "head_dim", "scaling")) if attn is not None else []
        if missing:
            raise _refuse(model, f"layer {li} lacks {missing}")
        for obj in (layer, attn):
            if known.get(type(obj)) is not type(obj).forward:
                raise _refuse(model, f"layer {li}'s {type(obj).__name__}.forward is not one ragkv repeats "
                                     f"({', '.join(sorted(c.__name__ for c in known))})")
        for owner, flag in ((attn, "qk_norm"), (attn, "do_llama_4_scaling"), (attn, "dual_chunk_attention_config"),
                            (layer, "ada_rms_norm_t_cond")):
            if getattr(owner, flag, None):
                raise _refuse(model, f"layer {li} uses {flag}")
        impl = getattr(attn.attn, "impl", None)
        window = getattr(impl, "sliding_window", None)
        if window not in (None, -1) or getattr(attn.attn, "sliding_window", None) is not None:
            raise _refuse(model, f"layer {li} has a sliding window ({window}): ragkv blends full-attention layers")
        if getattr(impl, "logits_soft_cap", 0) or getattr(impl, "alibi_slopes", None) is not None:
            raise _refuse(model, f"layer {li} caps or biases its attention logits")
        rot = attn.rotary_emb
        if not getattr(rot, "is_neox_style", False) or getattr(rot, "rotary_dim", None) != attn.head_dim:
            raise _refuse(model, f"layer {li}'s rotary embedding is not neox-style over the full head dim "
                                 f"(is_neox_style={getattr(rot, 'is_neox_style', None)}, "
                                 f"rotary_dim={getattr(rot, 'rotary_dim', None)}, head_dim={attn.head_dim})")

    def _inv_freq(self, rot) -> torch.Tensor:
        """The rotary frequencies [head_dim // 2] fp32 vLLM rotates with, for re-rotating stored keys:
        only rotaries whose rotation depends on position alone (default, llama3), checked against
        vLLM's own cos/sin cache."""
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
        from vllm.model_executor.layers.rotary_embedding.llama3_rope import Llama3RotaryEmbedding

        if type(rot) not in (RotaryEmbedding, Llama3RotaryEmbedding):
            raise _refuse(self.model, f"rotary {type(rot).__name__}: ragkv re-rotates stored keys exactly for "
                                      "RotaryEmbedding and Llama3RotaryEmbedding only")
        inv = rot._compute_inv_freq(rot.base).float().cpu()
        cache = rot.cos_sin_cache.cpu()  # [max positions, rotary_dim]: cos | sin, in the model's dtype
        pos = torch.tensor([1.0, 17.0, float(cache.shape[0] - 1)])
        want = torch.cat([torch.cos(pos[:, None] * inv), torch.sin(pos[:, None] * inv)], dim=-1)
        # vLLM rounds its fp32 cache to the model's dtype: compare at that precision (one bf16 step
        # is 0.008; a scaled rotary differs by whole radians at the last position)
        tol = max(1e-3, torch.finfo(cache.dtype).eps)
        if not torch.allclose(want, cache[pos.long()].float(), atol=tol):
            raise _refuse(self.model, "its rotary cos/sin cache is not cos/sin of position x the frequencies "
                                      "ragkv computed (a scaled or otherwise changed rotary)")
        return inv.to(self.device)

    # ------------------------------------------------------------------ the blend's layer calls

    def check_length(self, total_tokens: int) -> None:
        check_window(total_tokens, self.max_positions, "the prompt")

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[1, n] token ids -> the pair [2, n, hidden] (embeddings, a zero residual)."""
        h = self.model.embed_input_ids(input_ids[0])
        return torch.stack([h, torch.zeros_like(h)])

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """What ``run_layer`` takes as ``position_embeddings``: vLLM's rotary op reads the positions
        themselves (and its own cos/sin cache)."""
        return positions

    def run_layer(self, li: int, hidden: torch.Tensor, positions: torch.Tensor, cache,
                  attention_mask: torch.Tensor | None = None, attention=None, position_embeddings=None,
                  **attention_kwargs) -> torch.Tensor:
        """Decoder layer ``li`` on the pair ``hidden`` [2, n, hidden] at absolute ``positions`` [n]
        (consumed: vLLM's norms may work in place). ``cache.update(li, k, v, positions)`` receives the
        rows' fresh K/V [1, kv_heads, n, head_dim] and returns the K/V [1, kv_heads, T, head_dim] to
        attend over.
        ``attention``: an HF-signature attention function (ragkv.blend.attention) called with
        ``attention_kwargs``; None: SDPA with ``attention_mask`` (additive [1, 1, n, T]), or causal
        over the n rows when that is None (then T must be n)."""
        layer = self.layers[li]
        x, residual = layer.input_layernorm(hidden[0], hidden[1])
        q, k, v = self._qkv(layer.self_attn, x, positions)
        keys, values = cache.update(li, k, v, positions)
        out = self._attend(li, q, keys, values, attention_mask, attention, attention_kwargs)
        x, _ = layer.self_attn.o_proj(out)
        x, residual = layer.post_attention_layernorm(x, residual)
        return torch.stack([layer.mlp(x), residual])

    def layer_kv(self, li: int, hidden: torch.Tensor, positions: torch.Tensor,
                 position_embeddings=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Only layer ``li``'s K/V [1, kv_heads, n, head_dim] of the rows of ``hidden`` (left
        unchanged), as ``run_layer`` computes them; no attention, projection or MLP."""
        x, _ = self.layers[li].input_layernorm(hidden[0].clone(), hidden[1].clone())
        _, k, v = self._qkv(self.layers[li].self_attn, x, positions)
        return k, v

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits [vocab] fp32 of the last row of the pair ``hidden``."""
        x, _ = self.model.model.norm(hidden[0, -1:].clone(), hidden[1, -1:].clone())
        return self.model.compute_logits(x)[0].float()

    def _qkv(self, attn, x: torch.Tensor, positions: torch.Tensor):
        """-> q [n, Hq * D] (rotated), k, v [1, Hkv, n, D] (k rotated), as vLLM's attention gets them."""
        n = x.shape[0]
        qkv, _ = attn.qkv_proj(x)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q, k = attn.rotary_emb(positions, q, k)
        heads = (n, self.num_kv_heads, self.head_dim)
        return q, k.view(heads).transpose(0, 1)[None], v.view(heads).transpose(0, 1)[None]

    def _attend(self, li: int, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                mask: torch.Tensor | None, attention, kwargs: dict) -> torch.Tensor:
        """q [n, Hq * D] over keys/values [1, Hkv, T, D] -> [n, Hq * D]."""
        n = q.shape[0]
        q4 = q.view(n, self.num_heads, self.head_dim).transpose(0, 1)[None]  # [1, Hq, n, D]
        if attention is not None:
            out, _ = attention(_Layer(li), q4, keys, values, mask, scaling=self.scaling, **kwargs)  # [1, n, Hq, D]
            return out.reshape(n, self.num_heads * self.head_dim)
        if mask is None and keys.shape[2] != n:
            raise ValueError(f"causal attention without a mask needs every position: {n} rows over "
                             f"{keys.shape[2]} keys")
        out = F.scaled_dot_product_attention(q4, keys, values, attn_mask=mask, is_causal=mask is None,
                                             scale=self.scaling, enable_gqa=True)  # [1, Hq, n, D]
        return out[0].transpose(0, 1).reshape(n, self.num_heads * self.head_dim)

    # ------------------------------------------------------------------ the write path and the handoff

    def prefill_layers(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> list:
        """Causal prefill of each row of ``input_ids`` [B, W] at ``position_ids`` [B, W] (one row at a
        time) -> per layer (K, V) [B, kv_heads, W, head_dim]: what ragkv stores for a chunk."""
        rows = [self._prefill_row(ids, pos) for ids, pos in zip(input_ids, position_ids)]
        return [(torch.cat([r[li][0] for r in rows]), torch.cat([r[li][1] for r in rows]))
                for li in range(self.num_layers)]

    def _prefill_row(self, ids: torch.Tensor, pos: torch.Tensor) -> list:
        kv = _Written(self.num_layers)
        hidden = self.embed(ids[None])
        for li in range(self.num_layers - 1):
            hidden = self.run_layer(li, hidden, pos, kv)
        kv.layers[-1] = self.layer_kv(self.num_layers - 1, hidden, pos)  # the last layer's output is not needed
        return kv.layers

    def cache_from(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> list:
        """The blend's handoff: per layer (K, V) [1, kv_heads, length, head_dim] (views, no copy),
        which the connector writes into vLLM's paged cache."""
        return list(zip(keys, values))


class _Written:
    """The cache contract for a plain prefill: each layer attends over its own fresh K/V, kept."""

    def __init__(self, num_layers: int):
        self.layers: list = [None] * num_layers

    def update(self, li: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        self.layers[li] = (k, v)
        return k, v
