"""Chat requests with ``documents`` on vLLM: each document one ragkv chunk, laid out exactly as
``ragkv serve`` lays them out (``PromptTemplate.chat``), so the connector recognises the prompt and
its chunk keys are the ones ``ragkv precompute`` stores.

    RagKVRenderer        vLLM's own HF renderer (``vllm.renderers.hf.HfRenderer``), which ragkv's
                         plugin registers for renderer mode "hf" (the one every HF tokenizer uses).
                         Under a config whose KV connector is RagKVConnector, a chat request with
                         ``documents`` is rendered into ragkv's token ids; every other request, and
                         every request under any other config, is vLLM's own rendering.
    DocumentsMiddleware  ASGI middleware for vLLM's OpenAI server (``--middleware
                         ragkv.integrations.vllm.DocumentsMiddleware``): vLLM's chat API types
                         ``documents`` as ``list[dict[str, str]]``; ragkv serve, and README's
                         LlamaIndex recipe, send strings. Each string becomes ``{"text": string}``.

Why token ids and not a chat template: vLLM tokenizes a rendered chat as one text, and byte-level BPE
tokenizers (SmolLM2's, Llama's) split a paragraph break before a word differently in one text than
at the end of a chunk tokenized alone ("...Morrow.\\n\\nKerran" gives "\\n", "\\n"; the chunk alone
ends in "\\n\\n"): no template text can give the chunks' own ids. The renderer tokenizes each
document alone, as the precompute job does.

A document is a string or ``{"text": ..., "title"?: ...}`` (a title becomes its chunk's first line,
as in ragkv serve); other fields, an empty text, documents together with images or audio, and a last
message that is not the user's question are refused with a 400 naming them.
"""

from __future__ import annotations

import dataclasses
import json

from ragkv.integrations.vllm.models import uses_ragkv
from ragkv.prompt import PromptTemplate, document_text
from vllm.renderers.hf import HfRenderer
from vllm.renderers.inputs.preprocess import parse_dec_only_prompt


def read_document(doc, name: str) -> str:
    """The chunk text of one document (string, or {text, title?}); ValueError naming ``name``."""
    if isinstance(doc, dict):
        extra = sorted(set(doc) - {"text", "title"})
        if extra:
            raise ValueError(f"{name} has unknown fields {extra}; a document is a string or {{text, title?}}")
        text, title = doc.get("text"), doc.get("title")
        if title is not None and not isinstance(title, str):
            raise ValueError(f"{name}.title must be a string")
    else:
        text, title = doc, None
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{name} needs a non-empty text")
    return document_text(text, title)


def _content(message: dict, name: str) -> str:
    content = message.get("content")
    if isinstance(content, list):  # content parts: the text ones, joined (vLLM's "openai" format)
        if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
            raise ValueError(f"{name}: with documents only text content is supported")
        content = "".join(p["text"] for p in content)
    return content if isinstance(content, str) else ""


class RagKVRenderer(HfRenderer):
    """vLLM's HF renderer; with RagKVConnector configured, chat requests with documents become
    ragkv's token ids (prefix | one chunk per document | question)."""

    def __init__(self, config, tokenizer):
        super().__init__(config, tokenizer)
        self._template = None
        if uses_ragkv(config) and self.tokenizer is not None:
            self._template = PromptTemplate.for_tokenizer(self.tokenizer)
            self._window = config.model_config.max_model_len

    def _ours(self, params) -> bool:
        return self._template is not None and bool((params.chat_template_kwargs or {}).get("documents"))

    @staticmethod
    def _without_documents(params):
        """``params`` minus the documents: vLLM renders the conversation, ragkv the documents
        (transformers' own check would refuse strings and documents without a title)."""
        kwargs = {k: v for k, v in params.chat_template_kwargs.items() if k != "documents"}
        return dataclasses.replace(params, chat_template_kwargs=kwargs)

    def render_messages(self, messages, params):
        if not self._ours(params):
            return super().render_messages(messages, params)
        conversation, prompt = super().render_messages(messages, self._without_documents(params))
        return conversation, self._with_documents(conversation, prompt, params)

    async def render_messages_async(self, messages, params):
        if not self._ours(params):
            return await super().render_messages_async(messages, params)
        conversation, prompt = await super().render_messages_async(messages, self._without_documents(params))
        return conversation, self._with_documents(conversation, prompt, params)

    def _with_documents(self, conversation, prompt, params):
        kwargs = params.chat_template_kwargs
        docs = kwargs["documents"]
        if not isinstance(docs, list):
            raise ValueError("documents must be a list of strings or {text, title?} objects")
        if prompt.get("multi_modal_data"):
            raise ValueError("documents together with images, audio or video are not supported by ragkv")
        if kwargs.get("continue_final_message") or not kwargs.get("add_generation_prompt", True):
            raise ValueError("with documents the reply is a new assistant turn (add_generation_prompt, "
                             "no continue_final_message)")
        names = [f"documents[{i}]" for i in range(len(docs))]
        texts = [read_document(d, n) for d, n in zip(docs, names)]
        messages = [{"role": m["role"], "content": _content(m, f"messages[{i}]")} for i, m in enumerate(conversation)]
        if not messages or messages[-1]["role"] != "user" or not messages[-1]["content"].strip():
            raise ValueError(f"with documents the last message (messages[{len(messages) - 1}]) must be the "
                             "user's question")
        ids = self._template.chat(messages, texts, self._window, names).input_ids
        return parse_dec_only_prompt(ids)


def documents_as_objects(body: bytes) -> bytes:
    """A chat request body whose ``documents`` holds strings, with each string as {"text": string};
    any other body unchanged (the same object)."""
    try:
        req = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return body
    docs = req.get("documents") if isinstance(req, dict) else None
    if not isinstance(docs, list) or not any(isinstance(d, str) for d in docs):
        return body
    req["documents"] = [{"text": d} if isinstance(d, str) else d for d in docs]
    return json.dumps(req).encode()


class DocumentsMiddleware:
    """Pure ASGI: POST .../chat/completions bodies get their string documents as {"text": ...}."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].endswith("/chat/completions"):
            return await self.app(scope, receive, send)
        parts, message = [], {"more_body": True}
        while message.get("more_body"):
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            parts.append(message.get("body", b""))
        raw = b"".join(parts)
        body = documents_as_objects(raw)
        if body is not raw:
            headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
            scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        sent = False

        async def replay():
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)
