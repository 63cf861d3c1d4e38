"""`ragkv serve` as a real process on a free loopback port, called with the real `openai` client
(and httpx for raw bodies): answers, streaming, cached tokens on a repeat, 8 concurrent clients,
OpenAI-style errors, client disconnects. The model is a tiny random Llama with SmolLM2's tokenizer
and chat template (the plumbing is the same as with SmolLM2: tests/integrations/test_serve_smollm2.py)."""

from __future__ import annotations

import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from integration_data import DOCS
from serve_server import ServeProcess

from ragkv.blend import BlendConfig
from ragkv.blend.config import CHAT_SELECTOR
from ragkv.store import open_store

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_smollm2_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-store")
    store, writes = f"disk://{root}/corpus", f"disk://{root}/requests?max_bytes=1G"
    # chunks the corpus store lacks are computed and kept in the write store (--store is only read)
    proc = ServeProcess(str(tiny_smollm2_dir), store, "--served-model-name", MODEL, "--write-store", writes).start()
    proc.store, proc.write_store = store, writes
    yield proc
    proc.stop()


def client(server, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120, **kw)


def fresh_docs(n: int = 3) -> list[str]:
    """Documents no earlier request stored (a unique line in each)."""
    tag = uuid.uuid4().hex[:8]
    return [f"Note {tag}-{i}.\n{p.read_text()}" for i, p in enumerate(sorted(DOCS.glob("*.md"))[:n])]


def ask(c, question: str, documents=None, **kw):
    extra = {"documents": documents} if documents is not None else None
    return c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                     extra_body=extra, temperature=0, **kw)


