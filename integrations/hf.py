"""HuggingFace ``generate`` with CacheBlend: a drop-in for ``model.generate`` over (question, contexts).

    gen = BlendedGenerator(model, tokenizer, open_store("disk:///tmp/kv"), ratio=0.15)
    out = gen.generate("Who designed it?", [chunk1, chunk2], max_new_tokens=32)
    out.text, out.hits, out.misses, out.reused_tokens, out.recomputed_tokens, out.ttft

Each context is ONE cached chunk (split documents with ``ragkv.chunking.chunk_document`` so the keys
match the precompute job). Missing chunks are prefilled and written back by the engine, so the next
call over the same contexts hits. Generate kwargs go to ``model.generate`` unchanged (max_new_tokens,
do_sample, temperature, top_p, streamer, stopping_criteria, ...); greedy is the default.

Streaming, as HuggingFace documents it (``generate`` in a thread, the streamer consumed here):

    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    Thread(target=gen.generate, args=(q, ctxs), kwargs={"streamer": streamer}).start()
    for piece in streamer: ...
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ragkv.blend import BlendConfig, BlendEngine, BlendStats
from ragkv.prompt import Prompt


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated tokens, prompt excluded
    stats: BlendStats
    ttft: float  # seconds, request -> first-token logits (prompt build + lookup + load + blend)
    t_total: float  # seconds, request -> last token

    @property
    def hits(self) -> int:
        return self.stats.hits

    @property
    def misses(self) -> int:
        return self.stats.misses

    @property
    def reused_tokens(self) -> int:
        return self.stats.reused_tokens

    @property
    def recomputed_tokens(self) -> int:
        return self.stats.recomputed_tokens

    def stats_dict(self) -> dict:
        return {**self.stats.as_dict(), "ttft": self.ttft, "t_generate_total": self.t_total,
                "new_tokens": len(self.token_ids)}


def _describe(i: int, text: str) -> str:
    head = text.strip().replace("\n", " ")
    return f"context {i} ({head[:40]!r}{'...' if len(head) > 40 else ''})"


DEFAULT_RATIO = 0.15


class BlendedGenerator:
    """``model.generate`` over (question, contexts) with chunk K/V reused from ``store``.

    ratio: fraction of reused chunk tokens recomputed (0 = naive reuse, 1 = full prefill). With a
    ``config``, its ratio is used; an explicit different ``ratio`` as well is an error.
    engine_kwargs: ``template``, ``policy`` for the BlendEngine (must match the precompute job's)."""

    def __init__(self, model, tokenizer, store, ratio: float = DEFAULT_RATIO, config: BlendConfig | None = None,
                 namespace: str = "", **engine_kwargs):
        config = config or BlendConfig(ratio=ratio)
        if config.ratio != ratio and ratio != DEFAULT_RATIO:
            raise ValueError(f"ratio={ratio} conflicts with config.ratio={config.ratio}; give one of them")
        self.engine = BlendEngine(model, tokenizer, store, config=config, namespace=namespace, **engine_kwargs)
        self.ratio = config.ratio
        self._lock = threading.RLock()  # one blend + generate at a time per model

    @property
    def model(self):
        return self.engine.model

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_tokens(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    # ------------------------------------------------------------------ public API

    def generate(self, question: str | Sequence[str], contexts: Sequence[str] | Sequence[Sequence[str]],
                 ratio: float | None = None, **generate_kwargs) -> GenerationResult | list[GenerationResult]:
        """One question + its contexts -> GenerationResult; a list of questions + a list of context
        lists -> a list of results (run one after another: each prompt has its own chunk layout)."""
        if isinstance(question, str):
            return self._generate_one(question, contexts, ratio, generate_kwargs)
        questions = list(question)
        if isinstance(contexts, str) or len(contexts) != len(questions):
            raise ValueError("a batch needs one list of contexts per question "
                             f"({len(questions)} questions, {0 if isinstance(contexts, str) else len(contexts)} lists)")
        if generate_kwargs.get("streamer") is not None and len(questions) > 1:
            raise ValueError("streamer supports a single question, not a batch")
        return [self._generate_one(q, c, ratio, generate_kwargs) for q, c in zip(questions, contexts)]

    def prompt(self, question: str, contexts: Sequence[str]) -> Prompt:
        """The prompt layout (ids) a call would use, after validating the inputs."""
        self._check_contexts(contexts)
        if not isinstance(question, str) or not question.strip():
            raise ValueError("the question must be a non-empty string")
        prompt = self.engine.build_prompt(question, list(contexts))
        self._check_length(prompt, contexts)
        return prompt

    # ------------------------------------------------------------------ internals

    def _generate_one(self, question, contexts, ratio, generate_kwargs) -> GenerationResult:
        t0 = time.perf_counter()
        with self._lock:
            res = self.engine.prefill_prompt(self.prompt(question, contexts), ratio=ratio)
            ttft = time.perf_counter() - t0
            new = self.engine.generate_from(res, **generate_kwargs)
        ids = new.tolist() if isinstance(new, torch.Tensor) else list(new)
        text = self.tokenizer.decode(ids, skip_special_tokens=True).strip()
        return GenerationResult(text, ids, res.stats, ttft, time.perf_counter() - t0)

    def _check_contexts(self, contexts) -> None:
        if isinstance(contexts, str):
            raise TypeError("contexts must be a list of strings (one chunk each), not one string")
        if contexts is None or len(contexts) == 0:
            raise ValueError("contexts is empty: give at least one context chunk")
        for i, c in enumerate(contexts):
            if not isinstance(c, str):
                raise TypeError(f"context {i} is a {type(c).__name__}, expected str")
            if not c.strip():
                raise ValueError(f"context {i} is empty or whitespace only")

    def _check_length(self, prompt: Prompt, contexts: Sequence[str]) -> None:
        limit = self.max_tokens
        if limit is None or prompt.num_tokens <= limit:
            return
        lens = [len(ids) for ids in prompt.chunk_ids]
        worst = max(range(len(lens)), key=lens.__getitem__)
        what = "is longer than" if lens[worst] > limit else "makes the prompt longer than"
        raise ValueError(
            f"{_describe(worst, contexts[worst])} has {lens[worst]} tokens and {what} the model's window "
            f"({prompt.num_tokens} prompt tokens > max_position_embeddings={limit}); split it with "
            "ragkv.chunking.chunk_document or pass fewer contexts"
        )
