"""One chat completion as model steps: ``prefill()`` (the blended prompt, or a plain prefill without
documents) then ``step()`` per token. Every method runs on the model worker thread; the event loop
only reads ``take_delta()`` and the finished state between steps, so a request can stop between any
two tokens (client gone, server shutting down).

The prompt with documents is the engine's layout (ragkv.prompt) with the chat history in front:

    prefix  chat template up to the last user turn's content: system, earlier turns, user header
    chunks  one cached chunk per document, tokenized exactly as the precompute job does
    suffix  the engine's question format around the last user message, end of turn, assistant header

so a document's chunk key does not depend on the conversation around it, and documents stored by
``ragkv precompute`` are hits here.
"""

from __future__ import annotations

import time

import torch

from ragkv.decode import Sampler, stop_ids
from ragkv.prompt import ChatTemplateError, MessagesRefused, Prompt, chat_text, check_window

from .protocol import ApiError, ChatRequest, bad


def _window_error(message: str, param: str) -> ApiError:
    return ApiError(400, message, param, "context_length_exceeded")


def build_prompt(engine, req: ChatRequest) -> Prompt | list[int]:
    """The prompt of a request: a ``Prompt`` (prefix | chunks | suffix) with documents, else the ids of
    the chat template. Errors name the document or message that does not fit the window."""
    tok, window = engine.tokenizer, engine.adapter.max_positions

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"] if text else []

    if not req.documents:
        try:
            prompt = ids(chat_text(tok, req.messages))
        except MessagesRefused as e:
            raise ApiError(400, str(e), "messages") from None
        if not getattr(tok, "chat_template", None) and getattr(tok, "bos_token_id", None) is not None:
            prompt = [tok.bos_token_id, *prompt]
        _fits(len(prompt), window, "the messages (and the first answer token)", "messages")
        return prompt
    names = [f"documents[{i}]" for i in range(len(req.documents))]
    try:
        prompt = engine.template.chat(req.messages, [d.chunk_text() for d in req.documents], window, names)
    except ChatTemplateError as e:
        raise ApiError(500, str(e), type_="server_error") from None
    except MessagesRefused as e:
        raise ApiError(400, str(e), "messages") from None
    except ValueError as e:
        raise _window_error(str(e), "documents") from None
    lens = [len(c) for c in prompt.chunk_ids]
    worst = max(range(len(lens)), key=lens.__getitem__)
    _fits(prompt.num_tokens, window, "the prompt (and the first answer token)", "documents",
          f"the longest document, {names[worst]}, has {lens[worst]}: send fewer or shorter documents")
    return prompt


def _fits(tokens: int, window: int | None, what: str, param: str, hint: str = "") -> None:
    """The window check (ragkv.prompt.check_window) with room for one answer token, as a 400."""
    try:
        check_window(tokens + 1, window, what, hint)
    except ValueError as e:
        raise _window_error(str(e), param) from None


