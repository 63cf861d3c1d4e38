"""How often full prefill changes its own answer under rounding alone: the floor any agreement figure
of a blend is read against.

    python benchmarks/qa/noise_floor.py --model qwen2.5-coder-0.5b --sample 30 --seed 1

For each question (the same prompts as run_qa.py: ragkv's template, its question format), HF full
prefill's greedy answer in the machine's fastest dtype with SDPA attention (the reference, as `ragkv
eval` computes it) against the same model and prompt computed with (a) eager attention, same dtype:
only the order of floating-point operations differs; (b) float32: the rounding of bf16 removed. A
blend that agrees with full prefill as often as (a) does is as close as two correct implementations
of full prefill are to each other. Answers are compared as `ragkv eval` compares them (the scored
line, SQuAD-normalised). Writes <out>/noise-floor-<model>.json (per question, resumable: questions
already in it are skipped) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import run_qa  # noqa: E402


def answer(model, tok, ids: list[int], max_new: int) -> str:
    from ragkv.adapter import ModelAdapter
    from ragkv.answers import answer_text

    a = ModelAdapter.of(model)
    x = torch.tensor([ids])
    with torch.inference_mode():
        _, cache = a.forward(x, logits_to_keep=1)
        cache.crop(-1)
        out = a.generate(x, cache, tok, max_new_tokens=max_new, do_sample=False)
    return answer_text(tok.decode(out, skip_special_tokens=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--datasets", default=",".join(run_qa.DATASETS))
    ap.add_argument("--sample", type=int, default=30)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--variants", default="eager,float32", help="compared with the reference: eager, float32")
    ap.add_argument("--answer-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args()

    from ragkv import models
    from ragkv.answers import load_questions, normalize_answer
    from ragkv.evalreport import bootstrap_ci
    from ragkv.evaluate import sample_questions
    from ragkv.prompt import PromptTemplate

    fast = models.default_dtype()
    known = {"eager": (fast, "eager"), "float32": (torch.float32, "sdpa")}
    variants = {"reference": (fast, "sdpa"), **{v: known[v] for v in args.variants.split(",")}}
    path = Path(args.out) / f"noise-floor-{Path(args.model).name}.json"
    done = json.loads(path.read_text()) if path.exists() else {"rows": {}}
    loaded = {name: models.load(args.model, dtype=dt, attn_implementation=impl) for name, (dt, impl) in variants.items()}
    tok = loaded["reference"][1]
    template = PromptTemplate.for_tokenizer(tok, question_format=run_qa.QUESTION_FORMAT)
    t0 = time.time()
    for name in args.datasets.split(","):
        qs = sample_questions(load_questions(run_qa.DATASETS[name]), args.sample, args.seed)
        for i, q in enumerate(qs):
            key = f"{name}:{q.id}"
            if key in done["rows"] and all(v in done["rows"][key] for v in variants):
                continue
            ids = template.build(q.question, q.contexts).input_ids
            row = done["rows"].setdefault(key, {})
            row.update({v: answer(m, tok, ids, args.answer_tokens) for v, (m, _) in loaded.items() if v not in row})
            done["rows"][key]["dataset"] = name
            path.write_text(json.dumps(done, indent=1) + "\n")
            print(f"  {name} {i + 1}/{len(qs)}  {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    done["meta"] = {"command": "python benchmarks/qa/noise_floor.py " + " ".join(sys.argv[1:]),
                    "cpu": run_qa.cpu_name(), "threads": torch.get_num_threads(), "dtype": str(fast),
                    "date": time.strftime("%Y-%m-%d")}
    path.write_text(json.dumps(done, indent=1) + "\n")
    rows = list(done["rows"].values())
    print(f"{'group':<10} {'n':>4} " + " ".join(f"{v + ' = reference':>28}" for v in variants if v != "reference"))
    for group in ["all", *args.datasets.split(",")]:
        sel = [r for r in rows if group == "all" or r["dataset"] == group]
        cells = []
        for v in variants:
            if v == "reference":
                continue
            same = [float(normalize_answer(r[v]) == normalize_answer(r["reference"])) for r in sel if v in r]
            lo, hi = bootstrap_ci(same)
            cells.append(f"{sum(same) / len(same):.2f} [{lo:.2f}, {hi:.2f}]")
        print(f"{group:<10} {len(sel):>4} " + " ".join(f"{c:>28}" for c in cells))


if __name__ == "__main__":
    main()
