"""`vllm serve` (a real server process: vLLM's OpenAI server, its default multi-process engine,
prefix caching and chunked prefill on) with ragkv's connector over a real Redis store, asked over HTTP
by the real openai client with the chunks as ``documents``: the command of examples/vllm_serve.py.

The chunks are precomputed into Redis by the transformers engine in another process (as `ragkv
precompute` does), so a chat request's documents are hits only if ragkv's renderer laid them out as
that engine's chunks. The same body goes to `ragkv serve` over the same store. Last, Redis goes down:
the server answers from vLLM's own prefill."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_data import DOCS, DTYPE

ROOT = Path(__file__).resolve().parents[2]
QUESTION = "Who built the lighthouse at Kerran Point?"
BODY = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 24, "temperature": 0,
        "documents": DOCS[:3]}  # strings, as README's LlamaIndex recipe sends them


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(url, model_dir, redis server): `vllm serve` over a Redis store holding DOCS[:3]."""
    from redis_server import IN_CI, RedisServer, free_port

    if shutil.which("redis-server") is None:
        if IN_CI:
            pytest.fail("redis-server is not installed")
        pytest.skip("redis-server not on PATH")
    sys.path.insert(0, str(ROOT / "examples"))
    from vllm_serve import server_command, wait_ready

    from ragkv.gguf import convert_smollm2
    from ragkv.integrations.vllm.precompute import precompute

    redis = RedisServer().start()
    model_dir = str(convert_smollm2())
    precompute(model_dir, DTYPE, redis.url, [(QUESTION, DOCS[:3])])
    port = free_port()
    cmd, env = server_command(model_dir, port, redis.url, 0.15, max_model_len=2048)
    log = tmp_path_factory.mktemp("vllm-serve") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env={**env, "OMP_NUM_THREADS": "1"}, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_ready(url, proc, 900)
        except SystemExit as e:
            pytest.fail(f"{e}\n{log.read_text()[-4000:]}")
        yield url, model_dir, redis
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        redis.stop()


def ragkv_info(response) -> dict:
    return (response.model_extra.get("kv_transfer_params") or {}).get("ragkv") or {}


def test_openai_client_chat_with_documents(served):
    from openai import OpenAI

    url, model, _ = served
    client = OpenAI(base_url=url + "/v1", api_key="unused")
    out = client.chat.completions.create(model=model, **{k: BODY[k] for k in ("messages", "max_tokens", "temperature")},
                                         extra_body={"documents": BODY["documents"]})
    info = ragkv_info(out)
    assert info["recognised"] and info["offered"] and info["hits"] == 3, info
    assert "Ada Morrow" in out.choices[0].message.content
    # documents as objects (vLLM's own type), with a title, streamed
    docs = [{"text": DOCS[2]}, {"title": "The lighthouse", "text": DOCS[0]}, DOCS[1]]
    stream = client.chat.completions.create(model=model, messages=BODY["messages"], max_tokens=24, temperature=0,
                                            stream=True, extra_body={"documents": docs})
    assert "Ada Morrow" in "".join(e.choices[0].delta.content or "" for e in stream if e.choices)


def test_the_same_body_against_ragkv_serve(served):
    """The request body `vllm serve` answered, sent as it is to `ragkv serve` over the same store."""
    import httpx
    from serve_server import ServeProcess

    url, model, redis = served
    body = {"model": model, **BODY}
    vllm_reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    ragkv = ServeProcess(model, redis.url, "--served-model-name", model).start()
    try:
        reply = httpx.post(ragkv.url + "/v1/chat/completions", json=body, timeout=600)
    finally:
        ragkv.stop()
    assert vllm_reply.status_code == reply.status_code == 200, (vllm_reply.text, reply.text)
    for r in (vllm_reply, reply):
        assert "Ada Morrow" in r.json()["choices"][0]["message"]["content"]
    assert reply.json()["ragkv"]["hits"] == 3  # (ragkv serve reports its own stats)


def test_readme_llama_index_recipe(served):
    """README's LlamaIndex OpenAILike recipe, unchanged but for api_base and model, in a Python that
    has llama-index (the main venv: vLLM's pins another openai)."""
    url, model, _ = served
    client = os.environ.get("RAGKV_CLIENT_PYTHON") or str(ROOT / ".venv" / "bin" / "python")
    probe = subprocess.run([client, "-c", "import llama_index.llms.openai_like"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no llama-index-llms-openai-like in {client} (set RAGKV_CLIENT_PYTHON)")
    script = f'''
from llama_index.core.llms import ChatMessage
from llama_index.llms.openai_like import OpenAILike

llm = OpenAILike(model={model!r}, api_base="{url}/v1", api_key="unused",
                 is_chat_model=True, context_window=2048, max_tokens=24)
answer = llm.chat([ChatMessage(role="user", content={QUESTION!r})],
                  extra_body={{"documents": {DOCS[:3]!r}}})
print(answer.message.content)
'''
    run = subprocess.run([client, "-c", script], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Ada Morrow" in run.stdout


def test_bad_documents_get_a_400_naming_them(served):
    import httpx

    url, model, _ = served
    body = {"model": model, **BODY, "documents": [DOCS[0], {"text": DOCS[1], "url": "https://x"}]}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    assert r.status_code == 400 and "documents[1] has unknown fields ['url']" in r.text, r.text


def test_a_store_that_is_down(served):
    """Redis stops: lookups fail, are counted as misses, and vLLM prefills the prompt itself."""
    from openai import OpenAI

    url, model, redis = served
    redis.stop()
    client = OpenAI(base_url=url + "/v1", api_key="unused")
    out = client.chat.completions.create(model=model, messages=BODY["messages"], max_tokens=24, temperature=0,
                                         extra_body={"documents": DOCS[:3][::-1]})  # an order vLLM has not cached
    info = ragkv_info(out)
    assert info["recognised"] and not info["offered"] and info["hits"] == 0, info
    assert "Ada Morrow" in out.choices[0].message.content
