"""The OpenAI chat-completions wire format: a request checked field by field into ``ChatRequest``
(every problem an ``ApiError`` naming the field), and the response / stream-chunk bodies.

One extension: ``documents``, a list of strings or ``{"text": ..., "title"?: ...}`` objects, each one
cached chunk (vLLM's chat API uses the same field name for RAG documents).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field

from ragkv.prompt import document_text
from ragkv.sources import lone_surrogate

ROLES = ("system", "developer", "user", "assistant")
_UNSUPPORTED = {  # accepted by OpenAI, refused here rather than silently ignored
    "tools": "tool calling", "functions": "function calling", "tool_choice": "tool calling",
    "function_call": "function calling", "audio": "audio output",
}
# accepted by OpenAI and meaningful there, refused here unless they hold their no-op value (a request
# that asks for them gets a 400 naming them instead of an answer that silently ignores them)
_NOOP_ONLY = {"logit_bias": ({},), "presence_penalty": (0,), "frequency_penalty": (0,), "top_logprobs": (0,)}
MAX_STOP = 4
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


@dataclass
class Document:
    text: str
    title: str | None = None

    def chunk_text(self) -> str:
        """The text cached as one chunk: a title becomes its first line (and part of its key)."""
        return document_text(self.text, self.title)


@dataclass
class ChatRequest:
    model: str
    messages: list[dict]  # [{"role", "content": str}], developer mapped to system
    documents: list[Document] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None  # None: the server's default, clamped to the window
    temperature: float | None = None  # None or 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)


def parse_request(raw: bytes, served_model: str) -> ChatRequest:
    """The body of POST /v1/chat/completions -> ChatRequest; ApiError (400/404) naming the problem."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required: a model id from GET /v1/models", "model")
    if model != served_model:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {served_model!r}",
                       "model", "model_not_found")
    for name, what in _UNSUPPORTED.items():
        if body.get(name) not in (None, [], {}):
            raise bad(f"{what} ({name!r}) is not supported by ragkv serve", name, "unsupported_parameter")
    for name, noops in _NOOP_ONLY.items():
        v = body.get(name)
        if v is not None and (isinstance(v, bool) or v not in noops):
            raise bad(f"{name!r} is not supported by ragkv serve (only its no-op value {noops[0]!r} is accepted), "
                      f"got {v!r}", name, "unsupported_parameter")
    req = ChatRequest(model=model, messages=_messages(body.get("messages")), documents=_documents(body))
    req.stream = _typed(body, "stream", bool, False)
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad("'stream_options' must be an object", "stream_options")
        req.include_usage = _typed(options, "include_usage", bool, False, "stream_options.include_usage")
    _sampling(body, req)
    if req.documents and req.messages[-1]["role"] != "user":
        last = f"messages[{len(req.messages) - 1}]"
        raise bad(f"with 'documents' the last message ({last}) must be the user's question, got role "
                  f"{req.messages[-1]['role']!r}", f"{last}.role")
    return req


def _typed(obj: dict, name: str, kind, default, param: str | None = None):
    value = obj.get(name)
    if value is None:
        return default
    if kind is bool and not isinstance(value, bool):
        raise bad(f"{param or name!r} must be true or false, got {value!r}", param or name)
    return value


def text(value: str, param: str) -> str:
    """``value`` if it is valid Unicode; a JSON string may carry a lone surrogate (``"\\ud800"``),
    which no tokenizer takes: a 400 naming the field and the character."""
    why = lone_surrogate(value)
    if why:
        raise bad(f"{param} holds {why}", param)
    return value


def _content(value, param: str) -> str:
    if isinstance(value, str):
        return text(value, param)
    if isinstance(value, list):  # content parts: text only
        parts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad(f"{param}[{j}]: only text content parts are supported, got {kind!r}", f"{param}[{j}]")
            parts.append(text(part["text"], f"{param}[{j}].text"))
        return "".join(parts)
    raise bad(f"{param} must be a string or a list of text parts, got {type(value).__name__}", param)


def _messages(value) -> list[dict]:
    if value is None:
        raise bad("'messages' is required: a non-empty list of {role, content}", "messages")
    if not isinstance(value, list) or not value:
        raise bad("'messages' must be a non-empty list of {role, content}", "messages")
    out = []
    for i, m in enumerate(value):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{p} must be an object with 'role' and 'content', got {type(m).__name__}", p)
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"{p}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{p}.role")
        if m.get("content") is None:
            raise bad(f"{p}.content is required", f"{p}.content")
        out.append({"role": "system" if role == "developer" else role, "content": _content(m["content"], f"{p}.content")})
    if out[-1]["role"] == "user" and not out[-1]["content"].strip():
        raise bad(f"messages[{len(out) - 1}].content (the user's question) is empty", f"messages[{len(out) - 1}].content")
    return out


def _documents(body: dict) -> list[Document]:
    value = body.get("documents")
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad("'documents' must be a list of strings or {text, title?} objects", "documents")
    docs = []
    for i, d in enumerate(value):
        p = f"documents[{i}]"
        if isinstance(d, dict):
            body_text, title = d.get("text"), d.get("title")
            if title is not None and not isinstance(title, str):
                raise bad(f"{p}.title must be a string", f"{p}.title")
            extra = sorted(set(d) - {"text", "title"})
            if extra:
                raise bad(f"{p} has unknown fields {extra}; a document is {{text, title?}}", p)
        else:
            body_text, title = d, None
        if not isinstance(body_text, str):
            raise bad(f"{p} must be a string or {{text, title?}}, got {type(body_text).__name__}", p)
        if not body_text.strip():
            raise bad(f"{p} is empty or whitespace only", p)
        docs.append(Document(text(body_text, f"{p}.text" if isinstance(d, dict) else p),
                             text(title, f"{p}.title") if title else None))
    return docs


def _sampling(body: dict, req: ChatRequest) -> None:
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n != 1):
        raise bad(f"'n' must be the integer 1 (one choice per request), got {n!r}", "n")
    if body.get("logprobs"):
        raise bad("'logprobs' is not supported by ragkv serve", "logprobs", "unsupported_parameter")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise bad("only response_format {'type': 'text'} is supported", "response_format", "unsupported_parameter")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    mt = body.get(name)
    if mt is not None:
        if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
            raise bad(f"{name!r} must be an integer >= 1, got {mt!r}", name)
        req.max_tokens = mt
    req.temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0)
    if top_p is not None:
        if top_p == 0:
            raise bad("'top_p' must be in (0, 1], got 0", "top_p")
        req.top_p = top_p
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                             or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]):
        raise bad(f"'seed' must be an integer in [-2**63, 2**64 - 1], got {seed!r}", "seed")
    req.seed = seed
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
            raise bad(f"'stop' must be a non-empty string or a list of up to {MAX_STOP} of them", "stop")
        req.stop = [text(s, f"stop[{i}]") for i, s in enumerate(stop)]


def _number(body: dict, name: str, low: float, high: float) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not low <= v <= high:
        raise bad(f"{name!r} must be a number in [{low:g}, {high:g}], got {v!r}", name)
    return float(v)


# ---------------------------------------------------------------------------- responses

def new_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion(rid: str, model: str, text: str, finish: str, use: dict, stats: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish}],
            "usage": use, "system_fingerprint": None, "ragkv": stats}


def chunk(rid: str, model: str, delta: dict, finish: str | None = None, **extra) -> str:
    """One server-sent event carrying a chat.completion.chunk."""
    body = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra}
    return sse(body)


def sse(body: dict | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"
