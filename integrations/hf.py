"""HuggingFace ``generate`` with CacheBlend: a drop-in for ``model.generate`` over (question, contexts).

    gen = BlendedGenerator(model, tokenizer, open_store("disk:///tmp/kv"), BlendConfig(ratio=0.15))
    out = gen.generate("Who designed it?", [chunk1, chunk2], max_new_tokens=32)
    out.text, out.hits, out.misses, out.reused_tokens, out.recomputed_tokens, out.ttft

Each context is ONE cached chunk (split documents with ``ragkv.chunking.chunk_document`` so the keys
match the precompute job). Missing chunks are prefilled and written back by the engine, so the next
call over the same contexts hits. Generate kwargs go to ``model.generate`` (max_new_tokens, do_sample,
temperature, top_p, streamer, stopping_criteria, ...): greedy by default, sampling when asked
(``do_sample=True``, or a sampling parameter such as ``temperature`` without ``do_sample``);
the caller's values are never overwritten.

Streaming, as HuggingFace documents it (``generate`` in a thread, the streamer consumed here):

    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    Thread(target=gen.generate, args=(q, ctxs), kwargs={"streamer": streamer}).start()
    for piece in streamer: ...
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from ragkv.blend import BlendConfig, BlendEngine, BlendResult, BlendStats
from ragkv.policy import PrecomputePolicy, StorageFormat
from ragkv.prompt import Prompt


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated tokens, prompt excluded
    stats: BlendStats
    ttft: float  # seconds, request -> first-token logits (prompt build + lookup + load + blend)
    t_total: float  # seconds, request -> last token

    # the stats a caller looks at first (BlendStats: ragkv.blend.result)
    hits = property(lambda self: self.stats.hits)
    misses = property(lambda self: self.stats.misses)
    reused_tokens = property(lambda self: self.stats.reused_tokens)
    recomputed_tokens = property(lambda self: self.stats.recomputed_tokens)

    def stats_dict(self) -> dict:
        return {**self.stats.as_dict(), "ttft": self.ttft, "t_generate_total": self.t_total,
                "new_tokens": len(self.token_ids)}


class BlendedGenerator:
    """``model.generate`` over (question, contexts) with chunk K/V reused from ``store``.

    ``config`` (BlendConfig): ratio (fraction of reused chunk tokens recomputed: 0 = naive reuse,
    1 = full prefill; default 0.15), selector, pipelined loading. ``policy``, ``storage`` and
    ``namespace`` as in BlendEngine (they must match the precompute job's). A per-call ``ratio``
    overrides the config's for that call."""

    def __init__(self, model, tokenizer, store, config: BlendConfig | None = None, *,
                 policy: PrecomputePolicy | None = None, storage: StorageFormat | None = None,
                 namespace: str = "", template=None):
        if config is not None and not isinstance(config, BlendConfig):
            raise TypeError(f"config must be a BlendConfig, got {type(config).__name__} "
                            "(e.g. BlendedGenerator(model, tok, store, BlendConfig(ratio=0.3)))")
        self.engine = BlendEngine(model, tokenizer, store, config, policy=policy, storage=storage,
                                  namespace=namespace, template=template)

    @property
    def model(self):
        return self.engine.model

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def ratio(self) -> float | str:
        return self.engine.config.ratio

    # ------------------------------------------------------------------ public API

    def generate(self, question: str | Sequence[str], contexts: Sequence[str] | Sequence[Sequence[str]],
                 ratio: float | str | None = None, **generate_kwargs) -> GenerationResult | list[GenerationResult]:
        """One question + its contexts -> GenerationResult; a list of questions + a list of context
        lists -> a list of results (run one after another: each prompt has its own chunk layout)."""
        if isinstance(question, str):
            return self._generate_one(question, contexts, ratio, generate_kwargs)
        if not isinstance(question, (list, tuple)):
            raise ValueError(f"question must be a non-empty string (or a list of them for a batch), "
                             f"got {type(question).__name__}")
        questions = list(question)
        if isinstance(contexts, str) or len(contexts) != len(questions):
            raise ValueError("a batch needs one list of contexts per question "
                             f"({len(questions)} questions, {0 if isinstance(contexts, str) else len(contexts)} lists)")
        if generate_kwargs.get("streamer") is not None and len(questions) > 1:
            raise ValueError("streamer supports a single question, not a batch")
        return [self._generate_one(q, c, ratio, generate_kwargs) for q, c in zip(questions, contexts)]

    def prompt(self, question: str, contexts: Sequence[str]) -> Prompt:
        """The prompt layout (ids) a call would use, after validating the inputs."""
        return self.engine.build_prompt(question, contexts)

    def generate_from(self, res: BlendResult, **generate_kwargs):
        """Generation continuing a blended prompt (``BlendEngine.prefill``) -> new token ids [n]."""
        with self.engine.exclusive():
            return self.engine.adapter.generate(res.input_ids, res.cache, self.tokenizer, **generate_kwargs)

    # ------------------------------------------------------------------ internals

    def _generate_one(self, question, contexts, ratio, generate_kwargs) -> GenerationResult:
        t0 = time.perf_counter()
        with self.engine.exclusive():  # one blend + generate at a time per model
            res = self.engine.prefill_prompt(self.prompt(question, contexts), ratio=ratio)
            ttft = time.perf_counter() - t0
            new = self.generate_from(res, **generate_kwargs)
        ids = new.tolist()
        text = self.tokenizer.decode(ids, skip_special_tokens=True).strip()
        return GenerationResult(text, ids, res.stats, ttft, time.perf_counter() - t0)
