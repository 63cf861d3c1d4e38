"""`ragkv serve` under pressure and at the end of its life: a full queue answers 429 with
Retry-After; SIGTERM lets the in-flight request finish, closes the store and exits 0."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from serve_server import ServeProcess

MODEL = "tiny"


def _events(lines):
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


@pytest.fixture
def one_place(tiny_smollm2_dir, tmp_path):
    proc = ServeProcess(str(tiny_smollm2_dir), f"disk://{tmp_path}/store", "--served-model-name", MODEL,
                        "--max-queue", "1", "--shutdown-timeout", "60").start()
    yield proc
    proc.stop()


def _long_stream(server, max_tokens: int):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": max_tokens,
            "stream": True, "temperature": 0}
    return httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120)


def test_full_queue_gets_429_with_retry_after(one_place):
    c = openai.OpenAI(base_url=f"{one_place.url}/v1", api_key="unused", max_retries=0, timeout=60)
    with _long_stream(one_place, 1900) as r:
        events = _events(r.iter_lines())
        next(events)  # admitted and generating: the one place is taken
        with pytest.raises(openai.RateLimitError) as e:
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert int(e.value.response.headers["retry-after"]) >= 1
        assert e.value.body["code"] == "queue_full" and "--max-queue 1" in e.value.body["message"]
    deadline = time.monotonic() + 60  # the stream's client left: its place comes back
    while httpx.get(f"{one_place.url}/health").json()["queue_depth"] and time.monotonic() < deadline:
        time.sleep(0.1)
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.usage.completion_tokens == 2
    m = one_place.metrics()
    assert m["ragkv_requests_rejected_total"] == 1 and m['ragkv_requests_total{status="429"}'] == 1


def test_sigterm_finishes_in_flight_then_closes_the_store(one_place):
    with _long_stream(one_place, 300) as r:
        events = _events(r.iter_lines())
        next(events)
        t0 = time.monotonic()
        one_place.proc.send_signal(15)  # SIGTERM while the answer is being generated
        rest = list(events)
    code = one_place.proc.wait(timeout=60)
    finals = [e for e in rest if e["choices"] and e["choices"][0]["finish_reason"]]
    assert finals and finals[0]["choices"][0]["finish_reason"] == "length"  # the whole answer arrived
    assert sum(bool(e["choices"] and e["choices"][0]["delta"].get("content")) for e in rest) > 0
    assert code == 0 and time.monotonic() - t0 < 60
    log = one_place.output()
    assert "store disk://" in log and "closed" in log and "Traceback" not in log
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{one_place.url}/health", timeout=2)
