"""Decoding, one of each: the HF wrapper and ``ragkv eval`` (through ``model.generate``) and
``ragkv serve`` (step by step, so a stream can stop between any two tokens) share it.

    stop_ids(model, tokenizer)            the tokens that end an answer: the model's EOS id(s) and the
                                          tokenizer's end-of-turn token (SmolLM2, Qwen2.5: <|im_end|>)
    generation_kwargs(model, tokenizer)   ``model.generate``'s arguments with ragkv's defaults
    Sampler(temperature, top_p, seed)     the next token from logits, greedy at temperature 0
"""

from __future__ import annotations

import time

import torch

_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "typical_p")


def stop_ids(model, tokenizer=None) -> list[int]:
    """Where an answer ends: the model's EOS id(s), then the tokenizer's end-of-turn token."""
    eos = model.generation_config.eos_token_id
    ids = list(eos) if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]
    end = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    return ids + ([end] if end is not None and end not in ids else [])


def pad_token_id(model, tokenizer=None) -> int | None:
    """The pad id generate should use: the tokenizer's, else the first stop id."""
    pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    return pad if pad is not None else next(iter(stop_ids(model)), None)


def generation_kwargs(model, tokenizer=None, **kwargs) -> dict:
    """The caller's generate kwargs with ragkv's defaults: 64 new tokens, ``stop_ids`` as the EOS ids,
    and greedy unless asked to sample. ``do_sample`` omitted: sampling when the caller set a sampling
    parameter (temperature, top_p, top_k, min_p, typical_p), else greedy with the model's sampling
    defaults cleared so generate does not warn about them. The caller's values are never overwritten."""
    kwargs.setdefault("max_new_tokens", 64)
    if kwargs.get("eos_token_id") is None:
        kwargs["eos_token_id"] = stop_ids(model, tokenizer) or None
    if "do_sample" not in kwargs:
        kwargs["do_sample"] = any(kwargs.get(k) is not None for k in _SAMPLING)
    if not kwargs["do_sample"]:
        for k in ("temperature", "top_p", "top_k"):
            kwargs.setdefault(k, None)
    if kwargs.get("pad_token_id") is None:
        kwargs["pad_token_id"] = pad_token_id(model, tokenizer)
    return kwargs


class Sampler:
    """The next token of step-by-step decoding: the argmax at temperature 0 (or None), else a draw at
    ``temperature`` within the smallest set of tokens reaching ``top_p``, from a generator seeded with
    ``seed`` (a fresh seed when None)."""

    def __init__(self, temperature: float | None = None, top_p: float = 1.0, seed: int | None = None,
                 device: torch.device | str = "cpu"):
        self.temperature, self.top_p, self.rng = temperature, top_p, None
        if temperature:
            self.rng = torch.Generator(device=device)
            self.rng.manual_seed(seed if seed is not None else int(time.time_ns()) & 0x7FFFFFFF)

    def __call__(self, logits: torch.Tensor) -> int:
        if self.rng is None:
            return int(torch.argmax(logits))
        # in float64, shifted so the top logit is 0: any temperature in (0, 2] gives finite
        # probabilities (a tiny one, e.g. 1e-300, makes the top token certain instead of NaN)
        probs = torch.softmax((logits.double() - logits.max()) / self.temperature, dim=-1)
        if self.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < self.top_p  # the smallest set reaching top_p
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
        return int(torch.multinomial(probs, 1, generator=self.rng))