def test_models_health_and_answer_with_documents(server, tiny_smollm2):
    c = client(server)
    assert [m.id for m in c.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    docs = fresh_docs()
    r = ask(c, "Who designed the lighthouse?", docs, max_tokens=8)
    stats = r.model_extra["ragkv"]
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens <= 8
    assert (stats["chunks"], stats["misses"], stats["hits"]) == (3, 3, 0)
    _, tok = tiny_smollm2
    doc_tokens = sum(len(tok(d.strip() + "\n\n", add_special_tokens=False)["input_ids"]) for d in docs)
    assert r.usage.prompt_tokens > doc_tokens and r.usage.prompt_tokens == stats["prompt_tokens"]
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # nothing was stored before


def test_repeat_reports_cached_tokens_and_matches_the_library(server, tiny_smollm2):
    c = client(server)
    docs = fresh_docs()
    first = ask(c, "How far can the light be seen?", docs, max_tokens=8)
    again = ask(c, "How far can the light be seen?", docs, max_tokens=8)
    s1, s2 = first.model_extra["ragkv"], again.model_extra["ragkv"]
    assert (s1["misses"], s2["hits"], s2["misses"]) == (3, 3, 0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    # every chunk token came from the store; the recomputed ones (ratio 0.15) do not count
    assert cached == s2["reused_tokens"] - s2["recomputed_tokens"] > 0
    assert s2["recomputed_tokens"] > 0 and s2["ratio"] == 0.15
    assert s2["selector"] == CHAT_SELECTOR  # (ragkv serve's default)
    # the same store read in this process by the library, with serve's settings, gives the same greedy answer
    from ragkv.integrations.hf import BlendedGenerator

    model, tok = tiny_smollm2
    gen = BlendedGenerator(model, tok, open_store(f"{server.store},{server.write_store}"),
                           BlendConfig(ratio=0.15, selector=CHAT_SELECTOR))
    out = gen.generate("How far can the light be seen?", docs, max_new_tokens=8)
    assert out.hits == 3 and again.choices[0].message.content.strip() == out.text


def test_plain_chat_is_hf_generate(server, tiny_smollm2):
    model, tok = tiny_smollm2
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name a colour."}]
    r = client(server).chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert r.model_extra["ragkv"]["blended"] is False and r.usage.prompt_tokens_details.cached_tokens == 0
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    assert r.usage.prompt_tokens == ids.shape[1]
    out = model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=tok.pad_token_id)
    assert r.choices[0].message.content == tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_llama_index_openai_like_sends_documents(server):
    """README's recipe: LlamaIndex's OpenAILike pointed at the server, retrieved text as `documents`."""
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(model=MODEL, api_base=f"{server.url}/v1", api_key="unused", is_chat_model=True,
                     context_window=2048, max_tokens=8, temperature=0, max_retries=0, timeout=120)
    docs, question = fresh_docs(), "Who designed the lighthouse?"
    messages = [ChatMessage(role="user", content=question)]
    first = llm.chat(messages, extra_body={"documents": docs})
    again = llm.chat(messages, extra_body={"documents": docs})
    s1, s2 = first.raw.model_extra["ragkv"], again.raw.model_extra["ragkv"]
    assert (s1["chunks"], s1["misses"], s2["hits"], s2["misses"]) == (3, 3, 3, 0)
    assert again.raw.usage.prompt_tokens_details.cached_tokens > 0
    # the same request from the plain openai client gets the same answer
    assert again.message.content == ask(client(server), question, docs, max_tokens=8).choices[0].message.content
    streamed = "".join(part.delta or "" for part in llm.stream_chat(messages, extra_body={"documents": docs}))
    assert streamed == again.message.content


def test_streaming_equals_the_answer(server):
    c = client(server)
    docs = fresh_docs(2)
    whole = ask(c, "What is hooch?", docs, max_tokens=12)
    events = list(ask(c, "What is hooch?", docs, max_tokens=12, stream=True, stream_options={"include_usage": True}))
    assert all(e.object == "chat.completion.chunk" for e in events)
    assert events[0].choices[0].delta.role == "assistant"
    text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
    assert text == whole.choices[0].message.content
    final = [e for e in events if e.choices and e.choices[0].finish_reason]
    assert len(final) == 1 and final[0].model_extra["ragkv"]["hits"] == 2
    assert events[-1].choices == [] and events[-1].usage.prompt_tokens_details.cached_tokens > 0
    assert events[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_sse_wire_format_ends_with_done(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_eight_concurrent_clients(server):
    rows = [json.loads(line) for line in (DOCS.parent / "questions.jsonl").read_text().splitlines()][:8]
    c = client(server)
    # answered one at a time first (also stores every chunk), then all at once
    alone = [ask(c, r["question"], r["contexts"], max_tokens=24).choices[0].message.content for r in rows]
    depths, done = [], threading.Event()

    def watch():
        while not done.is_set():
            depths.append(httpx.get(f"{server.url}/health", timeout=10).json()["queue_depth"])
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda r: ask(client(server), r["question"], r["contexts"], max_tokens=24), rows))
    finally:
        done.set()
        watcher.join()
    assert [r.choices[0].message.content for r in results] == alone  # nothing mixed up between requests
    assert all(r.model_extra["ragkv"]["hits"] == len(row["contexts"]) for r, row in zip(results, rows))
    assert max(depths) >= 2  # they really were in the server at the same time
    assert httpx.get(f"{server.url}/health").json()["queue_depth"] == 0


LONG = "word " * 2500  # more tokens than the tiny model's window (2048)
ERRORS = [
    (b"{not json", 400, None, "invalid_json"),
    (b"[1, 2]", 400, None, None),
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "model", None),
    ({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 404, "model", "model_not_found"),
    ({"model": MODEL}, 400, "messages", None),
    ({"model": MODEL, "messages": []}, 400, "messages", None),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", None),
    ({"model": MODEL, "messages": [{"role": "user"}]}, 400, "messages[0].content", None),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0]", None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens", None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}, 400, "max_tokens",
     "context_length_exceeded"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 7}, 400, "temperature", None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n", None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400,
     "tools", "unsupported_parameter"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "documents": "one string"}, 400,
     "documents", None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "documents": ["ok", " "]}, 400,
     "documents[1]", None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "documents": [{"txt": "x"}]}, 400,
     "documents[0]", None),
    ({"model": MODEL, "messages": [{"role": "assistant", "content": "hi"}], "documents": ["a doc"]}, 400,
     "messages[0].role", None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "documents": ["short", LONG]}, 400,
     "documents", "context_length_exceeded"),
]


@pytest.mark.parametrize("body,status,param,code", ERRORS)
def test_bad_requests_get_openai_errors(server, body, status, param, code):
    kw = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, **kw)
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert (err["param"], err["code"]) == (param, code)
    if param:
        assert param.split("[")[0] in err["message"]  # the message names the problem
    if param == "documents" and code:
        assert "documents[1]" in err["message"] and "window" in err["message"]
    assert "Traceback" not in r.text


