"""`ragkv serve` against a hostile client and a careless operator (issue 34): real server processes on
loopback ports, driven over real sockets with httpx and the openai client.

- a failing request always gives its place in the queue back (2x --max-queue of them, then a good one)
- bad values are 400s naming the field, never 500s: seeds torch cannot take, lone surrogates, `n`
  that is not the integer 1, options that would be silently ignored (logit_bias, penalties)
- bodies: --max-body enforced before parsing (413), JSON only (415), so a web page cannot post one
- who may ask: --api-key (401 in OpenAI's shape; /health open; /metrics behind it unless
  --metrics-public), a Host allow-list on loopback binds (DNS rebinding), a warning on a public bind
- what a client may write: nothing into --store; request-computed K/V goes to a bounded write store
  under --write-policy, so clients never evict the precomputed corpus
- the layout of a prompt cannot be moved by what a message holds

The model is the tiny random Llama with SmolLM2's tokenizer (nothing here depends on answer quality).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest
from click.testing import CliRunner
from integration_data import DOCS
from redis_server import free_port
from serve_server import ServeProcess

from ragkv.cli import main
from ragkv.store import open_store

MODEL = "tiny"
QUEUE = 2  # --max-queue of the main server: a place never given back shows after 2 requests
KEY = "sk-test-" + uuid.uuid4().hex
LONG = "word " * 2500  # more tokens than the tiny model's window (2048)


def _serve(model_dir, store: str, *args: str, env: dict | None = None) -> ServeProcess:
    return ServeProcess(str(model_dir), store, "--served-model-name", MODEL, *args, env=env).start()


@pytest.fixture(scope="module")
def server(tiny_smollm2_dir, tmp_path_factory):
    """Every option at its default but --max-queue."""
    root = tmp_path_factory.mktemp("hostile")
    proc = _serve(tiny_smollm2_dir, f"disk://{root}/store", "--max-queue", str(QUEUE))
    proc.store_dir = root / "store"
    yield proc
    proc.stop()


def chat(question: str = "Hi", **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": 4, **extra}


def post(server, body, headers: dict | None = None, path: str = "/v1/chat/completions", **kw) -> httpx.Response:
    """POST ``body`` (a dict is sent as JSON with ASCII escapes, so lone surrogates travel as \\udXXX)."""
    content = json.dumps(body).encode() if isinstance(body, dict) else body
    headers = {"Content-Type": "application/json", **(headers or {})}
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=120, **kw)


def fresh_docs(n: int, words: int = 60) -> list[str]:
    tag = uuid.uuid4().hex[:8]
    return [f"Note {tag}-{i}. " + " ".join(f"w{tag}{i}x{j}" for j in range(words)) for i in range(n)]


def assert_error(r: httpx.Response, status: int, param=None, code=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert (err["param"], err["code"]) == (param, code), err
    assert "Traceback" not in r.text
    return err


def queue_depth(server) -> int:
    return httpx.get(f"{server.url}/health", timeout=10).json()["queue_depth"]


# ---------------------------------------------------------------------------- failing requests, the queue

# each fails; the last two only after admission (while the prompt is built on the model thread)
FAILING = [
    (chat(temperature=0.5, seed=2**64), "seed"),
    (chat(temperature=0.5, seed=-(2**63) - 1), "seed"),
    (chat("\ud800 who?"), "messages[0].content"),
    (chat(documents=["fine", "bad \udc00 doc"]), "documents[1]"),
    (chat(max_tokens=5000), "max_tokens"),
    (chat(documents=["short", LONG]), "documents"),
]


def err_code(param: str):
    return "context_length_exceeded" if param in ("max_tokens", "documents") else None


def test_failing_requests_give_their_place_back(server):
    """2x --max-queue of every kind of failing request, then a good one is answered: no request keeps
    its place (a seed torch could not take once leaked it for good: 2 of them and every request got 429)."""
    for body, param in FAILING:
        for _ in range(2 * QUEUE):
            err = assert_error(post(server, body), 400, param, err_code(param))
            assert param.split("[")[0] in err["message"]
    assert queue_depth(server) == 0
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert r.usage.completion_tokens >= 1
    m = server.metrics()
    assert m['ragkv_requests_total{status="400"}'] >= len(FAILING) * 2 * QUEUE
    assert m.get('ragkv_requests_total{status="429"}', 0) == 0 and m.get('ragkv_requests_total{status="500"}', 0) == 0


def test_a_request_that_raises_anywhere_gives_its_place_back(tiny_smollm2, monkeypatch):
    """Fault injected where the old route could not release: building the request's generation
    raises (a 500); 2x max_queue of them, then a good request is still admitted."""
    from fastapi.testclient import TestClient

    from ragkv.blend import BlendEngine
    from ragkv.integrations.serve import app as app_module

    model, tok = tiny_smollm2
    app = app_module.create_app(BlendEngine(model, tok, open_store("memory")), MODEL, max_queue=QUEUE)
    real = app_module.Generation

    class Exploding(real):
        def __init__(self, *a, **kw):
            raise RuntimeError("injected")

    with TestClient(app, raise_server_exceptions=False) as tc:
        monkeypatch.setattr(app_module, "Generation", Exploding)
        for stream in (False, True):
            for _ in range(2 * QUEUE):
                r = tc.post("/v1/chat/completions", json=chat(stream=stream))
                assert r.status_code == 500 and "injected" not in r.text
        assert tc.get("/health").json()["queue_depth"] == 0
        monkeypatch.setattr(app_module, "Generation", real)
        r = tc.post("/v1/chat/completions", json=chat())
        assert r.status_code == 200, r.text


def test_a_tiny_temperature_samples_the_top_token(server):
    """temperature 1e-300 is valid (OpenAI: 0..2): it samples the most likely token, as greedy does
    (it was a 500: softmax(logits / 1e-300) in float32 is NaN)."""
    greedy = post(server, chat("Name a colour.", max_tokens=6, temperature=0))
    tiny = post(server, chat("Name a colour.", max_tokens=6, temperature=1e-300, seed=7))
    assert greedy.status_code == 200 and tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["message"]["content"] == greedy.json()["choices"][0]["message"]["content"]


# ---------------------------------------------------------------------------- what a request may say

REFUSED = [
    (chat(n=True), "n", None),
    (chat(n=1.0), "n", None),
    (chat(n="1"), "n", None),
    (chat(logit_bias={"42": 5}), "logit_bias", "unsupported_parameter"),
    (chat(presence_penalty=0.5), "presence_penalty", "unsupported_parameter"),
    (chat(frequency_penalty=-1.0), "frequency_penalty", "unsupported_parameter"),
    (chat(frequency_penalty=False), "frequency_penalty", "unsupported_parameter"),
    (chat(top_logprobs=3), "top_logprobs", "unsupported_parameter"),
    (chat(seed=2**64), "seed", None),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "a\ud800"}]}]},
     "messages[0].content[0].text", None),
    (chat(documents=[{"title": "\udfff", "text": "a doc"}]), "documents[0].title", None),
    (chat(documents=[{"text": "a doc \ud800"}]), "documents[0].text", None),
    (chat(stop=["ok", "\ud800"]), "stop[1]", None),
]


@pytest.mark.parametrize("body,param,code", REFUSED, ids=[p for _, p, _ in REFUSED])
def test_requests_that_would_be_misread_are_refused(server, body, param, code):
    err = assert_error(post(server, body), 400, param, code)
    assert param.split("[")[0] in err["message"]


def test_no_op_values_of_unsupported_options_are_accepted(server):
    r = post(server, chat(n=1, logit_bias={}, presence_penalty=0, frequency_penalty=0.0, top_logprobs=0))
    assert r.status_code == 200, r.text


def test_the_question_marker_in_a_message_cannot_move_the_layout(server, tiny_smollm2):
    """ragkv once split the chat template at a fixed marker; a history message holding it moved the
    documents and the question into an earlier turn. The marker is now drawn per request."""
    from ragkv.blend import BlendEngine
    from ragkv.integrations.serve.chat import build_prompt
    from ragkv.integrations.serve.protocol import parse_request

    model, tok = tiny_smollm2
    engine = BlendEngine(model, tok, open_store("memory"))
    hostile = "before \x00RAGKV-QUESTION\x00 after"
    body = {"model": MODEL, "messages": [{"role": "user", "content": hostile}, {"role": "assistant", "content": "ok"},
                                          {"role": "user", "content": "Who designed the lighthouse?"}],
            "documents": ["The lighthouse was designed by Agnes Tolland."], "max_tokens": 4}
    prompt = build_prompt(engine, parse_request(json.dumps(body).encode(), MODEL))
    prefix, suffix = tok.decode(prompt.prefix_ids), tok.decode(prompt.suffix_ids)
    assert hostile in prefix and prefix.endswith("<|im_start|>assistant\nok<|im_end|>\n<|im_start|>user\n")
    assert "Who designed the lighthouse?" in suffix and "RAGKV" not in suffix and "after" not in suffix
    assert [tok.decode(c) for c in prompt.chunk_ids] == ["The lighthouse was designed by Agnes Tolland.\n\n"]
    r = post(server, body)  # the server builds the same layout
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == prompt.num_tokens


STRICT_TEMPLATE = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                   "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
                   "{% endif %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]")


@pytest.mark.parametrize("documents", [None, ["The lighthouse was designed by Agnes Tolland."]])
def test_messages_the_chat_template_refuses_are_a_400(tiny_smollm2, monkeypatch, documents):
    """A template's own raise_exception (Mistral's "roles must alternate") was a 500 with a traceback."""
    from fastapi.testclient import TestClient

    from ragkv.blend import BlendEngine
    from ragkv.integrations.serve import app as app_module

    model, tok = tiny_smollm2
    monkeypatch.setattr(tok, "chat_template", STRICT_TEMPLATE)
    app = app_module.create_app(BlendEngine(model, tok, open_store("memory")), MODEL, max_queue=QUEUE)
    body = {"model": MODEL, "max_tokens": 2, **({"documents": documents} if documents else {}),
            "messages": [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Who designed it?"}]}
    with TestClient(app, raise_server_exceptions=False) as tc:
        r = tc.post("/v1/chat/completions", json=body)
        err = assert_error(r, 400, "messages")
        assert "roles must alternate" in err["message"]
        body["messages"] = body["messages"][1:]
        assert tc.post("/v1/chat/completions", json=body).status_code == 200


# ---------------------------------------------------------------------------- bodies

def test_a_body_over_the_limit_is_refused_before_it_is_read(server):
    """--max-body (default 2M): 413 from the Content-Length, or once the bytes read pass it without
    one (chunked); a 3 MB body was tokenized on the model thread before (400 after seconds)."""
    big = json.dumps(chat("x " * (3 << 19))).encode()  # ~3 MB
    t0 = time.monotonic()
    err = assert_error(post(server, big), 413, None, "request_too_large")
    assert "--max-body" in err["message"] and str(2 << 20) in err["message"]

    def chunks():
        for i in range(0, len(big), 1 << 16):
            yield big[i : i + (1 << 16)]

    assert_error(post(server, chunks()), 413, None, "request_too_large")
    assert time.monotonic() - t0 < 60  # (not a timing target: only that nothing waited on tokenizing)
    assert queue_depth(server) == 0 and post(server, chat()).status_code == 200


def test_only_json_bodies_are_taken(server):
    """A web page can POST text/plain cross-origin without a preflight; it is refused (415) before
    anything is computed or stored."""
    before = server.metrics()
    body = json.dumps(chat(documents=fresh_docs(2))).encode()
    for headers in ({"Content-Type": "text/plain", "Origin": "http://evil.example"},
                    {"Content-Type": "application/x-www-form-urlencoded"}, {"Content-Type": ""}):
        r = httpx.post(f"{server.url}/v1/chat/completions", content=body, headers=headers, timeout=30)
        err = assert_error(r, 415, None, "unsupported_media_type")
        assert "application/json" in err["message"]
    after = server.metrics()
    assert after["ragkv_chunk_misses_total"] == before["ragkv_chunk_misses_total"]
    assert after['ragkv_requests_total{status="415"}'] - before.get('ragkv_requests_total{status="415"}', 0) == 3
    r = post(server, chat(), headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("host", ["evil.example", f"evil.example:{8000}", "127.0.0.1.evil.example", ""])
def test_a_loopback_server_answers_only_loopback_host_names(server, host):
    """DNS rebinding: a page on evil.example whose name resolves to 127.0.0.1 sends Host: evil.example."""
    for method, path in (("GET", "/v1/models"), ("GET", "/health"), ("POST", "/v1/chat/completions")):
        r = httpx.request(method, f"{server.url}{path}", headers={"Host": host, "Content-Type": "application/json"},
                          content=json.dumps(chat()).encode() if method == "POST" else None, timeout=30)
        err = assert_error(r, 403, None, "host_not_allowed")
        assert "--allow-host" in err["message"]


def test_loopback_host_names_are_answered(server):
    for host in (f"127.0.0.1:{server.port}", f"localhost:{server.port}", f"[::1]:{server.port}", "LOCALHOST"):
        assert httpx.get(f"{server.url}/v1/models", headers={"Host": host}, timeout=30).status_code == 200


def test_a_loopback_bind_answers_its_own_address():
    """--host 127.0.0.2 is loopback; requests naming it were refused (403)."""
    from ragkv.integrations.serve.guard import allowed_hosts, host_name

    names = allowed_hosts("127.0.0.2", ["proxy.internal"])
    assert {"127.0.0.2", "localhost", "127.0.0.1", "::1", "proxy.internal"} <= set(names)
    assert host_name("127.0.0.2:8000") in names and "evil.example" not in names
    assert allowed_hosts("0.0.0.0") is None and allowed_hosts("0.0.0.0", ["a.example"]) == ["a.example"]


def test_a_content_length_that_is_not_a_number_is_a_400():
    """It was answered 413 "too large". (uvicorn refuses most malformed lengths itself; the guard is
    also mounted under other ASGI servers.)"""
    import asyncio

    from ragkv.integrations.serve.guard import Guard

    sent = []

    async def app(scope, receive, send):  # never reached
        raise AssertionError("the route ran")

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"12abc")]}
    asyncio.run(Guard(app)(scope, receive, send))
    assert sent[0]["status"] == 400
    assert "Content-Length" in json.loads(sent[1]["body"])["error"]["message"]


# ---------------------------------------------------------------------------- who may ask

@pytest.fixture(scope="module")
def keyed(tiny_smollm2_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("keyed")
    proc = _serve(tiny_smollm2_dir, f"disk://{root}/store", "--allow-host", "ragkv.internal",
                  env={"RAGKV_API_KEY": KEY})
    yield proc
    proc.stop()


def test_without_the_key_nothing_but_health(keyed):
    body = chat(documents=fresh_docs(1))
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
                    {"Authorization": KEY}, {"Authorization": f"Bearer {KEY}x"}):
        r = post(keyed, body, headers=headers)
        err = assert_error(r, 401, None, "invalid_api_key")
        assert r.headers["www-authenticate"] == "Bearer" and err["type"] == "invalid_request_error"
        assert KEY not in r.text
    for path in ("/v1/models", f"/v1/models/{MODEL}", "/metrics", "/v1/nothing"):
        assert_error(httpx.get(f"{keyed.url}{path}", timeout=30), 401, None, "invalid_api_key")
    assert httpx.get(f"{keyed.url}/health", timeout=30).json()["status"] == "ok"
    auth = {"Authorization": f"Bearer {KEY}"}
    m = keyed.metrics(headers=auth)
    assert m["ragkv_chunk_misses_total"] == 0 and m['ragkv_requests_total{status="401"}'] == 5
    assert KEY not in keyed.output()


def test_the_openai_client_with_and_without_the_key(keyed):
    bad = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="sk-wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert e.value.body["code"] == "invalid_api_key" and "RAGKV_API_KEY" in e.value.body["message"]
    good = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    assert [m.id for m in good.models.list().data] == [MODEL]
    r = good.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                     extra_body={"documents": fresh_docs(1)})
    assert r.model_extra["ragkv"]["misses"] == 1


def test_allow_host_adds_a_name(keyed):
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(f"{keyed.url}/v1/models", headers={**auth, "Host": "ragkv.internal:443"}).status_code == 200
    assert_error(httpx.get(f"{keyed.url}/v1/models", headers={**auth, "Host": "other.internal"}), 403, None,
                 "host_not_allowed")


def test_public_bind_with_key_and_public_metrics(tiny_smollm2_dir, tmp_path):
    """--host 0.0.0.0 with a key: no warning, any Host (a public name is the point), /metrics open with
    --metrics-public, everything else behind the key."""
    proc = _serve(tiny_smollm2_dir, f"disk://{tmp_path}/store", "--host", "0.0.0.0", "--api-key", KEY,
                  "--metrics-public")
    try:
        assert "ragkv_queue_depth" in httpx.get(f"{proc.url}/metrics", headers={"Host": "ragkv.example.com"}).text
        assert_error(post(proc, chat(), headers={"Host": "ragkv.example.com"}), 401, None, "invalid_api_key")
        assert post(proc, chat(), headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert "without an API key" not in proc.output()
    finally:
        proc.stop()


def test_public_bind_without_key_warns(tiny_smollm2_dir, tmp_path):
    proc = _serve(tiny_smollm2_dir, f"disk://{tmp_path}/store", "--host", "0.0.0.0")
    try:
        log = proc.output()
        assert "WARNING" in log and "0.0.0.0 without an API key" in log and "RAGKV_API_KEY" in log
    finally:
        proc.stop()


def test_an_empty_api_key_is_refused(tiny_smollm2_dir, tmp_path):
    """RAGKV_API_KEY set but blank is a mistake, not "no key" (a subprocess: a server that started
    anyway would never return)."""
    cmd = [sys.executable, "-m", "ragkv.cli", "serve", "--store", f"disk://{tmp_path}/s", "--model",
           str(tiny_smollm2_dir), "--port", str(free_port())]
    r = subprocess.run(cmd, env={**os.environ, "RAGKV_API_KEY": " "}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--api-key" in r.stderr and "empty" in r.stderr, r.stderr
    assert not (tmp_path / "s").exists()


# ---------------------------------------------------------------------------- what a client may write

def _keys(store_dir: Path) -> set[str]:
    return {p.name for p in (store_dir / "objects").glob("*/*.kv")}


def test_client_writes_never_evict_the_corpus(tiny_smollm2_dir, tmp_path):
    """A corpus precomputed into a bounded disk store; clients then send documents it lacks, many more
    bytes of them than the store's slack. Every corpus entry stays (they went into the corpus store
    and evicted it by LRU before), and the corpus is still hit."""
    corpus = tmp_path / "corpus"
    r = CliRunner().invoke(main, ["precompute", *map(str, sorted(DOCS.glob("*.md"))), "--store", f"disk://{corpus}",
                                  "--model", str(tiny_smollm2_dir), "--model-dtype", "float32", "--no-progress",
                                  "--json"])
    assert r.exit_code == 0, r.output
    stored = _keys(corpus)
    size = sum(p.stat().st_size for p in (corpus / "objects").glob("*/*.kv"))
    budget = size + (1 << 20)  # 1 MiB of slack
    proc = _serve(tiny_smollm2_dir, f"disk://{corpus}?max_bytes={budget}")
    try:
        c = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0, timeout=120)
        for _ in range(8):  # 8 x 3 documents of ~100 tokens, 2 entries each at ~1 KiB per token: ~5 MiB
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                      extra_body={"documents": fresh_docs(3, words=40)})
        assert _keys(corpus) == stored  # not one corpus entry evicted, nothing added
        m = proc.metrics()
        assert m["ragkv_store_write_bytes_total"] > budget - size  # the clients wrote more than the slack
        docs = [p.read_text() for p in sorted(DOCS.glob("*.md"))]
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                      extra_body={"documents": docs[:2]})
        assert r.model_extra["ragkv"]["hits"] == 2
    finally:
        proc.stop()


def test_write_policy_none_keeps_nothing(tiny_smollm2_dir, tmp_path):
    proc = _serve(tiny_smollm2_dir, f"disk://{tmp_path}/store", "--write-policy", "none")
    try:
        docs = fresh_docs(2)
        stats = [post(proc, chat(documents=docs)).json()["ragkv"] for _ in range(2)]
        assert [(s["hits"], s["misses"]) for s in stats] == [(0, 2), (0, 2)]  # computed for each request, kept nowhere
        m = proc.metrics()
        assert m["ragkv_store_writes_total"] == 0 and m["ragkv_store_writes_refused_total"] > 0
        assert _keys(tmp_path / "store") == set()
    finally:
        proc.stop()


def test_write_quota_bounds_what_is_kept(tiny_smollm2_dir, tmp_path):
    quota = 300 << 10
    proc = _serve(tiny_smollm2_dir, f"disk://{tmp_path}/store", "--write-policy", "quota", "--write-quota", "300K",
                  "--write-window", "3600", "--write-store", f"disk://{tmp_path}/requests?max_bytes=1G")
    try:
        first = fresh_docs(1, words=20)
        assert post(proc, chat(documents=first)).json()["ragkv"]["misses"] == 1
        for _ in range(4):
            assert post(proc, chat(documents=fresh_docs(3, words=40))).status_code == 200
        m = proc.metrics()
        assert 0 < m["ragkv_store_write_bytes_total"] <= quota and m["ragkv_store_writes_refused_total"] > 0
        kept = sum(p.stat().st_size for p in (tmp_path / "requests" / "objects").glob("*/*.kv"))
        assert kept == m["ragkv_store_write_bytes_total"]
        assert _keys(tmp_path / "store") == set()  # --store is only read
        assert post(proc, chat(documents=first)).json()["ragkv"]["hits"] == 1  # kept within the quota: a hit
    finally:
        proc.stop()


@pytest.mark.parametrize("write_store,match", [
    ("disk://{tmp}/corpus?max_bytes=1G", "also in --store"),
    ("memory,disk://{tmp}/corpus", "also in --store"),
    ("disk://{tmp}/requests?max_bytes=none", "unbounded"),
    ("memory://?max_bytes=none", "unbounded"),
    ("redis://127.0.0.1:6379/0?namespace=req", "ttl="),
])
def test_a_write_store_that_could_hurt_the_corpus_is_refused(tmp_path, write_store, match):
    open_store(f"disk://{tmp_path}/corpus").close()
    r = CliRunner().invoke(main, ["serve", "--store", f"disk://{tmp_path}/corpus",
                                  "--write-store", write_store.format(tmp=tmp_path)])
    assert r.exit_code == 2 and "--write-store" in r.output and match in r.output, r.output


def test_a_missing_corpus_store_is_an_error_not_created(tmp_path):
    """--store is only read: a mistyped path was created empty, and the server ran with no hits."""
    r = CliRunner().invoke(main, ["serve", "--store", f"disk://{tmp_path}/corpsu"])
    assert r.exit_code == 1 and "corpsu: no such directory" in r.output, r.output
    assert not (tmp_path / "corpsu").exists()
