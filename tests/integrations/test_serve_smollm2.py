"""`ragkv serve` with the real SmolLM2 (the issue's "done when"), through the real `openai` client:
an answer from documents, a stream, cached tokens on a repeat, 8 concurrent clients, a 4xx error."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from integration_data import DOCS
from serve_server import ServeProcess

from ragkv.blend import BlendConfig
from ragkv.store import open_store

MODEL = "smollm2-135m"
ROWS = [json.loads(line) for line in (DOCS.parent / "questions.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_smollm2_done_when(tmp_path, smollm2):
    store, writes = f"disk://{tmp_path}/store", f"disk://{tmp_path}/requests?max_bytes=1G"
    server = ServeProcess(MODEL, store, "--threads", "1", "--write-store", writes, model_dtype="auto").start()
    try:
        c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=1800)

        def ask(row, **kw):
            return c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": row["question"]}],
                                             extra_body={"documents": row["contexts"]}, max_tokens=12, **kw)

        first, again = ask(ROWS[0]), ask(ROWS[0])
        assert first.usage.prompt_tokens_details.cached_tokens == 0 and first.model_extra["ragkv"]["misses"] == 3
        assert again.usage.prompt_tokens_details.cached_tokens > 0 and again.model_extra["ragkv"]["hits"] == 3
        # the same answer as the library over the same store (SmolLM2 in the same dtype)
        from ragkv.integrations.hf import BlendedGenerator

        model, tok = smollm2
        out = BlendedGenerator(model, tok, open_store(f"{store},{writes}"), BlendConfig(ratio=0.15)).generate(
            ROWS[0]["question"], ROWS[0]["contexts"], max_new_tokens=12)
        assert again.choices[0].message.content.strip() == out.text
        streamed = "".join(e.choices[0].delta.content or "" for e in ask(ROWS[0], stream=True) if e.choices)
        assert streamed == again.choices[0].message.content
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, ROWS[:8]))
        assert all(a.choices[0].finish_reason in ("stop", "length") and a.choices[0].message.content for a in answers)
        r = httpx.post(f"{server.url}/v1/chat/completions", content=b"{", timeout=60,
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        assert server.terminate() == 0
    finally:
        server.stop()
