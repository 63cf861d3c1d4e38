"""Answer quality on multi-hop QA (HotpotQA, MuSiQue, 2WikiMultihopQA): full prefill, naive reuse
and blended methods, through `ragkv eval` itself, then the report (report.py).

    python benchmarks/qa/run_qa.py --model qwen2.5-coder-0.5b                         # every question
    python benchmarks/qa/run_qa.py --model qwen2.5-coder-0.5b --sample 40 --seed 1 \\
        --selectors deviation,query --ratios 0,0.15,0.3 --tag dev40                     # a dev subset
    python benchmarks/qa/run_qa.py --model smollm2-135m --datasets hotpotqa --sample 3 --out /tmp/qa   # smoke

One question = its paragraphs (HotpotQA and 2Wiki 10, MuSiQue 20), one paragraph = one chunk, in the
dataset's order. Step 1, untimed: the chunk K/V of the questions evaluated are precomputed into a disk
store (default $RAGKV_HOME/qa-store) under the precompute policy given (default: ragkv's), each
chunk's neighbours (``--context``) chosen among every paragraph of its dataset's file, never by the
question. Step 2: `ragkv eval` over the datasets, with its per-question cache (default
$RAGKV_HOME/eval-cache): full prefill's references are computed once per question, model, dtype and
machine, every method's outcome once per setting, and each is written as it is computed, so a killed
run resumes and a run with new methods computes only those. Writes <out>/qa-<model>-<dtype>[-<tag>].json
(the `ragkv eval` report plus "meta": command, machine) and regenerates the tables and plots (report.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

from ragkv.prompt import ANSWER_ONLY_QUESTION as QUESTION_FORMAT  # the bare answer, as QA benchmarks score it

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DATASETS = {"hotpotqa": HERE / "data" / "hotpotqa.jsonl", "musique": HERE / "data" / "musique.jsonl",
            "2wikimqa": HERE / "data" / "2wikimqa.jsonl"}


def cpu_name() -> str:
    """The CPU model and whether it computes bf16 natively (what the dtype choice depends on)."""
    from ragkv.models import fast_bf16_cpu

    name = platform.processor() or "unknown CPU"
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        name = next((x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")), name)
        flags = set(next((x.split(":", 1)[1] for x in lines if x.startswith("flags")), "").split())
    except OSError:
        pass
    isa = "AMX" if "amx_bf16" in flags else "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "?"
    return (f"{name} ({isa}), {os.cpu_count()} cores, "
            f"{'native bf16' if fast_bf16_cpu() else 'no native bf16 (fp32 fastest)'}")


def precompute(args, dtype: str, store: str) -> None:
    """Store the chunk entries the evaluated questions need (untimed), neighbours from each dataset's
    whole file."""
    from ragkv.answers import load_questions
    from ragkv.evaluate import sample_questions
    from ragkv.spec import EngineSpec
    from ragkv.store import open_store

    with open_store(store) as st:
        spec = EngineSpec(args.model, dtype, context=args.context, lead=not args.no_lead)
        pre = spec.prefiller(st)
        for name in args.datasets:
            all_qs = load_questions(DATASETS[name])
            corpus = pre.template.chunks([c for q in all_qs for c in q.contexts], pre.adapter.max_positions)
            qs = sample_questions(all_qs, args.sample, args.seed)
            t0, done = time.time(), 0
            for lo in range(0, len(qs), 8):  # a few questions per call: bounded memory
                texts = list(dict.fromkeys(c for q in qs[lo : lo + 8] for c in q.contexts))  # (shared paragraphs once)
                _, computed = pre.ensure(texts, pool=corpus)
                done += computed
                print(f"  precompute {name}: {min(lo + 8, len(qs))}/{len(qs)} questions, {done} chunks computed, "
                      f"{time.time() - t0:.0f} s", file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="smollm2-135m, qwen2.5-coder-0.5b, ... or a dir")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="model dtype (auto: the machine's fastest)")
    ap.add_argument("--datasets", default=",".join(DATASETS), help=f"comma-separated, of {', '.join(DATASETS)}")
    ap.add_argument("--sample", type=int, default=None, help="N questions per dataset (seeded)  [default: all]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--selectors", default=None, help="ragkv eval --selectors  [default: ragkv's default]")
    ap.add_argument("--ratios", default=None, help="ragkv eval --ratios  [default: 0 and the default ratio]")
    ap.add_argument("--methods", default=None, help="ragkv eval --methods (instead of --selectors/--ratios)")
    ap.add_argument("--context", type=int, default=None, help="precompute policy: neighbour chunks  [default: ragkv's]")
    ap.add_argument("--no-lead", action="store_true", help="precompute policy: no lead entries")
    ap.add_argument("--store", default=None, help="store URI  [default: disk://$RAGKV_HOME/qa-store]")
    ap.add_argument("--cache", default=None, help="ragkv eval --cache  [default: $RAGKV_HOME/eval-cache]")
    ap.add_argument("--fresh", action="store_true", help="ragkv eval --fresh: recompute cached methods")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per method and question (median)")
    ap.add_argument("--tag", default=None, help="suffix of the report's name (qa-<model>-<dtype>-<tag>.json)")
    ap.add_argument("--out", default=str(HERE / "results"), help="folder of the JSON reports, tables and plots")
    args = ap.parse_args()
    args.datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    unknown = [d for d in args.datasets if d not in DATASETS]
    if unknown or not args.datasets:
        ap.error(f"unknown dataset(s) {', '.join(unknown) or '(none given)'}; valid: {', '.join(DATASETS)}")

    from ragkv.gguf import ragkv_home
    from ragkv.models import parse_dtype
    from ragkv.policy import PrecomputePolicy

    args.context = PrecomputePolicy.context if args.context is None else args.context
    dtype = str(parse_dtype(args.dtype)).removeprefix("torch.")
    store = args.store or f"disk://{ragkv_home() / 'qa-store'}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report_path = out / f"qa-{Path(args.model).name}-{dtype}{'' if args.tag is None else f'-{args.tag}'}.json"
    t0 = time.time()
    precompute(args, dtype, store)
    cmd = [sys.executable, "-m", "ragkv.cli", "eval"]
    for name in args.datasets:
        cmd += ["--questions", str(DATASETS[name])]
    cmd += ["--model", args.model, "--model-dtype", dtype, "--store", store, "--context", str(args.context),
            "--question-format", QUESTION_FORMAT, "--repeats", str(args.repeats)]
    cmd += ["--no-lead"] if args.no_lead else []
    for flag, value in (("--sample", args.sample), ("--seed", args.sample and args.seed), ("--selectors", args.selectors),
                        ("--ratios", args.ratios), ("--methods", args.methods), ("--cache", args.cache)):
        cmd += [flag, str(value)] if value is not None else []
    cmd += ["--fresh"] if args.fresh else []
    cmd += ["--json", str(report_path)]
    report_path.unlink(missing_ok=True)  # (a report left by an earlier run must not pass for this one)
    print("$", _sh(cmd), flush=True)
    r = subprocess.run(cmd)
    if r.returncode not in (0, 1) or not report_path.is_file() or report_path.stat().st_size == 0:
        sys.exit(f"ragkv eval failed (exit {r.returncode}) and wrote no report; its message is above")
    report = json.loads(report_path.read_text())
    import torch

    shown = [_shown(Path(c)) if c.endswith(".jsonl") or c.endswith(".json") else c for c in cmd[3:]]
    report["meta"] = {
        "command": _sh(["python", "benchmarks/qa/run_qa.py", *sys.argv[1:]]),
        "eval_command": _sh(["ragkv", *shown]), "datasets": args.datasets,
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
