"""`make demo`: answer questions from documents with SmolLM2 (full prefill baseline for now)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ragkv import models

DATA = Path(__file__).parent / "data"


def main() -> None:
    model, tokenizer = models.load("smollm2-135m")
    docs = {p.name: p.read_text() for p in sorted((DATA / "docs").glob("*.md"))}
    rows = [json.loads(line) for line in (DATA / "questions_by_file.jsonl").read_text().splitlines()]
    for row in rows[:3]:
        context = "\n\n".join(docs[name] for name in row["contexts"])
        messages = [{"role": "user", "content": f"{context}\n\nAnswer briefly: {row['question']}"}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
        dt = time.perf_counter() - t0
        answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
        print(f"Q: {row['question']}\nA: {answer}   ({ids.shape[1]} prompt tokens, {dt:.2f} s)\n")


if __name__ == "__main__":
    main()
