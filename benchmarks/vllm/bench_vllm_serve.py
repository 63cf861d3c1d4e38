"""TTFT over HTTP: `vllm serve` with RagKVConnector vs the same server's own full prefill, per ratio.

    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/vllm/bench_vllm_serve.py --prompts 8 --ratios 0,0.15,1 --repeats 2

The server is examples/vllm_serve.py's (`python -m vllm.entrypoints.openai.api_server`, the default
multi-process engine, --dtype (float32 default), block 32, 127.0.0.1, vLLM's defaults otherwise:
prefix caching and chunked prefill on; VLLM_SERVER_DEV_MODE=1 for POST /reset_prefix_cache).
Prompts: bench_vllm.py's (test split, the shared system prompt, chunks precomputed first), sent as
chat requests with the chunks as `documents` (ragkv's renderer lays them out as chunks): per prompt
and setting POST /v1/chat/completions with max_tokens=1 and `kv_transfer_params` ({"ragkv_skip":
true} = vLLM's own prefill of the same ids, {"ragkv_ratio": r} = blended), the settings interleaved
in each of --repeats rounds, round k with the chunks rotated by k. Before every request the
server's prefix cache is emptied and warmed with the system prompt (POST /reset_prefix_cache, then
a completion of the prompt's prefix ids), the same for both sides. TTFT = request sent -> response
received (best of --repeats). The server inherits OMP_NUM_THREADS.
Writes results/vllm_serve.md and results/vllm_serve.json (results/vllm_serve-bfloat16.* with
--dtype bfloat16).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vllm import OUT, prepare, results_stem, rotated  # noqa: E402
from vllm_serve import post, server_command, wait_ready  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--ratios", default="0,0.15,1")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--port", type=int, default=8012)
    ap.add_argument("--store", default="disk:///tmp/ragkv-bench-vllm")
    ap.add_argument("--ready-timeout", type=float, default=900)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--system", default="library", choices=["library", "default"], help="as in bench_vllm.py")
    args = ap.parse_args()
    ratios = [float(r) for r in args.ratios.split(",")]

    model_dir, prompts, chat = prepare(args.prompts, args.store, args.dtype, args.system)
    cmd, env = server_command(model_dir, args.port, args.store, 0.15, max_model_len=8192, dtype=args.dtype)
    proc = subprocess.Popen(cmd, env={**env, "VLLM_SERVER_DEV_MODE": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    settings = [("vllm serve, full prefill", {"ragkv_skip": True})] + [(f"vllm serve + ragkv r={r:g}", {"ragkv_ratio": r})
                                                                      for r in ratios]
    rows = {name: {"ttft": [], "offered": 0, "vllm_cached": []} for name, _ in settings}
    url = f"http://127.0.0.1:{args.port}"
    try:
        wait_ready(url, proc, args.ready_timeout)

        def request(p, k, extra):
            if not post(url + "/reset_prefix_cache", {}).get("success"):
                raise RuntimeError("vllm serve did not empty its prefix cache")
            post(url + "/v1/completions", {"model": model_dir, "prompt": chat.prefix(p), "max_tokens": 1,
                                           "kv_transfer_params": {"ragkv_skip": True}})
            docs = rotated(p["contexts"], k)
            t0 = time.perf_counter()
            out = post(url + "/v1/chat/completions", {"model": model_dir, "messages": chat.messages(p), "documents": docs,
                                                      "max_tokens": 1, "temperature": 0, "kv_transfer_params": extra})
            return time.perf_counter() - t0, (out.get("kv_transfer_params") or {}).get("ragkv") or {}

        request(prompts[0], 0, {"ragkv_skip": True})  # warm-up
        for _, extra in settings[1:]:  # the blend stores the prompts' shared prefix entry once
            request(prompts[0], 0, extra)
        for p in prompts:
            runs = {name: [] for name, _ in settings}
            for k in range(args.repeats):  # settings interleaved, so a burst of other work hits them alike
                for name, extra in settings:
                    runs[name].append(request(p, k, extra))
            for name, _ in settings:
                rows[name]["ttft"].append(min(t for t, _ in runs[name]))
                rows[name]["offered"] += bool(runs[name][-1][1].get("offered"))
                rows[name]["vllm_cached"].append(runs[name][-1][1].get("vllm_cached", 0))
            print(p["id"], len(chat.ids(p)), "tokens", {n: round(rows[n]["ttft"][-1], 3) for n, _ in settings}, flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    n_tok = statistics.mean(len(chat.ids(p)) for p in prompts)
    base = statistics.median(rows[settings[0][0]]["ttft"])
    lines = [f"prompts: {len(prompts)} (test split, mean {n_tok:.0f} tokens), SmolLM2-135M {args.dtype}, "
             f"vLLM {__import__('vllm').__version__} OpenAI server (default multi-process engine), chat requests "
             f"with documents, block 32, prefix caching on (warmed with the system prompt before every request), "
             f"chunked prefill on, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, best of {args.repeats}, "
             f"load average {os.getloadavg()[0]:.1f} at the end", "",
             "| setting | TTFT median (s) | speed-up | offered | vLLM cache hit (tokens) |", "|---|---|---|---|---|"]
    for name, _ in settings:
        med = statistics.median(rows[name]["ttft"])
        lines.append(f"| {name} | {med:.3f} | {base / med:.2f}x | {rows[name]['offered']}/{len(prompts)} | "
                     f"{statistics.mean(rows[name]['vllm_cached']):.0f} |")
    OUT.mkdir(exist_ok=True)
    stem = results_stem("vllm_serve", args.dtype)
    (OUT / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (OUT / f"{stem}.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
