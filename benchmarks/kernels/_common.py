"""Shared bits of the kernel benchmarks: arguments, timing, CSV rows.

Each bench_<op>.py times the Triton kernel ("triton") against its torch reference ("torch") and appends
one CSV row per (impl, case). On CPU the kernel runs in triton's interpreter: sizes are tiny and the timings
only prove the script works, they are not performance numbers.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import os
import statistics
import time
from pathlib import Path

import torch

DEFAULT_CSV = Path(__file__).resolve().parents[1] / "results" / "bench_kernels.csv"
FIELDS = ["timestamp", "op", "impl", "device", "dtype", "case", "ms", "metric", "value"]


def parse_args(description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--impl", default="both", choices=["both", "triton", "torch"])
    p.add_argument("--dtype", default="bf16", choices=["fp32", "fp16", "bf16"])
    p.add_argument("--csv", type=Path, default=DEFAULT_CSV, help="results are appended here")
    args = p.parse_args()
    if args.device == "cpu":
        # must precede the first import of a kernel module (the @triton.jit decorator reads it)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    args.torch_dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    args.impls = ["triton", "torch"] if args.impl == "both" else [args.impl]
    return args


def bench_ms(fn, device: str) -> float:
    """Median milliseconds per call: triton.testing.do_bench on CUDA, a few wall-clock calls on CPU."""
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100))
    fn()  # warm-up (and interpreter setup)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def record(args, op: str, impl: str, case: str, ms: float, metric: str, value: float) -> None:
    row = {
        "timestamp": dt.datetime.now().isoformat(timespec="seconds"), "op": op, "impl": impl,
        "device": args.device, "dtype": args.dtype, "case": case, "ms": f"{ms:.4f}", "metric": metric,
        "value": f"{value:.3f}",
    }
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    new = not args.csv.exists()
    with args.csv.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            w.writeheader()
        w.writerow(row)
    print(f"{op:16s} {impl:7s} {args.device:5s} {args.dtype:5s} {case:34s} {ms:10.4f} ms  {value:9.3f} {metric}")
