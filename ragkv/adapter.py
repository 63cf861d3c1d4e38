"""The one seam between ragkv and transformers: what the engine needs from an HF model, found by
structure, with every capability it relies on checked up front.

Every use of transformers internals goes through this module, so a transformers upgrade touches one
file: the model layout (``model.model.{embed_tokens, layers, norm, rotary_emb}`` + ``lm_head``),
direct decoder-layer calls, the cache duck type those layers write into, the name of the forward's
cache argument (``cache=`` from 5.24, ``past_key_values=`` before), attention routing,
``DynamicCache`` internals for the handoff, and ``generate``.

Relied on, and refused with ``UnsupportedModelError`` naming the reason otherwise:
  - the Llama-family layout above (Llama, Mistral, Qwen2, Qwen3, Phi-3-style models with RoPE);
  - decoder layers that call ``cache.update(k, v, layer_idx, ...)`` and use the 4-D additive mask they get;
  - a RoPE whose rotation depends on position only, so a cached key moves to a new position by a pure
    rotation: default, linear, llama3, yarn (attention scaling already inside the stored key).

Attention routing never writes into transformers' own registry entries: ragkv's attention function
is registered under its own name (``ragkv+<impl>``) and the model's config points at it only for
the duration of one ragkv layer call (``run_layer(..., attention=fn)``); calls that do not carry
ragkv's keyword arguments fall through to the implementation registered under ``<impl>`` *now*,
so a user's later ``AttentionInterface.register("sdpa", f)`` is honoured.
"""

from __future__ import annotations

import inspect
import sys
import threading
import weakref
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

# rotation depends on position only -> exact re-rotation; the others depend on sequence length
# (dynamic NTK, longrope's short/long switch) or are not rotations of the full key we can shift.
SHIFTABLE_ROPE = {"default", "linear", "llama3", "yarn"}
IS_CAUSAL_IMPLS = ("sdpa", "flash_attention_2", "flash_attention_3")


class UnsupportedModelError(ValueError):
    """The model cannot be blended exactly (architecture, positional scheme or attention pattern)."""


class _CacheShim:
    """The cache duck type transformers' attention modules call (``update(k, v, layer_idx, ...)``),
    forwarding to ragkv's side of it with the positions of the rows being computed:
    ``target.update(layer_idx, k, v, positions) -> (K, V)`` to attend over."""

    def __init__(self, target, positions: torch.Tensor):
        self.target, self.positions = target, positions

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self.target.update(layer_idx, key_states, value_states, self.positions)


class _KVCapture:
    """A cache that keeps the K/V a layer hands it and gives them back to attend over."""

    kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.kv = (key_states, value_states)
        return self.kv


def _skip_attention(module, query, key, value, attention_mask, **kwargs):
    """An attention of the HF signature that attends to nothing: its output (the queries, [1, n, Hq, D])
    only has the shape the output projection expects; ``layer_kv`` discards it."""
    return query.transpose(1, 2), None


_routers: set[str] = set()
_routers_lock = threading.Lock()
_adapters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its ModelAdapter
_adapters_lock = threading.Lock()


