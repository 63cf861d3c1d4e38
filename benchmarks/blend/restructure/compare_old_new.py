"""Same questions, same machine: the default blend at r = 0.15 (float32), for old and new code.

    python compare_old_new.py LABEL QUESTIONS.jsonl RESULTS.jsonl

Runs with whichever ragkv the interpreter imports (the old commit installed in its own environment,
or this checkout) and appends one JSON line to RESULTS.jsonl. Uses only APIs both codes share.
"""

import json
import sys
import tempfile

import torch

from ragkv import models
from ragkv.blend import BlendConfig, BlendEngine
from ragkv.evaluate import Question, evaluate
from ragkv.store import open_store


def main(label: str, questions: str, results: str) -> None:
    with open(questions) as f:
        qs = [Question(r["question"], r["contexts"]) for r in map(json.loads, f)]
    model, tok = models.load("smollm2-135m", dtype="float32")
    with tempfile.TemporaryDirectory() as d:
        eng = BlendEngine(model, tok, open_store(f"disk://{d}"), config=BlendConfig(ratio=0.15))
        rep = evaluate(eng, qs, ratios=[0.15], repeats=2)
    m, full = rep["methods"]["0.15"], rep["methods"]["full"]
    out = {"code": label, "threads": torch.get_num_threads(), "full_ttft_s": full["ttft_s"], "ttft_s": m["ttft_s"],
           "fidelity": m["fidelity"], "kl": m["kl"], "speedup": full["ttft_s"] / m["ttft_s"]}
    print(json.dumps(out))
    with open(results, "a") as f:
        f.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:4])