class Generation:
    """The decode state of one request. ``max_tokens``: the server's default when the request has
    none (clamped to what the window leaves); a requested one that does not fit is a 400."""

    def __init__(self, engine, req: ChatRequest, default_max_tokens: int):
        self.engine, self.req = engine, req
        self.default_max_tokens = default_max_tokens
        self.ids: list[int] = []  # generated, EOS excluded
        self.finish: str | None = None  # "stop" | "length" once done
        self.stats = None  # BlendStats when the prompt had documents
        self.prompt_tokens = 0
        self.ttft = self.t_prefill_start = 0.0
        self._cache = None
        self._pending: list[int] = []
        self._sent = 0  # characters of the text already handed out
        self._text = ""
        self._eos = set(stop_ids(engine.model, engine.tokenizer))
        self._holdback = max((len(s) for s in req.stop), default=1) - 1
        self._sample = Sampler(req.temperature, req.top_p, req.seed, engine.adapter.device)

    @property
    def done(self) -> bool:
        return self.finish is not None

    @property
    def cached_tokens(self) -> int:
        return self.stats.cached_tokens if self.stats is not None else 0

    @torch.inference_mode()
    def prefill(self, t_start: float) -> None:
        """Build the prompt, blend it (or prefill it plainly) and pick the first token. ``t_start``:
        when the request arrived (perf_counter), for the TTFT."""
        self.t_prefill_start = time.perf_counter()
        prompt = build_prompt(self.engine, self.req)
        self.prompt_tokens = prompt.num_tokens if isinstance(prompt, Prompt) else len(prompt)
        self.max_tokens = self._max_tokens()
        if isinstance(prompt, Prompt):
            res = self.engine.prefill_prompt(prompt)  # at the engine's ratio (ragkv serve --ratio)
            self.stats, self._cache, logits = res.stats, res.cache, res.logits
            self._pending = [prompt.input_ids[-1]]  # the handoff cache holds the prompt minus it
        else:
            self._cache = self.engine.adapter.new_cache()
            self._pending = prompt
            logits = self._forward()
        self._push(self._sample(logits))
        self.ttft = time.perf_counter() - t_start

    @torch.inference_mode()
    def step(self) -> None:
        """One decode step: the next token."""
        if not self.done:
            self._push(self._sample(self._forward()))

    def close(self) -> None:
        self._cache = None  # the K/V of this request, freed at once

    def take_delta(self) -> str:
        """Text generated since the last call (stop strings and incomplete characters held back)."""
        end = len(self._text)
        if not self.done:
            end -= self._holdback
            if self._text.endswith("\ufffd"):
                end = min(end, len(self._text) - 1)
        if end <= self._sent:
            return ""
        delta, self._sent = self._text[self._sent : end], end
        return delta

    def stats_dict(self) -> dict:
        s = self.stats
        out = {"blended": s is not None, "ttft_s": round(self.ttft, 6), "prompt_tokens": self.prompt_tokens,
               "cached_tokens": self.cached_tokens}
        if s is not None:
            out.update(hits=s.hits, misses=s.misses, chunks=s.chunks, reused_tokens=s.reused_tokens,
                       recomputed_tokens=s.recomputed_tokens, ratio=s.ratio, selector=s.selector,
                       corrupt=s.corrupt, vanished=s.vanished, store_errors=s.store_errors,
                       timeouts=s.timeouts, t_blend_s=round(s.t_total, 6))
        return out

    # ------------------------------------------------------------------ internals

    def _max_tokens(self) -> int:
        window = self.engine.adapter.max_positions
        room = (window - self.prompt_tokens) if window is not None else None
        if self.req.max_tokens is None:
            return self.default_max_tokens if room is None else max(1, min(self.default_max_tokens, room))
        if room is not None and self.req.max_tokens > room:
            raise bad(f"max_tokens={self.req.max_tokens} does not fit: the prompt is {self.prompt_tokens} tokens "
                      f"and the model's window {window}, which leaves {room}", "max_tokens",
                      "context_length_exceeded")
        return self.req.max_tokens

    def _forward(self) -> torch.Tensor:
        a = self.engine.adapter
        start = self._cache.get_seq_length()
        ids = torch.tensor([self._pending], device=a.device)
        pos = torch.arange(start, start + len(self._pending), device=a.device)[None]
        with self.engine.exclusive():  # (the worker thread is the model's only user; the engine's guard says so)
            logits, self._cache = a.forward(ids, self._cache, position_ids=pos, logits_to_keep=1)
        self._pending = []
        return logits[0, -1].float()

    def _push(self, token: int) -> None:
        if token in self._eos:
            self.finish = "stop"
            return
        self.ids.append(token)
        self._pending.append(token)
        self._text = self.engine.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = min((i for i in (self._text.find(s) for s in self.req.stop) if i >= 0), default=-1)
        if cut >= 0:
            self._text, self.finish = self._text[:cut], "stop"
        elif len(self.ids) >= self.max_tokens:
            self.finish = "length"