def test_openai_client_raises_the_error(server):
    c = client(server)
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert "gpt-4o" in e.value.body["message"] and e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        ask(c, "hi", ["fine", LONG])
    assert "documents[1]" in e.value.body["message"]
    r = httpx.get(f"{server.url}/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found"


def _wait_metric(server, name: str, value: float, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = server.metrics()
        if m[name] >= value:
            return m
        time.sleep(0.1)
    raise AssertionError(f"{name} did not reach {value}: {server.metrics()}")


def _settled(server) -> dict:
    """Metrics once no token is being generated any more."""
    m = server.metrics()
    while True:
        time.sleep(0.5)
        again = server.metrics()
        if again["ragkv_completion_tokens_total"] == m["ragkv_completion_tokens_total"]:
            return again
        m = again


def test_client_disconnect_stops_generation(server):
    long = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 1900}
    before = _settled(server)
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**long, "stream": True}, timeout=60) as r:
        lines = r.iter_lines()
        [next(lines) for _ in range(6)]  # 3 events: the stream is under way
    after = _wait_metric(server, "ragkv_requests_cancelled_total", before["ragkv_requests_cancelled_total"] + 1)
    after = _settled(server)
    generated = after["ragkv_completion_tokens_total"] - before["ragkv_completion_tokens_total"]
    assert 1 <= generated < 1900  # stopped early, and stays stopped
    assert after["ragkv_queue_depth"] == 0
    # a non-streaming request whose client gives up
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=long, timeout=1.0)
    _wait_metric(server, "ragkv_requests_cancelled_total", after["ragkv_requests_cancelled_total"] + 1)
    final = _settled(server)
    assert final["ragkv_completion_tokens_total"] - after["ragkv_completion_tokens_total"] < 1900
    assert final["ragkv_queue_depth"] == 0


def test_metrics_are_prometheus_text(server):
    c, docs = client(server), fresh_docs(1)
    for _ in range(2):
        ask(c, "hi", docs, max_tokens=2)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("ragkv_requests_total", "ragkv_chunk_hits_total", "ragkv_chunk_misses_total",
                 "ragkv_recomputed_tokens_total", "ragkv_ttft_seconds", "ragkv_queue_depth"):
        assert f"# TYPE {name} " in text
    m = server.metrics()
    assert m['ragkv_ttft_seconds_bucket{le="+Inf"}'] == m["ragkv_ttft_seconds_count"] > 0
    assert m['ragkv_requests_total{status="200"}'] > 0 and m["ragkv_chunk_hits_total"] > 0


def test_server_errors_never_leak_a_traceback(tiny_smollm2):
    """An engine that fails inside a request (fault injected: the prefill raises) -> a 500 that says
    only that; the details stay in the server log."""
    from fastapi.testclient import TestClient

    from ragkv.blend import BlendEngine
    from ragkv.integrations.serve import create_app

    class Broken(BlendEngine):
        def prefill_prompt(self, prompt, ratio=None):
            raise RuntimeError("secret internal detail")

    model, tok = tiny_smollm2
    app = create_app(Broken(model, tok, open_store("memory")), MODEL)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "documents": ["a doc"]}
    with TestClient(app, raise_server_exceptions=False) as tc:
        for stream in (False, True):
            r = tc.post("/v1/chat/completions", json={**body, "stream": stream})
            assert r.status_code == 500
            assert r.json()["error"]["type"] == "server_error"
            assert "secret" not in r.text and "Traceback" not in r.text
        assert tc.get("/health").json()["queue_depth"] == 0  # the failed requests gave their places back


def test_cli_finds_serve_through_its_entry_point():
    from click.testing import CliRunner

    from ragkv.cli import main

    runner = CliRunner()
    listing = runner.invoke(main, ["--help"])
    assert listing.exit_code == 0 and "serve" in listing.output
    help_ = runner.invoke(main, ["serve", "--help"])
    assert help_.exit_code == 0 and "--max-queue" in help_.output and "--ratio" in help_.output
    for option in ("--api-key", "--metrics-public", "--allow-host", "--max-body", "--write-policy", "--write-quota",
                   "--write-window", "--write-store"):
        assert option in help_.output
    bad = runner.invoke(main, ["serve", "--store", "memory", "--ratio", "2"])
    assert bad.exit_code == 2 and "--ratio" in bad.output and "'2'" in bad.output
    bad = runner.invoke(main, ["serve", "--store", "nosuch://x"])
    assert bad.exit_code == 2 and "--store" in bad.output
