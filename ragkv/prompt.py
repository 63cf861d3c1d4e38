"""Prompt layout shared by the read path, the precompute job and the integrations.

    prompt = prefix | chunk_1 | chunk_2 | ... | chunk_n | suffix
    prefix  system/instruction and the user-turn header of the chat template; cached as a true prefix
    chunk_i one retrieved chunk = tokenize(text) + separator; cached independently, any order/position
    suffix  the question, end of the user turn and the assistant header; always computed

Pieces are tokenized separately and concatenated, so a chunk's token ids (and therefore its cache
key) do not depend on its neighbours. Full prefill baselines use the same concatenated ids.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

try:
    from jinja2 import TemplateError
except ImportError:  # transformers renders chat templates with jinja2: without it there are none to refuse
    TemplateError = ()

_SENTINEL = "\x00RAGKV-CONTENT\x00"
DEFAULT_QUESTION = "Answer the question using the documents above. Be brief.\nQuestion: {question}"
# LongBench-style: ask for the bare answer, as QA benchmarks score it (with DEFAULT_QUESTION small models
# answer in a sentence, which EM/F1 score near 0: "Yes, both were American." is 0 against "yes").
# What benchmarks/qa and the demo ask with (``ragkv eval --question-format``).
ANSWER_ONLY_QUESTION = ("Answer the question based on the documents above. Only give me the answer and do not output "
                        "any other words.\nQuestion: {question}")


def document_text(text: str, title: str | None = None) -> str:
    """The text cached as one chunk for a document with an optional title (the title becomes its
    first line, and part of its key): the one rule ``ragkv serve`` and ragkv's vLLM renderer share,
    so a document sent to either hits the same entries."""
    return f"{title}\n{text}" if title else text


def check_window(tokens: int, window: int | None, what: str, hint: str = "") -> None:
    """THE context-window check: ``what`` (a prompt, a context, a chunk behind its sink) of ``tokens``
    tokens fits a model of ``window`` positions (None: no limit known), else a ValueError naming both
    and, with ``hint``, what to do."""
    if window is not None and tokens > window:
        raise ValueError(f"{what} has {tokens} tokens, longer than the model's window ({window} tokens)"
                         + (f"; {hint}" if hint else ""))


@dataclass(frozen=True)
class Prompt:
    prefix_ids: list[int]
    chunk_ids: list[list[int]]
    suffix_ids: list[int]

    @property
    def input_ids(self) -> list[int]:
        ids = list(self.prefix_ids)
        for c in self.chunk_ids:
            ids.extend(c)
        ids.extend(self.suffix_ids)
        return ids

    @property
    def num_tokens(self) -> int:
        return len(self.prefix_ids) + sum(map(len, self.chunk_ids)) + len(self.suffix_ids)

    def chunk_positions(self) -> list[int]:
        starts, pos = [], len(self.prefix_ids)
        for c in self.chunk_ids:
            starts.append(pos)
            pos += len(c)
        return starts


@dataclass(frozen=True)
class PromptTemplate:
    """One fixed template per model: its chat template when it has one, else a plain layout."""

    tokenizer: object = field(repr=False)
    prefix_ids: list[int]
    tail_ids: list[int]
    separator: str = "\n\n"
    question_format: str = DEFAULT_QUESTION

    @classmethod
    def for_tokenizer(cls, tokenizer, system: str | None = None, question_format: str = DEFAULT_QUESTION):
        if getattr(tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": _SENTINEL}]
            if system is not None:
                messages.insert(0, {"role": "system", "content": system})
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            head, sep, tail = text.partition(_SENTINEL)
            if not sep:
                raise ValueError("the tokenizer's chat template drops the user content; cannot build a layout")
        else:
            head = (system + "\n\n") if system else ""
            tail = "\nAnswer:"
        prefix = tokenizer(head, add_special_tokens=False)["input_ids"] if head else []
        bos = getattr(tokenizer, "bos_token_id", None)
        if not getattr(tokenizer, "chat_template", None) and bos is not None:
            prefix = [bos, *prefix]
        return cls(tokenizer, prefix, tokenizer(tail, add_special_tokens=False)["input_ids"],
                   question_format=question_format)

    def chunk_ids(self, text: str) -> list[int]:
        """Token ids of one chunk as cached: the text, then the separator."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError("a context chunk must be a non-empty string")
        return self.tokenizer(text.strip() + self.separator, add_special_tokens=False)["input_ids"]

    def suffix_ids(self, question: str) -> list[int]:
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"the question must be a non-empty string, got {_short(question)}")
        q = self.question_format.format(question=question.strip())
        return self.tokenizer(q, add_special_tokens=False)["input_ids"] + list(self.tail_ids)

    def chat(self, messages: list[dict], contexts, max_tokens: int | None = None,
             names: list[str] | None = None) -> Prompt:
        """The prompt of a chat over ``contexts`` (the layout ``ragkv serve`` and ragkv's vLLM renderer
        give a request's ``documents``): the chat template up to the last message's content as the
        prefix (system, earlier turns, user header), one chunk per context, the question format
        around the last message (the user's question) and the rest of the template as the suffix.
        A single user message gives ``build(question, contexts)``'s ids. Raises ChatTemplateError
        when the template has no single place for the question, MessagesRefused for messages the
        template refuses (or a last message that is not the user's), ValueError for a bad context."""
        if not messages or messages[-1].get("role") != "user" or not isinstance(messages[-1].get("content"), str):
            raise MessagesRefused("with documents the last message must be the user's question (a string)")
        head, tail = around_last_user(self.tokenizer, messages[:-1])
        q = self.question_format.format(question=messages[-1]["content"].strip())
        suffix = self._ids(q) + self._ids(tail)
        return Prompt(self._ids(head), self.chunks(contexts, max_tokens, names), suffix)

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def chunks(self, contexts, max_tokens: int | None = None, names: list[str] | None = None) -> list[list[int]]:
        """Token ids of each context, each checked: a list of non-empty strings, none longer than
        ``max_tokens``. Errors name the context (``names[i]``, default "context i")."""
        if isinstance(contexts, str):
            raise TypeError("contexts must be a list of strings (one chunk each), not one string")
        if contexts is None or len(contexts) == 0:
            raise ValueError("contexts is empty: give at least one context chunk")
        out = []
        for i, c in enumerate(contexts):
            name = names[i] if names is not None else f"context {i}"
            if not isinstance(c, str):
                raise TypeError(f"{name} is a {type(c).__name__}, expected str")
            if not c.strip():
                raise ValueError(f"{name} is empty or whitespace only")
            ids = self.chunk_ids(c)
            check_window(len(ids), max_tokens, _describe(name, c), "split it with ragkv.chunking.chunk_document")
            out.append(ids)
        return out

    def build(self, question: str, contexts, max_tokens: int | None = None) -> Prompt:
        """The prompt of ``question`` over ``contexts`` (one cached chunk each); with ``max_tokens``
        (the model's window) a prompt that does not fit is an error naming its longest context."""
        suffix = self.suffix_ids(question)
        prompt = Prompt(list(self.prefix_ids), self.chunks(contexts, max_tokens), suffix)
        lens = [len(ids) for ids in prompt.chunk_ids]
        worst = max(range(len(lens)), key=lens.__getitem__)
        check_window(prompt.num_tokens, max_tokens, "the prompt", f"its longest context, "
                     f"{_describe(f'context {worst}', contexts[worst])}, has {lens[worst]}: pass fewer or shorter contexts")
        return prompt