def _register_router(impl: str) -> str:
    """Register (once) the attention function ``ragkv+<impl>`` and its mask function; return its name."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    name = f"ragkv+{impl}"
    with _routers_lock:
        if name in _routers:
            return name

        def router(module, query, key, value, attention_mask, **kwargs):
            fn = kwargs.pop("ragkv_attention", None)
            if fn is not None:
                return fn(module, query, key, value, attention_mask, **kwargs)
            # looked up now, so user overrides win; eager lives in the model's own file
            own = ALL_ATTENTION_FUNCTIONS.get_interface(impl, None) if impl != "eager" else None
            if own is None:
                own = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
            if own is None:
                raise RuntimeError(f"attention implementation {impl!r} is not registered")
            return own(module, query, key, value, attention_mask, **kwargs)

        AttentionInterface.register(name, router)
        if impl in ALL_MASK_ATTENTION_FUNCTIONS:  # a concurrent model call builds its mask under this name
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[impl])
        _routers.add(name)
    return name


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
    cache_kw: str = "cache"  # the forward/generate argument that takes a Cache
    # one request per model at a time: the blend points the model's attention at ragkv's router for
    # the duration of a layer call (``_routed``); every user of a model's engine holds this
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def attn_implementation(self) -> str:
        return getattr(self.model.config, "_attn_implementation", None) or "eager"

    @property
    def max_positions(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    # ------------------------------------------------------------------ construction

    @classmethod
    def of(cls, model) -> ModelAdapter:
        """The adapter of ``model``, one per model object (every engine over it shares its lock). A
        model that is not a transformers model brings its own implementation of this class's interface
        (the attributes above, ``lock``, ``embed``, ``rope``, ``run_layer``, ``layer_kv``, ``logits``,
        ``check_length``, ``prefill_layers``, ``cache_from``) from a ``ragkv_layers()`` method:
        ragkv.integrations.vllm's blend-aware model classes do, over vLLM's own modules."""
        with _adapters_lock:
            adapter = _adapters.get(model)
            if adapter is None:
                own = getattr(model, "ragkv_layers", None)
                adapter = _adapters[model] = own() if callable(own) else cls._build(model)
        return adapter

    @classmethod
    def _build(cls, model) -> ModelAdapter:
        name = type(model).__name__
        cfg = model.config
        body = getattr(model, "model", None)
        missing = [a for a in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(body, a)]
        if body is not None and not missing:
            missing = [f"layers[0].{a}" for a in ("input_layernorm", "self_attn") if not hasattr(body.layers[0], a)]
        if body is None or missing or not hasattr(model, "lm_head"):
            raise UnsupportedModelError(
                f"{name}: ragkv blends decoder-only models with the Llama-family layout (model.model."
                f"embed_tokens/layers[i].input_layernorm+self_attn/norm/rotary_emb + lm_head); missing "
                f"{missing or ['model']}"
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
        params = inspect.signature(body.layers[0].forward).parameters
        return cls(
            model=model,
            num_layers=cfg.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rope_type=rope_type,
            inv_freq=inv_freq,
            sliding_window=window,
            cache_kw="cache" if "cache" in params else "past_key_values",
        )

    def check_length(self, total_tokens: int) -> None:
        """Refuse prompts longer than the model's context, or than a sliding window would let every
        token see (fused K/V assume full attention)."""
        if self.sliding_window is not None and total_tokens > self.sliding_window:
            raise UnsupportedModelError(
                f"prompt of {total_tokens} tokens exceeds the model's sliding window ({self.sliding_window}); "
                "blending assumes every token sees the whole context"
            )
        from ragkv.prompt import check_window

        check_window(total_tokens, self.max_positions, "the prompt")

    # ------------------------------------------------------------------ the blend's layer calls

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[1, n] token ids -> [1, n, hidden]."""
        return self.model.model.embed_tokens(input_ids)

    def run_layer(self, li: int, hidden: torch.Tensor, positions: torch.Tensor, cache,
                  attention_mask: torch.Tensor | None = None, attention: Callable | None = None,
                  position_embeddings: tuple | None = None, **attention_kwargs) -> torch.Tensor:
        """Decoder layer ``li`` on ``hidden`` [1, n, hidden] at absolute ``positions`` [n]. ``cache``
        is ragkv's side of the cache contract: ``cache.update(li, k, v, positions)`` receives the fresh
        K/V of the n rows and returns the K/V to attend over. ``attention``: an HF-signature attention
        function used for this call only (with ``attention_kwargs`` passed to it); None = the model's
        own, with ``attention_mask`` (None = causal over the n rows, the implementation's is_causal
        path). ``position_embeddings``: ``rope(positions, hidden.dtype)`` when the caller has it."""
        if position_embeddings is None:
            position_embeddings = self.rope(positions, hidden.dtype)
        kwargs = {self.cache_kw: _CacheShim(cache, positions), "use_cache": True, **attention_kwargs}
        with self._routed(attention, kwargs):
            return self.model.model.layers[li](hidden, attention_mask=attention_mask, position_ids=positions[None],
                                               position_embeddings=position_embeddings, **kwargs)

    def layer_kv(self, li: int, hidden: torch.Tensor, positions: torch.Tensor,
                 position_embeddings: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Only the K/V [1, kv_heads, n, head_dim] (keys rotated) that decoder layer ``li`` computes for
        ``hidden`` [1, n, hidden] at ``positions`` [n]: the layer's own input norm and attention module,
        whose attention is skipped (its output projection runs on a stand-in and is discarded), and no
        MLP. A caller that needs every row's K/V of a layer but that layer's output for only some rows
        runs this over all of them, then ``run_layer`` over the rows it keeps."""
        layer = self.model.model.layers[li]
        if position_embeddings is None:
            position_embeddings = self.rope(positions, hidden.dtype)
        capture = _KVCapture()
        kwargs = {self.cache_kw: capture, "use_cache": True}
        with self._routed(_skip_attention, kwargs):
            layer.self_attn(hidden_states=layer.input_layernorm(hidden), attention_mask=None,
                            position_ids=positions[None], position_embeddings=position_embeddings, **kwargs)
        if capture.kv is None:
            raise UnsupportedModelError(f"the attention of layer {li} of {type(self.model).__name__} wrote no K/V "
                                        "to the cache it was given")
        return capture.kv

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's rotary (cos, sin) [1, n, head_dim] at ``positions`` [n], as its layers take them."""
        # (the rotary module reads only its input's dtype and device: a [1, n, 0] stand-in for the hidden states)
        x = torch.empty(1, positions.numel(), 0, dtype=dtype, device=positions.device)
        return self.model.model.rotary_emb(x, positions[None])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits [vocab] fp32 of the last row of ``hidden`` [1, n, hidden]."""
        return self.model.lm_head(self.model.model.norm(hidden[:, -1:]))[0, -1].float()

    @contextmanager
    def _routed(self, fn: Callable | None, kwargs: dict):
        """Point the model's attention at ragkv's router (``ragkv+<impl>``) for one call; the router
        hands calls carrying ``ragkv_attention=fn`` to fn and every other call to ``<impl>``."""
        if fn is None:
            yield
            return
        cfg, impl = self.model.config, self.attn_implementation
        kwargs["ragkv_attention"] = fn
        cfg._attn_implementation = _register_router(impl)
        try:
            yield
        finally:
            cfg._attn_implementation = impl

    # ------------------------------------------------------------------ whole-model calls

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def forward(self, input_ids: torch.Tensor, cache=None, position_ids: torch.Tensor | None = None,
                logits_to_keep: int = 0):
        """The model's own forward -> (logits [B, n or logits_to_keep, vocab], cache)."""
        out = self.model(input_ids, position_ids=position_ids, logits_to_keep=logits_to_keep, use_cache=True,
                         **{self.cache_kw: cache if cache is not None else self.new_cache()})
        return out.logits, getattr(out, "cache", None) or out.past_key_values

    def prefill_layers(self, input_ids: torch.Tensor, position_ids: torch.Tensor):
        """The body's forward over a batch; -> the per-layer (K, V) [B, kv_heads, n, head_dim] it cached."""
        cache = self.new_cache()
        self.model.model(input_ids=input_ids, position_ids=position_ids, use_cache=True, **{self.cache_kw: cache})
        return [(layer.keys, layer.values) for layer in cache.layers]

    def cache_from(self, keys: list[torch.Tensor], values: list[torch.Tensor]):
        """A DynamicCache whose layers hold these [1, kv_heads, n, head_dim] tensors as they are (views,
        no copy): generation's first update concatenates onto them as usual."""
        dc = self.new_cache()
        for layer, k, v in zip(dc.layers, keys, values):
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
        return dc

    @staticmethod
    def truncate(cache, length: int) -> None:
        """Drop every position of a DynamicCache from ``length`` on (e.g. what generate appended)."""
        extra = cache.get_seq_length() - length
        if extra > 0:
            cache.crop(-extra)

    def generate(self, input_ids: torch.Tensor, cache=None, tokenizer=None, **kwargs) -> torch.Tensor:
        """``model.generate`` continuing ``cache`` (the prompt minus its last token) -> new token ids.
        Greedy unless the caller asks to sample; ``ragkv.decode.generation_kwargs`` says what changes."""
        from ragkv.decode import generation_kwargs

        kwargs = generation_kwargs(self.model, tokenizer, **kwargs)
        if cache is not None:
            kwargs[self.cache_kw] = cache
        out = self.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
        return out[0, input_ids.shape[1]:]
