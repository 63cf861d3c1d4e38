"""Load benchmark of `ragkv serve`: TTFT (p50/p99) and requests/s at 1, 4 and 8 concurrent clients,
blended (--ratio 0.15) vs full recompute (--ratio 1), loopback only and bounded.

Per mode a fresh `ragkv serve` process (SmolLM2, disk stores in a temp dir: the chunks it computes are
kept in a disk --write-store, 127.0.0.1, a free port)
gets the example questions (examples/data/questions.jsonl: 12 questions over 2-3 of the 4 example
documents, ~700-1300 prompt tokens) until each document has been sent once, so every chunk is stored
(not measured); then per concurrency
level N, N client threads take the same 12 questions from one shared list, each as a streamed request
of --max-tokens tokens (greedy). TTFT = request sent -> first content delta at the client; requests/s
= requests / wall time of the level. The server's own TTFT and its cached tokens are reported beside.

    nice -n 19 .venv/bin/python benchmarks/serve/bench_serve.py --max-tokens 16 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tests"))
from serve_server import ServeProcess  # noqa: E402  (the tests' own server starter)

MODEL_ID: dict[str, str] = {}  # server url -> the model id it serves
MODES = {"blended (r=0.15)": ["--ratio", "0.15"], "full recompute (r=1)": ["--ratio", "1"]}


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (p99 of 12 samples is their maximum)."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def one(url: str, row: dict, max_tokens: int) -> dict:
    body = {"model": MODEL_ID[url], "messages": [{"role": "user", "content": row["question"]}],
            "documents": row["contexts"], "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, stats, use, text = None, None, None, []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                use = ev["usage"]
            for ch in ev["choices"]:
                if ch["delta"].get("content"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(ch["delta"]["content"])
                if ch["finish_reason"]:
                    stats = ev["ragkv"]
    return {"ttft": ttft, "latency": time.perf_counter() - t0, "server_ttft": stats["ttft_s"],
            "cached_tokens": use["prompt_tokens_details"]["cached_tokens"], "prompt_tokens": use["prompt_tokens"],
            "hits": stats["hits"], "text": "".join(text)}


def level(url: str, rows: list[dict], clients: int, max_tokens: int) -> dict:
    todo, results, errors, lock = list(rows), [], [], threading.Lock()

    def client():
        while True:
            with lock:
                if not todo:
                    return
                row = todo.pop(0)
            try:
                res = one(url, row, max_tokens)
            except Exception as e:  # counted, reported
                with lock:
                    errors.append(repr(e))
                continue
            with lock:
                results.append(res)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    return {"clients": clients, "requests": len(results), "errors": errors, "wall_s": wall,
            "req_per_s": len(results) / wall, "ttft_p50": pct(ttfts, 50), "ttft_p99": pct(ttfts, 99),
            "server_ttft_p50": statistics.median(r["server_ttft"] for r in results),
            "latency_p50": statistics.median(r["latency"] for r in results),
            "cached_tokens_mean": statistics.mean(r["cached_tokens"] for r in results),
            "prompt_tokens_mean": statistics.mean(r["prompt_tokens"] for r in results),
            "hit_requests": sum(r["hits"] > 0 for r in results)}


def save(args, meta: dict, results: list[dict]) -> None:
    """results.json after every level, so a run cut short keeps what it measured."""
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {**meta, "load_avg_now": os.getloadavg()}
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")


def run_mode(name: str, args, rows: list[dict], done: list[dict], meta: dict) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="ragkv-bench-serve-") as tmp:
        extra = [*MODES[name], "--threads", str(args.threads), "--max-queue", "64", "--log-level", "warning",
                 # chunks computed for requests are kept on disk as before (not in the default memory store)
                 "--write-policy", "all", "--write-store", f"disk://{tmp}/requests?max_bytes=10G"]
        server = ServeProcess(args.model, f"disk://{tmp}/store", *extra, model_dtype=args.model_dtype).start()
        try:
            MODEL_ID[server.url] = httpx.get(f"{server.url}/v1/models", timeout=60).json()["data"][0]["id"]
            seen: set[str] = set()
            for row in rows:  # store every chunk (misses), not measured: one request per row with a new document
                if not seen.issuperset(row["contexts"]):
                    one(server.url, row, 1)
                    seen.update(row["contexts"])
            out = []
            for n in args.clients:
                res = level(server.url, rows, n, args.max_tokens)
                res["mode"] = name
                print(f"{name:22s} clients={n} req/s={res['req_per_s']:.3f} ttft p50={res['ttft_p50']:.2f} "
                      f"p99={res['ttft_p99']:.2f} errors={len(res['errors'])}", flush=True)
                out.append(res)
                save(args, meta, [*done, *out])
            return out
        finally:
            server.terminate()
            server.stop()


def table(results: list[dict]) -> str:
    rows = ["| mode | clients | requests | errors | TTFT p50 s | TTFT p99 s | server TTFT median s | latency median s | req/s | cached tokens / prompt tokens (mean) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r['mode']} | {r['clients']} | {r['requests']} | {len(r['errors'])} | {r['ttft_p50']:.2f} | "
                    f"{r['ttft_p99']:.2f} | {r['server_ttft_p50']:.2f} | {r['latency_p50']:.2f} | {r['req_per_s']:.3f} | "
                    f"{r['cached_tokens_mean']:.0f} / {r['prompt_tokens_mean']:.0f} |")
    return "\n".join(rows)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in dict.fromkeys(r["mode"] for r in results):
        rs = [r for r in results if r["mode"] == mode]
        xs = [r["clients"] for r in rs]
        line = ax1.plot(xs, [r["ttft_p50"] for r in rs], marker="o", label=f"{mode} p50")[0]
        ax1.plot(xs, [r["ttft_p99"] for r in rs], marker="x", ls="--", color=line.get_color(), label=f"{mode} p99")
        ax2.plot(xs, [r["req_per_s"] for r in rs], marker="o", label=mode)
    ax1.set(xlabel="concurrent clients", ylabel="TTFT at the client (s)", title="TTFT", xticks=[1, 4, 8])
    ax2.set(xlabel="concurrent clients", ylabel="requests / s", title="throughput", xticks=[1, 4, 8])
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=8)
    ax1.set_ylim(bottom=0)
    ax2.set_ylim(bottom=0)
    n = max(r["requests"] for r in results)
    fig.suptitle(f"ragkv serve, SmolLM2-135M, {n} example questions per level, loopback, nice 19 on a shared CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--model-dtype", default="auto")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    ap.add_argument("--clients", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8])
    ap.add_argument("--limit", type=int, default=None, help="only the first N questions (a quick check)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of: " + ", ".join(MODES))
    ap.add_argument("--out", type=Path, default=HERE)
    ap.add_argument("--plot-only", action="store_true", help="redraw ttft.png and print the table from --out/results.json")
    args = ap.parse_args()
    rows = [json.loads(line) for line in (ROOT / "examples/data/questions.jsonl").read_text().splitlines()]
    rows = rows[: args.limit]
    if args.plot_only:
        done = json.loads((args.out / "results.json").read_text())["results"]
        plot(done, args.out / "ttft.png")
        print(table(done))
        return
    t0 = time.time()
    meta = {"command": " ".join(sys.argv), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "load_avg_at_start": os.getloadavg(), "args": {k: str(v) for k, v in vars(args).items()},
            "git": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()}
    results: list[dict] = []
    for mode in args.modes.split(","):
        results += run_mode(mode, args, rows, results, meta)
    meta["seconds"] = time.time() - t0
    save(args, meta, results)
    plot(results, args.out / "ttft.png")
    print(table(results))
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
