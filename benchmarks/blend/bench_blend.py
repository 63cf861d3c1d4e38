"""TTFT and fidelity of full prefill, naive reuse and CacheBlend at several ratios, with selection
variants and precompute policies, on SmolLM2-135M (CPU) over real 6 x ~512-token prompts.

    python benchmarks/blend/bench_blend.py --out benchmarks/blend/results [--questions N]

Writes results.json, RESULTS.md (tables) and tradeoff.png (TTFT vs fidelity).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from dataset import build

from ragkv import models
from ragkv.blend import BlendConfig, BlendEngine, DeviationSelector
from ragkv.evaluate import Question, evaluate, format_table
from ragkv.policy import PrecomputePolicy, StorageFormat
from ragkv.prompt import PromptTemplate
from ragkv.store import open_store

VARIANTS = {
    # name: (PrecomputePolicy kwargs, BlendConfig kwargs); gap None = the default, 1024 for SmolLM2
    "reference: no sink, V, check [1]": (dict(sink="none", gap=0), dict(signal="v", check_layers=(1,))),
    "sink template, gap 0, V, check [1]": (dict(sink="template", gap=0), dict(signal="v", check_layers=(1,))),
    "sink template, gap 1024, V, check [1]": (dict(sink="template"), dict(signal="v", check_layers=(1,))),
    "sink template, gap 1024, KV, check [1]": (dict(sink="template"), dict(signal="kv", check_layers=(1,))),
    "ragkv default: sink template, gap 1024, V, gradual [1,3,6]": (dict(sink="template"), dict()),
    "ragkv default, int8 storage": (dict(sink="template"), dict(storage_dtype="int8")),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/blend/results")
    ap.add_argument("--questions", type=int, default=10)
    ap.add_argument("--ratios", default="0,0.05,0.15,0.3,0.5")
    ap.add_argument("--variants", default="all", help="comma-separated variant indices or 'all'")
    ap.add_argument("--store", default=None, help="store URI (default: a disk store under --out)")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tok = models.load()
    template = PromptTemplate.for_tokenizer(tok)
    qs = [Question(q["question"], q["contexts"]) for q in build(template, n_questions=a.questions)]
    base = a.store or f"disk://{out.resolve()}/store"
    ratios = [float(r) for r in a.ratios.split(",")]
    names = list(VARIANTS)
    if a.variants != "all":
        names = [names[int(i)] for i in a.variants.split(",")]
    report = {"model": "SmolLM2-135M-Instruct", "device": "cpu", "threads": torch.get_num_threads(),
              "questions": len(qs), "prompt_tokens": None, "variants": {}}
    for name in names:
        policy, cfg = VARIANTS[name][0], dict(VARIANTS[name][1])
        # entries are keyed by content, not encoding: another storage dtype needs its own store
        storage = cfg.pop("storage_dtype", None)
        store = open_store(base + ("-" + storage if storage else ""))
        eng = BlendEngine(model, tok, store, config=BlendConfig(selector=DeviationSelector(**cfg)),
                          policy=PrecomputePolicy(**policy), storage=StorageFormat(storage))
        t0 = time.time()
        rep = evaluate(eng, qs, ratios=ratios, repeats=2)
        report["prompt_tokens"] = sum(eng.build_prompt(q.question, q.contexts).num_tokens for q in qs) / len(qs)
        report["variants"][name] = rep["methods"]
        print(f"\n## {name}  ({time.time() - t0:.0f} s)\n{format_table(rep)}", flush=True)
        (out / "results.json").write_text(json.dumps(report, indent=1))
    write_markdown(report, out, " ".join(sys.argv))
    plot(report, out / "tradeoff.png")


def write_markdown(report: dict, out: Path, cmd: str) -> None:
    lines = [f"# Blend benchmark: {report['model']} on CPU ({report['threads']} threads)", "",
             f"Command: `python {cmd}`", "",
             f"{report['questions']} prompts of 6 chunks x ~512 tokens of Python stdlib documentation "
             f"(pydoc) + a question; mean prompt {report['prompt_tokens']:.0f} tokens. "
             "TTFT = request -> first-token logits with chunk K/V in the disk store (page cache warm), "
             "median of 2 runs per prompt; fidelity = teacher-forced top-1 agreement with full prefill "
             "over its first 32 greedy tokens; kl = KL(full || method) of the first token.", ""]
    for name, methods in report["variants"].items():
        full = methods["full"]["ttft_s"]
        lines += [f"## {name}", "", "| method | TTFT s | speedup vs full | fidelity | KL | load s | fuse s | recompute s |",
                  "|---|---|---|---|---|---|---|---|"]
        for m, d in methods.items():
            lines.append(f"| {m} | {d['ttft_s']:.3f} | {full / d['ttft_s']:.2f}x | {d['fidelity']:.3f} | {d['kl']:.4f} | "
                         f"{d.get('load_s', 0):.3f} | {d.get('fuse_s', 0):.3f} | {d.get('compute_s', 0):.3f} |")
        lines.append("")
    (out / "RESULTS.md").write_text("\n".join(lines))


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, methods in report["variants"].items():
        pts = [(d["ttft_s"], d["fidelity"], m) for m, d in methods.items() if m != "full"]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=name)
        for x, y, m in pts:
            ax.annotate(m, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    full = next(iter(report["variants"].values()))["full"]["ttft_s"]
    ax.axvline(full, color="k", ls="--", lw=1)
    ax.annotate("full prefill", (full, 0.8), rotation=90, fontsize=8)
    ax.axhline(0.95, color="gray", ls=":", lw=1)
    ax.set_xlabel("TTFT (s), SmolLM2-135M, CPU")
    ax.set_ylabel("fidelity (top-1 agreement with full prefill)")
    ax.set_title("CacheBlend: TTFT vs fidelity (labels: recompute ratio)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