class ChatTemplateError(ValueError):
    """The model's chat template cannot hold documents (it drops or repeats the user's content)."""


class MessagesRefused(ValueError):
    """The model's chat template refuses these messages (e.g. roles that do not alternate)."""


def chat_text(tokenizer, messages: list[dict]) -> str:
    """The chat template over ``messages`` with the assistant header; a plain layout without one.
    Raises MessagesRefused when the template itself refuses them (its ``raise_exception``)."""
    if getattr(tokenizer, "chat_template", None):
        try:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except TemplateError as e:
            raise MessagesRefused(f"the model's chat template refuses these messages: {e}") from None
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def around_last_user(tokenizer, history: list[dict]) -> tuple[str, str]:
    """The chat template's text before and after the content of a user turn that follows
    ``history``. The content is a marker drawn at random per call and checked to occur nowhere else
    in the rendered text, so no message (whatever it holds) can move where the split falls."""
    for _ in range(8):
        mark = f"\x00RAGKV-QUESTION-{secrets.token_hex(16)}\x00"
        text = chat_text(tokenizer, [*history, {"role": "user", "content": mark}])
        n = text.count(mark)
        if n == 1:
            head, _, tail = text.partition(mark)
            return head, tail
        if n == 0:
            raise ChatTemplateError("the model's chat template drops the user content")
    # a template that repeats the last user content: no single place for the documents
    raise ChatTemplateError("the model's chat template repeats the user content")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _describe(name: str, text: str) -> str:
    head = text.strip().replace("\n", " ")
    return f"{name} ({head[:40]!r}{'...' if len(head) > 40 else ''})"
