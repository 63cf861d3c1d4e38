"""A real corpus for the blend benchmark: the Python standard library's own documentation
(``pydoc`` plain text of well-documented modules), chunked with ragkv's chunker into ~512-token chunks.

Each question takes ``n_chunks`` chunks from different modules and asks about a function documented
in one of them (placed at a random position). Deterministic for a given seed.
"""

from __future__ import annotations

import json
import pydoc
import random
import re

MODULES = ["json", "csv", "textwrap", "heapq", "bisect", "shutil", "fractions", "statistics", "difflib",
           "calendar", "secrets", "string", "sched", "queue", "zipfile", "tarfile", "base64", "ipaddress",
           "functools", "itertools", "argparse", "logging", "pathlib", "datetime", "decimal"]
_DEF = re.compile(r"^\s{4,}(?:\|\s+)?([a-z_][a-z0-9_]{3,})\(", re.M)


def module_text(name: str) -> str:
    mod = __import__(name)
    return pydoc.render_doc(mod, renderer=pydoc.plaintext)


def build(template, n_questions: int = 12, n_chunks: int = 6, chunk_tokens: int = 512, seed: int = 0) -> list[dict]:
    from ragkv.chunking import chunk_document

    rng = random.Random(seed)
    pool = []  # (module, chunk text, documented names)
    for name in MODULES:
        for c in chunk_document(module_text(name), template, chunk_tokens)[1:6]:
            n_tok = len(template.chunk_ids(c))
            names = sorted(n for n in set(_DEF.findall(c)) if not n.startswith("_"))
            if n_tok >= 0.8 * chunk_tokens and names:
                pool.append((name, c, names))
    questions = []
    for _ in range(n_questions):
        picks = []
        mods = set()
        while len(picks) < n_chunks:
            m, c, names = pool[rng.randrange(len(pool))]
            if m not in mods:
                mods.add(m)
                picks.append((m, c, names))
        target = rng.randrange(n_chunks)
        m, _, names = picks[target]
        fn = rng.choice(names)
        questions.append({
            "question": f"In the Python {m} module, what does {fn} do?",
            "contexts": [c for _, c, _ in picks],
        })
    return questions


if __name__ == "__main__":
    import argparse

    from ragkv import models
    from ragkv.prompt import PromptTemplate

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("-n", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    _, tok = models.load()
    qs = build(PromptTemplate.for_tokenizer(tok), n_questions=a.n, seed=a.seed)
    with open(a.out, "w") as f:
        for q in qs:
            f.write(json.dumps(q) + "\n")
    print(f"wrote {len(qs)} questions to {a.out}")
