"""TTFT over HTTP: `vllm serve` with RagKVConnector vs the same server's own full prefill, per ratio.

    .venv-vllm/bin/python benchmarks/vllm/bench_vllm_serve.py --prompts 8 --ratios 0.15,0.3

The server is examples/vllm_serve.py's (`python -m vllm.entrypoints.openai.api_server`, the default
multi-process engine, --dtype (float32 default), prefix caching off, block 32, 127.0.0.1). Prompts: the same test-split
prompts as bench_vllm.py, chunks precomputed first. Per prompt and setting: POST /v1/completions with
the prompt's token ids, max_tokens=1 and `kv_transfer_params` ({"ragkv_skip": true} = vLLM's own
prefill, {"ragkv_ratio": r} = blended), the settings interleaved in each of --repeats rounds; TTFT =
request sent -> response received (best of --repeats). The server inherits OMP_NUM_THREADS.
Writes results/vllm_serve.md and results/vllm_serve.json.
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
from bench_vllm import OUT, prepare  # noqa: E402
from vllm_serve import post, server_command, wait_ready  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--ratios", default="0.15,0.3")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--port", type=int, default=8012)
    ap.add_argument("--store", default="disk:///tmp/ragkv-bench-vllm")
    ap.add_argument("--ready-timeout", type=float, default=900)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    ratios = [float(r) for r in args.ratios.split(",")]

    model_dir, prompts = prepare(args.prompts, args.store, args.dtype)
    cmd, env = server_command(model_dir, args.port, args.store, ratios[0], max_model_len=8192, dtype=args.dtype)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    settings = [("vllm serve, full prefill", {"ragkv_skip": True})] + [(f"vllm serve + ragkv r={r:g}", {"ragkv_ratio": r})
                                                                      for r in ratios]
    rows = {name: {"ttft": [], "offered": 0} for name, _ in settings}
    url = f"http://127.0.0.1:{args.port}"
    try:
        wait_ready(url, proc, args.ready_timeout)

        def request(ids, extra):
            t0 = time.perf_counter()
            out = post(url + "/v1/completions", {"model": model_dir, "prompt": ids, "max_tokens": 1, "temperature": 0,
                                                 "kv_transfer_params": extra})
            return time.perf_counter() - t0, (out.get("kv_transfer_params") or {}).get("ragkv") or {}

        request(prompts[0]["ids"], {"ragkv_skip": True})  # warm-up
        for p in prompts:
            runs = {name: [] for name, _ in settings}
            for _ in range(args.repeats):  # settings interleaved, so a burst of other work hits them alike
                for name, extra in settings:
                    runs[name].append(request(p["ids"], extra))
            for name, _ in settings:
                rows[name]["ttft"].append(min(t for t, _ in runs[name]))
                rows[name]["offered"] += bool(runs[name][-1][1].get("offered"))
            print(p["id"], len(p["ids"]), "tokens", {n: round(rows[n]["ttft"][-1], 3) for n, _ in settings}, flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    n_tok = statistics.mean(len(p["ids"]) for p in prompts)
    base = statistics.median(rows[settings[0][0]]["ttft"])
    lines = [f"prompts: {len(prompts)} (test split, mean {n_tok:.0f} tokens), SmolLM2-135M {args.dtype}, "
             f"vLLM {__import__('vllm').__version__} OpenAI server (default multi-process engine), block 32, prefix "
             f"caching off, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, best of {args.repeats}, "
             f"load average {os.getloadavg()[0]:.1f} at the end", "",
             "| setting | TTFT median (s) | speed-up | offered |", "|---|---|---|---|"]
    for name, _ in settings:
        med = statistics.median(rows[name]["ttft"])
        lines.append(f"| {name} | {med:.3f} | {base / med:.2f}x | {rows[name]['offered']}/{len(prompts)} |")
    OUT.mkdir(exist_ok=True)
    (OUT / "vllm_serve.md").write_text("\n".join(lines) + "\n")
    (OUT / "vllm_serve.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
