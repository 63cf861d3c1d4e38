"""Attention of the recomputed tokens: causal by ORIGINAL position, and how it is routed into the model.

The recomputed rows of a layer are a sparse subset of the prompt (selected chunk tokens + the
suffix). Each must see exactly the keys at positions <= its own, wherever it sits in the active
block; a mask aligned to the bottom right of the active block (what the public implementations do)
lets early recomputed tokens see later keys.

Three ways a layer is run (``layer_call``):
  whole prompt   every position is active (sdpa/flash): a plain causal prefill on the model's own
                 kernel (is_causal path, no mask at all)
  by position    ``position_attention`` (ops.blend_attention: Triton on CUDA, blocked SDPA on CPU that
                 skips masked key blocks) through the seam's per-call routing (ragkv.adapter)
  eager models   the model's own eager attention with an explicit 4-D mask built from positions
                 (``causal_mask_by_position``), since each model file has its own eager function
"""

from __future__ import annotations

import torch

from ragkv.adapter import IS_CAUSAL_IMPLS
from ragkv.kernels import dispatch as ops


def position_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                       ragkv_q_pos=None, ragkv_plan=None, **kwargs):
    """HF attention-function signature; query [1, Hq, n, D], key/value [1, Hkv, T, D] -> ([1, n, Hq, D], None):
    row i attends to keys at positions <= ragkv_q_pos[i] (the fused K/V holds position j at row j).
    ragkv_plan: ``ops.blend_attention_plan`` for these rows (built once per active set, not per layer)."""
    out = ops.blend_attention(query[0], key[0], value[0], ragkv_q_pos, sm_scale=scaling, plan=ragkv_plan)  # [Hq, n, D]
    return out.transpose(0, 1).unsqueeze(0), None


def probe_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                    ragkv_q_pos=None, ragkv_capture=None, **kwargs):
    """The probe's attention: a few rows (the suffix) over the whole fused K/V with the probabilities
    made explicit, handed to ``ragkv_capture(layer, probs [Hq, n, T] fp32)`` before they weight the
    values. Causal by position like ``position_attention``; cheap because n is small."""
    q, k, v = query[0], key[0], value[0]  # [Hq, n, D], [Hkv, T, D]
    hq, n, d = q.shape
    hkv, t = k.shape[0], k.shape[1]
    g = hq // hkv
    scale = d**-0.5 if scaling is None else scaling
    # products in the model's dtype (bf16 runs on the CPU's bf16 units, fp32 accumulation), softmax in
    # fp32; the scale goes on the n queries, not on the n x T logits (exact for a power of two: d = 64)
    logits = torch.bmm((q * scale).reshape(hkv, g * n, d), k.transpose(1, 2)).float()  # [Hkv, g*n, T]
    lo = int(ragkv_q_pos.min()) + 1  # keys before it are seen by every row: only the rest is masked
    if lo < t:
        hidden = torch.arange(lo, t, device=q.device)[None, :] > ragkv_q_pos.repeat(g)[:, None]
        logits[..., lo:].masked_fill_(hidden, float("-inf"))
    probs = logits.softmax(-1)
    ragkv_capture(module.layer_idx, probs.view(hq, n, t))
    out = torch.bmm(probs.to(v.dtype), v).view(hq, n, d)
    return out.transpose(0, 1).unsqueeze(0), None


def causal_mask_by_position(q_pos: torch.Tensor, total: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, n, total] additive mask: query at position q_pos[i] sees keys at positions <= q_pos[i]."""
    k_pos = torch.arange(total, device=q_pos.device)
    allowed = k_pos[None, :] <= q_pos[:, None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=q_pos.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


class LayerCalls:
    """The arguments of ``ModelAdapter.run_layer`` for one request, per active set: the eager mask or
    the position attention's plan, and the rotary embeddings of the active rows, built once per active
    set, not once per layer."""

    def __init__(self, adapter, total: int):
        self.adapter, self.total = adapter, total
        self.dtype = adapter.dtype
        self.eager = adapter.attn_implementation == "eager"
        self.is_causal = adapter.attn_implementation in IS_CAUSAL_IMPLS  # takes mask None as causal
        self._for: torch.Tensor | None = None  # the active set the kwargs below were built for
        self._kwargs: dict = {}
        self._rope: tuple[torch.Tensor | None, tuple | None] = (None, None)  # (active set, its cos/sin)

    def rope(self, active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's rotary (cos, sin) at the positions ``active`` (what its layers are handed)."""
        if self._rope[0] is not active:
            self._rope = (active, self.adapter.rope(active, self.dtype))
        return self._rope[1]

    def __call__(self, active: torch.Tensor, capture=None) -> dict:
        rope = {"position_embeddings": self.rope(active)}
        if capture is not None:  # a probe: ragkv's attention under every implementation (eager included)
            return {"attention": probe_attention, "ragkv_q_pos": active, "ragkv_capture": capture, **rope}
        if self.is_causal and active.numel() == self.total:  # every position: a plain causal prefill
            return rope
        if self._for is not active:
            a = self.adapter
            if self.eager:
                self._kwargs = {"attention_mask": causal_mask_by_position(active, self.total, self.dtype)}
            else:
                plan = ops.blend_attention_plan(active, self.total, a.num_heads // a.num_kv_heads, self.dtype)
                self._kwargs = {"attention": position_attention, "ragkv_q_pos": active, "ragkv_plan": plan}
            self._for = active
        return {**self._kwargs, **rope}
