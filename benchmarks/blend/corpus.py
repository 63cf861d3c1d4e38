"""The blend benchmark set: 4 genres of real text (technical, legal, literature, encyclopedic), chunked
with ragkv's chunker; prompts of 4-8 chunks with one question answerable from one target chunk.
Sources, licenses and the build: ``data/README.md``.

    from benchmarks.blend import corpus     # or: import corpus, with benchmarks/blend on sys.path
    prompts = corpus.load("test", genres=["legal"])

    python benchmarks/blend/corpus.py --split test --out test.jsonl   # ragkv eval's question format
    python benchmarks/blend/corpus.py --stats                         # counts and token lengths
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
SPLITS = ("dev", "test")
GENRES = ("technical", "legal", "literature", "encyclopedic")


def _read(name: str) -> list[dict]:
    with open(DATA / name, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load(split: str = "test", genres: list[str] | None = None) -> list[dict]:
    """Prompts of one split (``"dev"`` to tune, ``"test"`` to report; ``"all"`` for both), each
    ``{"id", "genre", "question", "answer", "contexts": [chunk texts], "target", "features"}``."""
    if split not in (*SPLITS, "all"):
        raise ValueError(f"split must be one of {SPLITS} or 'all', got {split!r}")
    if genres is not None and not set(genres) <= set(GENRES):
        raise ValueError(f"unknown genres {sorted(set(genres) - set(GENRES))}; known: {GENRES}")
    text = {c["id"]: c["text"] for c in _read("chunks.jsonl")}
    return [{"id": p["id"], "genre": p["genre"], "question": p["question"], "answer": p["answer"],
             "contexts": [text[c] for c in p["chunks"]], "target": p["target"], "features": p["features"]}
            for p in _read("prompts.jsonl")
            if split in ("all", p["split"]) and (genres is None or p["genre"] in genres)]


def documents(split: str = "test") -> list[str]:
    """The texts of the split's source documents (what a user would precompute: every chunk of the
    prompts is a chunk of one of them under ragkv's chunker at 512 tokens)."""
    if split not in (*SPLITS, "all"):
        raise ValueError(f"split must be one of {SPLITS} or 'all', got {split!r}")
    return [d["text"] for d in _read("documents.jsonl") if split in ("all", d["split"])]


def stats(split: str = "all") -> None:
    from ragkv import models
    from ragkv.prompt import PromptTemplate

    tok = models.load_tokenizer("smollm2-135m") if hasattr(models, "load_tokenizer") else models.load("smollm2-135m")[1]
    tpl = PromptTemplate.for_tokenizer(tok)
    for s in SPLITS if split == "all" else (split,):
        ps = load(s)
        n = sorted(tpl.build(p["question"], p["contexts"]).num_tokens for p in ps)
        c = sorted(len(tpl.chunk_ids(t)) for p in ps for t in p["contexts"])
        print(f"{s}: {len(ps)} prompts; per genre: "
              + ", ".join(f"{g} {k}" for g, k in sorted(collections.Counter(p["genre"] for p in ps).items())))
        print(f"  prompt tokens (SmolLM2 template): min {n[0]} median {n[len(n) // 2]} max {n[-1]}")
        print("  chunks per prompt: " + ", ".join(
            f"{k}: {v}" for k, v in sorted(collections.Counter(len(p["contexts"]) for p in ps).items())))
        print(f"  chunk tokens: min {c[0]} median {c[len(c) // 2]} max {c[-1]}; "
              f"unique chunks {len({t for p in ps for t in p['contexts']})}")
        print("  features: " + ", ".join(
            f"{k} {v}" for k, v in sorted(collections.Counter(f for p in ps for f in p["features"]).items())))


def main() -> None:
    ap = argparse.ArgumentParser(description="the blend benchmark set")
    ap.add_argument("--split", choices=[*SPLITS, "all"], help="default: test for --out, all for --stats")
    ap.add_argument("--genres", nargs="+", choices=GENRES)
    ap.add_argument("--out", help="write ragkv eval's JSONL ({question, contexts, answer} per line)")
    ap.add_argument("--stats", action="store_true", help="print counts and token lengths")
    a = ap.parse_args()
    if a.out:
        ps = load(a.split or "test", a.genres)
        with open(a.out, "w", encoding="utf-8") as f:
            for p in ps:
                f.write(json.dumps({"question": p["question"], "contexts": p["contexts"], "answer": p["answer"]},
                                   ensure_ascii=False) + "\n")
        print(f"wrote {len(ps)} questions to {a.out}")
    if a.stats:
        stats(a.split or "all")
    if not (a.out or a.stats):
        ap.error("nothing to do: give --out FILE and/or --stats")


if __name__ == "__main__":
    main()
