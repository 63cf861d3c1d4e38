"""Answer quality on HotpotQA (distractor dev): full prefill, naive reuse and the blend at several
ratios, through `ragkv eval` itself, then the report (report.py).

    python benchmarks/qa/run_qa.py --model qwen2.5-coder-0.5b --dtype float32
    python benchmarks/qa/run_qa.py --model smollm2-135m --dtype auto --limit 3 --out /tmp/qa   # a smoke run

One question = its 10 Wikipedia paragraphs, one paragraph = one chunk, in the dataset's order (2 gold +
8 distractors). Chunk K/V live in a disk store (default $RAGKV_HOME/qa-store) under the default
precompute policy; every method is measured against HF full prefill in the same dtype on the same
machine. Methods: full prefill, naive reuse (r = 0), deviation and starts at r = 0.05 / 0.1 / 0.15 / 0.3.
Writes <out>/qa-<model>-<dtype>.json (the `ragkv eval` report plus "meta": command, machine) and
regenerates every table and the plot in <out> (report.py). Long: on a 2-core CPU the 25 questions take
about an hour for Qwen2.5-Coder-0.5B in float32; run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DATA = HERE / "data" / "hotpotqa_distractor_dev.jsonl"
RATIOS = "0,0.05,0.1,0.15,0.3"
SELECTORS = "deviation,starts"
# LongBench-style: ask for the bare answer, as QA benchmarks score it (ragkv's default question format
# asks to "be brief", and both models then answer in a sentence: "Yes, both were American." scores 0
# against "yes" under HotpotQA's rule). Only the prompt's suffix: no cache key depends on it.
QUESTION_FORMAT = ("Answer the question based on the documents above. Only give me the answer and do not output "
                   "any other words.\nQuestion: {question}")


def cpu_name() -> str:
    """The CPU model and whether it computes bf16 natively (what the dtype choice depends on)."""
    from ragkv.models import fast_bf16_cpu

    name = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores, {'native bf16' if fast_bf16_cpu() else 'no native bf16 (fp32 fastest)'}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="smollm2-135m, qwen2.5-coder-0.5b, ... or a dir")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="model dtype (auto: the machine's fastest)")
    ap.add_argument("--questions", default=str(DATA), help="JSONL of {question, contexts, answer}")
    ap.add_argument("--limit", type=int, default=None, help="only the first N questions (smoke runs)")
    ap.add_argument("--store", default=None, help="store URI  [default: disk://$RAGKV_HOME/qa-store]")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per method and question (median)")
    ap.add_argument("--out", default=str(HERE / "results"), help="folder of the JSON reports, tables and plot")
    args = ap.parse_args()

    from ragkv.gguf import ragkv_home
    from ragkv.models import parse_dtype

    dtype = str(parse_dtype(args.dtype)).removeprefix("torch.")
    store = args.store or f"disk://{ragkv_home() / 'qa-store'}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report_path = out / f"qa-{Path(args.model).name}-{dtype}{'' if args.limit is None else f'-n{args.limit}'}.json"
    with tempfile.TemporaryDirectory() as tmp:
        questions = Path(args.questions)
        if args.limit is not None:
            lines = [line for line in questions.read_text().splitlines() if line.strip()][: args.limit]
            questions = Path(tmp) / "questions.jsonl"
            questions.write_text("\n".join(lines) + "\n")
        cmd = [sys.executable, "-m", "ragkv.cli", "eval", "--questions", str(questions), "--model", args.model,
               "--model-dtype", dtype, "--store", store, "--ratios", RATIOS, "--selectors", SELECTORS,
               "--question-format", QUESTION_FORMAT, "--repeats", str(args.repeats), "--json", str(report_path)]
        report_path.unlink(missing_ok=True)  # (a report left by an earlier run must not pass for this one)
        print("$", _sh(cmd), flush=True)
        t0 = time.time()
        r = subprocess.run(cmd)
        if r.returncode not in (0, 1) or not report_path.is_file() or report_path.stat().st_size == 0:
            sys.exit(f"ragkv eval failed (exit {r.returncode}) and wrote no report; its message is above")
    report = json.loads(report_path.read_text())
    import torch

    report["meta"] = {
        "command": _sh(["python", "benchmarks/qa/run_qa.py", *sys.argv[1:]]),
        "eval_command": _sh(["ragkv", *cmd[3:5], _shown(Path(args.questions)), *cmd[6:-1], _shown(report_path)])
        + ("" if args.limit is None else f"  (the first {args.limit} questions)"),
        "questions_file": _shown(Path(args.questions)), "limit": args.limit,
        "cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"), "wall_s": round(time.time() - t0, 1),
    }
    report_path.write_text(json.dumps(report, indent=1) + "\n")
    sys.path.insert(0, str(HERE))
    import report as qa_report

    qa_report.write_all(out)


def _sh(args: list[str]) -> str:
    """A bash command line on one line: arguments with newlines in ANSI-C quotes ($'...\\n...')."""
    def quote(a: str) -> str:
        if "\n" not in a:
            return shlex.quote(a)
        return "$'" + a.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"
    return " ".join(map(quote, args))


def _shown(path: Path) -> str:
    """``path`` relative to the repository when it is inside it (the report then reads it anywhere)."""
    path = path.resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


if __name__ == "__main__":
    main()
