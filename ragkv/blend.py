"""The read path: fuse stored chunk K/V at new positions and recompute the tokens that matter (CacheBlend).

    prompt = prefix | chunk_1 .. chunk_n | suffix            (ragkv.prompt)
    1. look up the prefix and every chunk by content key; prefill and write back what is missing
    2. per layer, load each stored entry's K/V, re-rotate keys from their stored positions to their
       positions in this prompt (ops.rope_shift, fused with dequantization), concatenate  -> fused K/V
    3. run the model's own decoder layers over an *active* token set:
         layers <= last check layer: every chunk token + the suffix (a true prefill for those layers)
         at each check layer: score each chunk token by the deviation of its fresh K/V from the
             fused (cached) K/V and keep the top fraction (gradual filtering narrows over the check
             layers to `ratio`)
         later layers: only the kept tokens + the suffix
       the active tokens' fresh K/V are scattered over the fused K/V (ops.scatter_rows), and every
       query attends through a 4-D mask built from *original positions* (key j visible to query i iff
       pos[j] <= pos[i]), not a mask aligned to the bottom right of the active block
    4. logits of the last prompt token; a DynamicCache of the prompt minus its last token, which
       ``model.generate`` continues (it needs one uncached prompt token and mutates the cache)

ratio = 0 is naive reuse (no recompute but the suffix); ratio = 1 recomputes every chunk token in
every layer and equals full prefill. The prefix is cached as a true prefix (positions 0..P-1), so
its K/V are exact and it is never recomputed.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ragkv.adapter import ModelAdapter
from ragkv.kernels import dispatch as ops
from ragkv.keys import chunk_key
from ragkv.loader import make_loader
from ragkv.models import fingerprint
from ragkv.policy import PREFIX_POLICY, PrecomputePolicy, prefill_kv
from ragkv.prompt import Prompt, PromptTemplate
from ragkv.store.entry import EntryMeta, StoredLayer
from ragkv.store.errors import StoreError

SIGNALS = ("k", "v", "kv")
DEFAULT_CHECK_LAYERS = (1, 3, 6)  # gradual filtering; measured in benchmarks/blend
_IS_CAUSAL_IMPLS = ("sdpa", "flash_attention_2", "flash_attention_3")


@dataclass(frozen=True)
class BlendConfig:
    """ratio: fraction of reused (chunk) tokens recomputed after the check layers, or "auto".
    check_layers: layers at which tokens are scored and filtered (every layer up to the first one is
    computed for all chunk tokens). Several check layers = gradual filtering: the kept fraction
    narrows geometrically from ``first_ratio`` (default 2 x ratio) at the first to ``ratio`` at the
    last. The default (1, 3, 6) measured best in benchmarks/blend.
    signal: which deviation selects tokens: "v" (the paper's choice), "k" or "kv"."""

    ratio: float | str = 0.15  # or "auto": the loading controller's choice (ragkv.controller)
    check_layers: tuple[int, ...] | None = None  # None: (1, 3, 6), cut to the model's depth
    first_ratio: float | None = None
    signal: str = "v"
    normalize: bool = False
    storage_dtype: str | None = None  # for chunks computed on a miss and written back; None = model dtype
    quant_axis: str | None = None
    pipelined: bool = True  # read layer i+1 from the store while layer i computes (ragkv.loader)

    def __post_init__(self):
        if self.ratio != "auto" and not (isinstance(self.ratio, (int, float)) and 0.0 <= self.ratio <= 1.0):
            raise ValueError(f"ratio must be in [0, 1] or 'auto', got {self.ratio!r}")
        if self.signal not in SIGNALS:
            raise ValueError(f"signal {self.signal!r}: valid are {SIGNALS}")
        if self.check_layers is not None and (
            not self.check_layers or list(self.check_layers) != sorted(set(self.check_layers))
        ):
            raise ValueError(f"check_layers must be strictly increasing and non-empty, got {self.check_layers}")
        if self.first_ratio is not None:
            low = 0.0 if self.ratio == "auto" else self.ratio
            if not low <= self.first_ratio <= 1.0:
                raise ValueError(f"first_ratio must lie in [ratio, 1], got {self.first_ratio}")

    def layer_ratios(self, ratio: float | None = None) -> list[float]:
        """Fraction of chunk tokens kept after each check layer (the last one is ``ratio``)."""
        ratio = self.ratio if ratio is None else ratio
        n = len(self.check_layers or DEFAULT_CHECK_LAYERS)
        if n == 1:
            return [ratio]
        first = max(ratio, self.first_ratio if self.first_ratio is not None else min(1.0, 2 * ratio))
        if ratio == 0.0:
            return [first * (1 - i / (n - 1)) for i in range(n)]
        return [first * (ratio / first) ** (i / (n - 1)) for i in range(n)]


@dataclass
class BlendStats:
    chunks: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0  # chunk tokens served from the store
    recomputed_tokens: int = 0  # chunk tokens recomputed after the last check layer
    t_lookup: float = 0.0
    t_load: float = 0.0
    t_fuse: float = 0.0
    t_compute: float = 0.0
    t_total: float = 0.0
    t_load_io: float = 0.0  # the loader's own read time (t_load: time the compute thread waited)
    ratio: float = 0.0  # the recompute ratio used (resolved when "auto")

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class BlendResult:
    input_ids: torch.Tensor  # [1, T]
    logits: torch.Tensor  # [vocab] fp32, next-token logits after the whole prompt
    cache: object  # transformers DynamicCache holding the prompt minus its last token
    stats: BlendStats
    selected: torch.Tensor | None = None  # absolute positions recomputed after the last check layer


@dataclass
class _Segment:
    """One cached piece of the prompt: the prefix or a chunk."""

    key: str
    ids: list[int]
    start: int  # position in this prompt
    stored_start: int = 0
    layers: list | None = None  # computed on this request: [(K, V)] in model dtype
    chunk: bool = True


class _FusedCache:
    """Duck-typed transformers cache for the blend's layer loop: the attention module calls
    ``update(k, v, layer_idx)``; we score deviations at check layers, scatter the fresh rows of the
    active tokens over the fused K/V and hand the whole fused K/V back for attention."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.active: torch.Tensor | None = None  # [n] absolute positions of the query rows
        self.score_rows: torch.Tensor | None = None  # rows of `active` that are candidate chunk tokens
        self.signal: str | None = None  # set at check layers
        self.normalize = False
        self.scores: torch.Tensor | None = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.keys[layer_idx][0], self.values[layer_idx][0]  # [H, T, D]
        fk, fv = key_states[0], value_states[0]  # [H, n, D]
        if self.signal is not None:
            rows, idx = self.score_rows, self.active[self.score_rows]
            use_k, use_v = "k" in self.signal, "v" in self.signal
            self.scores = ops.kv_deviation(
                fk[:, rows] if use_k else None, k[:, idx] if use_k else None,
                fv[:, rows] if use_v else None, v[:, idx] if use_v else None,
                mode=self.signal, normalize=self.normalize,
            )
        ops.scatter_rows(k, fk, self.active)
        ops.scatter_rows(v, fv, self.active)
        return self.keys[layer_idx], self.values[layer_idx]


def _position_attention(original):
    """Wrap an HF attention function: a call carrying ``ragkv_q_pos`` (the absolute positions of the
    query rows) runs ``ops.blend_attention``, causal by those positions over the whole fused K/V
    (Triton on CUDA, blocked SDPA on CPU: masked-out key blocks are skipped); any other call goes to
    the original function unchanged."""

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        q_pos = kwargs.pop("ragkv_q_pos", None)
        if q_pos is None:
            return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        out = ops.blend_attention(query[0], key[0], value[0], q_pos, sm_scale=scaling)  # [Hq, n, D]
        return out.transpose(0, 1).unsqueeze(0), None  # [1, n, Hq, D], as HF's attention functions

    attention._ragkv_original = original
    return attention


def _install_position_attention(impl: str) -> bool:
    """Route position-carrying calls of attention implementation ``impl`` through
    ``_position_attention`` (idempotent; other calls are untouched). Eager attention is left alone:
    every model file has its own eager function, so the engine gives eager models an explicit mask."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if impl == "eager" or impl not in ALL_ATTENTION_FUNCTIONS:
        return False
    current = ALL_ATTENTION_FUNCTIONS[impl]
    if getattr(current, "_ragkv_original", None) is None:
        ALL_ATTENTION_FUNCTIONS[impl] = _position_attention(current)
    return True


def _causal_mask_by_position(q_pos: torch.Tensor, total: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, n, total] additive mask: query at position q_pos[i] sees keys at positions <= q_pos[i]."""
    k_pos = torch.arange(total, device=q_pos.device)
    allowed = k_pos[None, :] <= q_pos[:, None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=q_pos.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


class BlendEngine:
    """CacheBlend over a ragkv store for one model.

    ``prefill(question, contexts)`` returns the next-token logits and a cache for ``model.generate``;
    ``generate(question, contexts, **generate_kwargs)`` runs generation on top of it.
    Missing chunks (and the prefix) are prefilled under the precompute policy and written back.
    """

    def __init__(
        self,
        model,
        tokenizer,
        store,
        config: BlendConfig | None = None,
        template: PromptTemplate | None = None,
        policy: PrecomputePolicy | None = None,
        namespace: str = "",
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.store = store
        self.config = config or BlendConfig()
        self.adapter = ModelAdapter.of(model)
        self.template = template or PromptTemplate.for_tokenizer(tokenizer)
        self.policy = (policy or PrecomputePolicy()).resolve(model)
        self.namespace = namespace
        self.fingerprint = fingerprint(model, tokenizer).digest()
        self.policy_id = self.policy.policy_id(self.template)
        self.sink_ids = self.policy.sink_ids(self.template)
        self.chunk_start = self.policy.chunk_start(self.template)  # stored start position of every chunk
        self.model_dtype = str(model.dtype).removeprefix("torch.")
        self.ratio_floor = 0.15  # the quality floor of ratio="auto"
        self._controller = None  # built on the first ratio="auto" (measures the model once)

    # ------------------------------------------------------------------ keys and write-back

    def chunk_key(self, ids: Sequence[int]) -> str:
        return chunk_key(self.fingerprint, ids, self.policy_id, self.namespace)

    def prefix_key(self, ids: Sequence[int]) -> str:
        return chunk_key(self.fingerprint, ids, PREFIX_POLICY, self.namespace)

    def entry_meta(self, key: str, ids: Sequence[int], start: int, policy: str) -> EntryMeta:
        """The metadata of an entry this engine writes (model shape, dtypes, fingerprint, policy)."""
        a = self.adapter
        storage = self.config.storage_dtype or self.model_dtype
        return EntryMeta(
            key=key, token_ids=tuple(ids), start_pos=start, num_layers=a.num_layers,
            num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, model_dtype=self.model_dtype,
            storage_dtype=storage, quant_axis=(self.config.quant_axis or "auto") if storage == "int8" else None,
            fingerprint=self.fingerprint, policy=policy,
        )

    def prefill_chunks(self, chunks: Sequence[Sequence[int]], batch_tokens: int = 4096):
        """Per chunk, per layer (K, V) of each chunk prefilled on its own under the precompute policy
        (stored start position: ``self.chunk_start``), as ``compute_and_store`` does for misses; the
        precompute job computes its batches with it, so both paths write the same K/V."""
        return prefill_kv(self.model, self.sink_ids, chunks, batch_tokens, gap=self.policy.gap)

    def compute_and_store(self, segments: Sequence[_Segment]) -> None:
        """Prefill segments on their own under the policy and write them back to the store."""
        groups = (
            ([s for s in segments if not s.chunk], [], 0, PREFIX_POLICY),  # a true prefix, at position 0
            ([s for s in segments if s.chunk], self.sink_ids, self.policy.gap, self.policy_id),
        )
        for group, sink, gap, policy in groups:
            if not group:
                continue
            kvs, start = prefill_kv(self.model, sink, [s.ids for s in group], gap=gap), len(sink) + gap
            for seg, kv in zip(group, kvs):
                seg.layers, seg.stored_start = kv, start
                try:
                    self.store.put(self.entry_meta(seg.key, seg.ids, start, policy), kv)
                except StoreError as e:  # a failed write-back (store down or full) must not fail the request
                    logging.getLogger("ragkv.blend").warning("write-back of %s failed: %s", seg.key, e)

    def ensure(self, contexts: Sequence[str]) -> tuple[list[str], int]:
        """Make sure every context's chunk K/V is in the store; return (keys, number computed)."""
        segs = []
        for text in contexts:
            ids = self.template.chunk_ids(text)
            segs.append(_Segment(self.chunk_key(ids), ids, 0))
        missing = [s for s in segs if not self.store.contains(s.key)]
        if missing:
            self.compute_and_store(missing)
        return [s.key for s in segs], len(missing)

    # ------------------------------------------------------------------ the blend

    def build_prompt(self, question: str, contexts: Sequence[str]) -> Prompt:
        if not contexts:
            raise ValueError("contexts is empty: give at least one chunk (or call the model directly)")
        return self.template.build(question, list(contexts))

    def prefill(self, question: str, contexts: Sequence[str], ratio: float | None = None) -> BlendResult:
        return self.prefill_prompt(self.build_prompt(question, contexts), ratio=ratio)

    @torch.inference_mode()
    def prefill_prompt(self, prompt: Prompt, ratio: float | None = None) -> BlendResult:
        """Blend one prompt. Its entries are pinned in the store for the whole request, so eviction
        never removes K/V a request is reading."""
        t0 = time.perf_counter()
        segments: list[_Segment] = []
        if prompt.prefix_ids:
            segments.append(_Segment(self.prefix_key(prompt.prefix_ids), prompt.prefix_ids, 0, chunk=False))
        for ids, start in zip(prompt.chunk_ids, prompt.chunk_starts()):
            segments.append(_Segment(self.chunk_key(ids), ids, start))
        with self.store.pin([s.key for s in segments]):
            return self._prefill(prompt, segments, ratio, t0)

    def _prefill(self, prompt: Prompt, segments: list[_Segment], ratio, t0: float) -> BlendResult:
        cfg = self.config
        ratio = cfg.ratio if ratio is None else ratio
        if ratio != "auto" and not (isinstance(ratio, (int, float)) and 0.0 <= ratio <= 1.0):
            raise ValueError(f"ratio must be in [0, 1] or 'auto', got {ratio!r}")
        a = self.adapter
        total = prompt.num_tokens
        a.check_length(total)
        if not prompt.suffix_ids:
            raise ValueError("the suffix (question) must have at least one token")
        stats = BlendStats(chunks=len(prompt.chunk_ids), prompt_tokens=total)

        # 1. look up every segment; compute what is missing and write it back
        missing = []
        for seg in segments:
            meta = self.store.get_meta(seg.key)
            if meta is None or not self._meta_matches(meta, seg):
                missing.append(seg)
            else:
                seg.stored_start = meta.start_pos
        stats.hits = sum(s.chunk for s in segments) - sum(s.chunk for s in missing)
        stats.misses = sum(s.chunk for s in missing)
        stats.t_lookup = time.perf_counter() - t0
        if missing:
            self.compute_and_store(missing)

        P = len(prompt.prefix_ids)
        C = sum(map(len, prompt.chunk_ids))
        if ratio == "auto":
            ratio = self.auto_ratio([s.key for s in segments if s.chunk and s.layers is None], C,
                                    len(prompt.suffix_ids), total)
        stats.ratio = ratio
        stats.reused_tokens = sum(len(s.ids) for s in segments if s.chunk and s.layers is None)
        device, dtype = a.device, a.dtype
        input_ids = torch.tensor([prompt.input_ids], device=device)
        positions = torch.arange(total, device=device)
        naive = ratio == 0.0 or C == 0
        check = [] if naive else self.check_layers
        if check and check[-1] >= a.num_layers:
            raise ValueError(f"check layer {check[-1]} >= number of layers {a.num_layers}")
        ratios = {} if naive else dict(zip(check, replace(cfg, check_layers=tuple(check)).layer_ratios(ratio)))
        first_load = 0 if naive else check[0]  # chunk K/V below the first check layer is never read

        cache = _FusedCache(a.num_layers)
        cache.normalize = cfg.normalize
        # Up to the last check layer every chunk token is computed. With an attention implementation
        # that takes is_causal (sdpa, flash), the prefix is recomputed too (its K/V are exact anyway, a
        # few % of the tokens) so the layer runs as a plain causal prefill on the fast kernel instead of
        # a T x T explicit mask; otherwise the prefix stays cached and the mask is explicit.
        impl = getattr(self.model.config, "_attn_implementation", "") or "eager"
        full_causal = not naive and impl in _IS_CAUSAL_IMPLS
        by_position = _install_position_attention(impl)  # else: explicit 4-D masks
        if naive:
            active = positions[P + C :]
        else:
            active = positions if full_causal else positions[P:]
        body = self.model.model
        hidden = body.embed_tokens(input_ids[:, active])
        selected = None
        mask = None  # rebuilt when the active set changes
        from_store = [s.key for s in segments if s.layers is None]
        loader = make_loader(cfg.pipelined, self.store, from_store, range(first_load, a.num_layers))
        with loader:  # closes the loader thread on every exit
            for li, layer in enumerate(body.layers[: a.num_layers]):
                loaded = None
                if li >= first_load and from_store:
                    tw = time.perf_counter()
                    loaded = dict(zip(loader.keys, loader.layer(li)))
                    stats.t_load += time.perf_counter() - tw
                whole = full_causal and active.numel() == total
                self._fuse_layer(cache, li, segments, total, load_chunks=li >= first_load,
                                 load_prefix=not whole, stats=stats, loaded=loaded)
                tc = time.perf_counter()
                cache.active = active
                if li in ratios:
                    cache.signal = cfg.signal
                    cache.score_rows = torch.nonzero((active >= P) & (active < P + C)).flatten()
                pos = active[None]
                cos_sin = body.rotary_emb(hidden, pos)
                extra = {}
                if whole:
                    pass  # a plain causal prefill of the whole prompt
                elif by_position:
                    extra["ragkv_q_pos"] = active
                elif mask is None:
                    mask = _causal_mask_by_position(active, total, dtype)
                hidden = layer(hidden, attention_mask=None if whole else mask, position_ids=pos, cache=cache,
                               use_cache=True, position_embeddings=cos_sin, **extra)
                if li in ratios:
                    keep_n = min(cache.score_rows.numel(), math.ceil(ratios[li] * C - 1e-9))
                    top = ops.select_topk(cache.scores, keep_n)
                    keep_rows = torch.cat([cache.score_rows[top], torch.nonzero(active >= P + C).flatten()])
                    # (prefix rows, active only in whole-prompt layers, drop out here)
                    keep_rows = keep_rows.sort().values
                    active, hidden, mask = active[keep_rows], hidden[:, keep_rows], None
                    selected = active[(active >= P) & (active < P + C)]
                    cache.signal, cache.scores = None, None
                stats.t_compute += time.perf_counter() - tc
        stats.t_load_io = loader.io_seconds
        tc = time.perf_counter()
        logits = self.model.lm_head(body.norm(hidden[:, -1:]))[0, -1].float()
        handoff = self._handoff(cache, total - 1)
        stats.t_compute += time.perf_counter() - tc
        stats.recomputed_tokens = 0 if selected is None else int(selected.numel())
        stats.t_total = time.perf_counter() - t0
        return BlendResult(input_ids, logits, handoff, stats, selected)

    def with_config(self, **changes) -> BlendEngine:
        """A view of this engine (same model, store, policy, measurements) with other BlendConfig fields."""
        other = copy.copy(self)
        other.config = replace(self.config, **changes)
        return other

    def auto_ratio(self, keys: Sequence[str], chunk_tokens: int, suffix_tokens: int, total: int) -> float:
        """The loading controller's ratio for these stored chunks (ragkv.controller): recompute what
        one layer's load from the store hides, never below ``ratio_floor``."""
        from ragkv.controller import RatioController, measure_layer_cost, measure_layer_read

        if self._controller is None:
            self._controller = RatioController(measure_layer_cost(self.model, context_tokens=total),
                                               floor=self.ratio_floor)
        if not keys:
            return self._controller.floor
        nbytes, seconds = measure_layer_read(self.store, keys, layer=self.adapter.num_layers - 1)
        bandwidth = nbytes / seconds if nbytes and seconds > 0 else 0.0
        return self._controller.choose(nbytes, bandwidth, chunk_tokens, suffix_tokens)

    @property
    def check_layers(self) -> list[int]:
        """The check layers in use: the configured ones, or the default (1, 3, 6) cut to the model."""
        if self.config.check_layers is not None:
            return list(self.config.check_layers)
        n = self.adapter.num_layers
        return [c for c in DEFAULT_CHECK_LAYERS if c < n - 1] or [min(1, n - 1)]

    def _meta_matches(self, meta: EntryMeta, seg: _Segment) -> bool:
        a = self.adapter
        return (
            tuple(meta.token_ids) == tuple(seg.ids) and meta.num_layers == a.num_layers
            and meta.num_kv_heads == a.num_kv_heads and meta.head_dim == a.head_dim
            and meta.fingerprint == self.fingerprint
        )

    def _segment_layer(self, seg: _Segment, li: int, stats: BlendStats,
                       loaded: dict | None = None) -> StoredLayer | tuple:
        if seg.layers is not None:
            return seg.layers[li]
        if loaded is not None and seg.key in loaded:  # read ahead by the loader
            stored = loaded[seg.key]
        else:
            stored = self.store.get_layer(seg.key, li)
        if stored is None:  # vanished or corrupt after the lookup: recompute this segment now
            stats.corrupt += 1
            self.compute_and_store([seg])
            return seg.layers[li]
        return stored

    def _fuse_layer(self, cache: _FusedCache, li: int, segments, total: int, load_chunks: bool,
                    load_prefix: bool, stats: BlendStats, loaded: dict | None = None) -> None:
        a = self.adapter
        shape = (1, a.num_kv_heads, total, a.head_dim)
        k_all = torch.empty(shape, dtype=a.dtype, device=a.device)
        v_all = torch.empty(shape, dtype=a.dtype, device=a.device)
        inv = a.inv_freq.to(a.device)
        lo, hi, deltas = total, 0, []  # the span of plain (unquantized) keys still to re-rotate
        for seg in segments:
            if not (load_chunks if seg.chunk else load_prefix):
                continue
            tl = time.perf_counter()
            item = self._segment_layer(seg, li, stats, loaded)
            tf = time.perf_counter()
            stats.t_load += tf - tl
            n = len(seg.ids)
            dst_k, dst_v = k_all[0, :, seg.start : seg.start + n], v_all[0, :, seg.start : seg.start + n]
            if isinstance(item, StoredLayer):
                k, v, k_scale, v_scale = item.k, item.v, item.k_scale, item.v_scale
            else:
                (k, v), k_scale, v_scale = item, None, None
            k, v = k.to(a.device), v.to(a.device)
            shift = seg.start - seg.stored_start
            if k_scale is not None:  # dequantize and re-rotate in one pass
                delta = torch.full((n,), shift, dtype=torch.long, device=a.device)
                dst_k.copy_(ops.rope_shift(k, delta, inv, scale=k_scale.to(a.device), out_dtype=a.dtype))
            else:
                dst_k.copy_(k)
                if shift:
                    lo, hi = min(lo, seg.start), max(hi, seg.start + n)
                    deltas.append((seg.start, n, shift))
            if v_scale is not None:
                dst_v.copy_(v.float() * v_scale.to(a.device))
            else:
                dst_v.copy_(v)
            stats.t_fuse += time.perf_counter() - tf
        if deltas:  # one rope_shift over the span: the chunks sit side by side, each with its own delta
            tf = time.perf_counter()
            delta = torch.zeros(hi - lo, dtype=torch.long, device=a.device)
            for start, n, shift in deltas:
                delta[start - lo : start - lo + n] = shift
            span = k_all[0, :, lo:hi]
            span.copy_(ops.rope_shift(span, delta, inv, out_dtype=a.dtype))
            stats.t_fuse += time.perf_counter() - tf
        cache.keys[li], cache.values[li] = k_all, v_all

    def _handoff(self, cache: _FusedCache, length: int):
        """A DynamicCache over the first ``length`` positions of the fused K/V, without copying: its
        layers hold views, and generation's first update concatenates onto them as usual."""
        from transformers import DynamicCache

        dc = DynamicCache(config=self.model.config)
        for li in range(self.adapter.num_layers):
            k, v = cache.keys[li][:, :, :length], cache.values[li][:, :, :length]
            layer = dc.layers[li]
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
        return dc

    # ------------------------------------------------------------------ generation

    def generate(self, question: str, contexts: Sequence[str], ratio: float | None = None,
                 **generate_kwargs) -> tuple[str, BlendResult, torch.Tensor]:
        """Blend, then ``model.generate`` on top; returns (answer text, blend result, new token ids)."""
        res = self.prefill(question, contexts, ratio=ratio)
        new = self.generate_from(res, **generate_kwargs)
        return self.tokenizer.decode(new, skip_special_tokens=True).strip(), res, new

    def generate_from(self, res: BlendResult, **generate_kwargs) -> torch.Tensor:
        generate_kwargs.setdefault("max_new_tokens", 64)
        if "do_sample" not in generate_kwargs:
            generate_kwargs.setdefault("do_sample", False)
            if not generate_kwargs["do_sample"]:
                generate_kwargs.update(temperature=None, top_p=None, top_k=None)
        ids = res.input_ids
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=res.cache,
                                  pad_token_id=self.pad_token_id, **generate_kwargs)
        return out[0, ids.shape[1]:]

    @property
    def pad_token_id(self) -> int | None:
        """The pad id generate should use: the tokenizer's, else the (first) EOS id."""
        tok = self.tokenizer
        pad = getattr(tok, "pad_token_id", None) if tok is not None else None
        if pad is None:
            eos = self.model.generation_config.eos_token_id
            pad = eos[0] if isinstance(eos, list) else eos
        return pad
