"""How far can a score built from attention and K/V deviation take selection? A first-order proxy.

The grad oracle (oracle.answer_gradient) predicts, per chunk token, how much the teacher-forced loss of
full prefill's answer falls when that token's K/V go from stored to exact in every layer. A score's
*captured gain* at ratio r is the share of that predicted gain (its positive part, summed over the
chunk tokens) held by the score's top r of chunk tokens: 1.0 is the oracle's own choice. It needs one
prefill per prompt instead of a blended run per score, so many scores can be compared, including ones
no selector can compute at query time:

    deviation          V deviation at layer 2 (the hybrid's check layer), every chunk token computed
                       up to it: the deviation selector's signal, ranked once
    query              the probe's attention (every suffix row, each layer normalised, summed): the
                       query selector's score
    hybrid             query preselects 3 x the budget, kept by query x sqrt(deviation) (the hybrid's
                       score; its deviation here comes from every chunk token, not only the preselected);
                       also with the K deviation, and with sqrt(K dev x V dev)
    query x true V/K   per layer: the probe's attention x the true V (K) error of the stored token
    output change      per layer, a first-order bound on how far correcting the token moves the
                       suffix's attention output: sum over heads and suffix rows of
                       a * (|q . dK| / sqrt(d) * ||v - o|| + ||dV||) (the key error counted along the
                       suffix's queries, not by its norm); with the true K/V errors in every layer, or
                       with the online deviation at layer 2 only (alone, and as the hybrid's score)
    answer             the attention of full prefill's answer (teacher forced) over full prefill's own
                       exact cache: what the question's attention over the stale cache estimates
    answer x true V    both known exactly, per layer
    answer x deviation the answer's attention with the online deviation
    grad V part        the oracle's own score with only its values' share (how much of the gain the
                       stored values carry, against the keys')
    grad of naive top-1  the oracle's score for one token, the one naive reuse (r = 0) predicts first:
                       no answer needed, but still the exact K/V

    python benchmarks/blend/selection_proxy.py --split dev --per-genre 2 \\
        --out benchmarks/blend/results/selection-proxy-fp32.md

A first-order proxy: recomputing a token also corrects the tokens after it, which it does not see, so
it ranks scores, it does not predict fidelity (benchmarks/blend/bench_blend.py measures that).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import corpus
import oracle

from ragkv import models
from ragkv.blend import BlendConfig, BlendEngine
from ragkv.blend import attention as attention_mod
from ragkv.blend.select import DeviationSelector, Schedule, Selector
from ragkv.policy import PrecomputePolicy
from ragkv.store import open_store

N_TOKENS = 32
RATIOS = (0.1, 0.15)


def _norm(x: torch.Tensor) -> torch.Tensor:
    return x / x.sum(-1, keepdim=True).clamp_min(1e-12)


def _preselect(q: torch.Tensor, score: torch.Tensor, k: int, widen: float = 3.0) -> torch.Tensor:
    """``score`` on the top ``widen`` x k tokens by ``q``, -1 elsewhere (the hybrid's two stages)."""
    start = torch.topk(q, min(q.numel(), math.ceil(widen * k))).indices
    out = torch.full_like(q, -1.0)
    out[start] = score[start]
    return out


def _hybrid(q: torch.Tensor, dev: torch.Tensor, k: int) -> torch.Tensor:
    return _preselect(q, dev.sqrt() * q, k)


SCORES = {  # name -> f(signals of one prompt, budget k) -> [C]; signals: see collect()
    "deviation": lambda s, k: s["dev"],
    "query": lambda s, k: _norm(s["probe"]).sum(0),
    "hybrid": lambda s, k: _hybrid(_norm(s["probe"]).sum(0), s["dev"], k),
    "hybrid, K deviation": lambda s, k: _hybrid(_norm(s["probe"]).sum(0), s["dev_k"], k),
    "hybrid, K x V deviation": lambda s, k: _hybrid(_norm(s["probe"]).sum(0), (s["dev_k"] * s["dev"]).sqrt(), k),
    "query x true V": lambda s, k: (_norm(s["probe"]) * s["v_err"]).sum(0),
    "query x true K": lambda s, k: (_norm(s["probe"]) * s["k_err"]).sum(0),
    "output change, true K/V errors": lambda s, k: s["change"].sum(0),
    "output change at layer 2, online": lambda s, k: s["change2"],
    "hybrid, output change at layer 2": lambda s, k: _preselect(_norm(s["probe"]).sum(0), s["change2"], k),
    "answer": lambda s, k: _norm(s["answer"]).sum(0),
    "answer x true V": lambda s, k: (_norm(s["answer"]) * s["v_err"]).sum(0),
    "answer x deviation": lambda s, k: _norm(s["answer"]).sum(0) * s["dev"].sqrt(),
    "grad V part": lambda s, k: s["grad_v"],
    "grad of naive top-1": lambda s, k: s["grad_q"],
    "oracle (grad)": lambda s, k: s["grad_k"] + s["grad_v"],
}


class _Capture(Selector):
    """Runs the probe (keeping, per layer, the suffix's attention to the chunk tokens and its attention
    output; ``collect`` catches its queries), then computes every chunk token up to layer 2 and keeps their deviation
    there (norms, and the K/V differences themselves)."""

    name = "capture"

    def __init__(self, out: dict):
        self.out = out

    def schedule(self, req):
        P, C, probs_l, out_l = req.prefix_len, req.chunk_len, [], []

        def observe(li, probs, values):  # probs [Hq, S, T], values [Hkv, T, D]
            hq, s, t = probs.shape
            probs_l.append(probs[:, :, P : P + C].float().cpu())
            hkv = values.shape[0]
            out_l.append(torch.bmm(probs.reshape(hkv, hq // hkv * s, t), values.float()).view(hq, s, -1).cpu())

        req.probe(observe)
        self.out["probe_full"], self.out["probe_out"] = probs_l, out_l
        self.out["probe"] = torch.stack([pr.mean((0, 1)) for pr in probs_l])

        def keep(fresh_k, cached_k, fresh_v, cached_v):
            for name, signal in (("dev", "v"), ("dev_k", "k")):
                self.out[name] = DeviationSelector(signal=signal).score(fresh_k, cached_k, fresh_v, cached_v).float().cpu()
            self.out["dk2"], self.out["dv2"] = (fresh_k - cached_k).float().cpu(), (fresh_v - cached_v).float().cpu()
            return self.out["dev"]

        return Schedule(torch.arange(C), {2: C}, keep)


def _output_change(probs, queries, out, stale_v, dk, dv) -> torch.Tensor:
    """[C] first-order bound on how much correcting each chunk token moves the suffix's attention output
    in one layer: sum over heads and suffix rows of a * (|q . dk| * scale * ||v - o|| + ||dv||).
    probs [Hq, S, C], queries [Hq, S, D], out [Hq, S, D], stale_v / dk / dv [Hkv, C, D]."""
    g = probs.shape[0] // dk.shape[0]
    dk, dv, v = (x.repeat_interleave(g, 0) for x in (dk, dv, stale_v))
    dlogit = torch.bmm(queries, dk.transpose(1, 2)).abs() * queries.shape[-1] ** -0.5  # [Hq, S, C]
    spread = torch.cdist(out, v)  # ||v_t - o_i||
    return (probs * (dlogit * spread + dv.norm(dim=-1)[:, None, :])).sum((0, 1))


def collect(engine: BlendEngine, eager, p: dict) -> dict:
    """Every signal of one prompt: [L, C] per layer (probe, answer, v_err) or [C]."""
    a, tok = engine.adapter, engine.tokenizer
    engine.ensure(p["contexts"])
    prompt = engine.build_prompt(p["question"], p["contexts"])
    P, C = len(prompt.prefix_ids), sum(map(len, prompt.chunk_ids))
    ids = torch.tensor([prompt.input_ids], device=a.device)
    sig: dict = {}
    with torch.inference_mode():
        _, exact = a.forward(ids)
        cache = a.cache_from([lay.keys.clone() for lay in exact.layers], [lay.values.clone() for lay in exact.layers])
        cache.crop(-1)
        target = a.generate(ids, cache, tok, max_new_tokens=N_TOKENS, do_sample=False)
        naive = engine.prefill_prompt(prompt, ratio=0.0)
        stale, stale_top1 = naive.cache, naive.logits.argmax()[None]
        # the true K/V errors of the stored chunk tokens, per layer [Hkv, C, D]
        dk = [(ex.keys[0, :, P : P + C] - st.keys[0, :, P : P + C]).float().cpu() for ex, st in zip(exact.layers, stale.layers)]
        dv = [(ex.values[0, :, P : P + C] - st.values[0, :, P : P + C]).float().cpu() for ex, st in zip(exact.layers, stale.layers)]
        sig["k_err"], sig["v_err"] = (torch.stack([d.norm(dim=-1).norm(dim=0) for d in err]) for err in (dk, dv))
        # the answer's attention, teacher forced over full prefill's cache (eager: attention weights out)
        exact.crop(-1)  # then the last prompt token and the answer, as the grad oracle feeds them
        answer = torch.cat([ids[0, -1:], target[:-1]])[None]
        out = eager(input_ids=answer, cache=exact, output_attentions=True, use_cache=True)
        sig["answer"] = torch.stack([att[0, :, :, P : P + C].float().mean((0, 1)) for att in out.attentions]).cpu()
        queries: dict = {}
        real = attention_mod.probe_attention

        def spy(module, query, *args, **kwargs):  # the probe's queries (after RoPE), per layer
            queries[module.layer_idx] = query[0].float().cpu()
            return real(module, query, *args, **kwargs)

        attention_mod.probe_attention = spy
        try:
            engine.with_config(selector=_Capture(sig)).prefill_prompt(prompt, ratio=0.5)
        finally:
            attention_mod.probe_attention = real
        stale_v = [st.values[0, :, P : P + C].float().cpu() for st in stale.layers]
        sig["change"] = torch.stack([_output_change(sig["probe_full"][li], queries[li], sig["probe_out"][li], stale_v[li],
                                                    dk[li], dv[li]) for li in range(len(dk))])
        sig["change2"] = _output_change(sig["probe_full"][2], queries[2], sig["probe_out"][2], stale_v[2], sig["dk2"], sig["dv2"])
        del sig["probe_full"], sig["probe_out"], sig["dk2"], sig["dv2"]
    sig["grad_k"], sig["grad_v"] = oracle.answer_gradient(engine, prompt, target, parts=True)
    sig["grad_q"] = oracle.answer_gradient(engine, prompt, stale_top1)
    return sig


def captured(sig: dict, score: torch.Tensor, k: int) -> float:
    gain = (sig["grad_k"] + sig["grad_v"]).clamp_min(0)
    return float(gain[torch.topk(score, k).indices].sum() / gain.sum().clamp_min(1e-12))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--split", default="dev", choices=["dev", "test", "all"])
    ap.add_argument("--per-genre", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", required=True, help="a .md table; the per-prompt numbers go beside it as .json")
    args = ap.parse_args()
    model, tok = models.load("smollm2-135m", dtype=args.dtype)
    eager, _ = models.load("smollm2-135m", dtype=args.dtype)
    eager.set_attn_implementation("eager")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    dtype = str(model.dtype).removeprefix("torch.")
    store = open_store(f"disk://{out.parent.resolve()}/store-{dtype}?max_bytes=20G")
    # context 0: the stored K/V the committed results (selection-proxy-fp32.*) were measured on
    engine = BlendEngine(model, tok, store, BlendConfig(), policy=PrecomputePolicy(context=0))
    prompts = corpus.load(args.split)
    prompts = [p for g in corpus.GENRES for p in [q for q in prompts if q["genre"] == g][: args.per_genre]]
    rows = []
    for i, p in enumerate(prompts):
        t0 = time.time()
        sig = collect(engine, eager, p)
        C = sig["grad_k"].numel()
        gain = (sig["grad_k"] + sig["grad_v"]).clamp_min(0).sum()
        row = {"id": p["id"], "genre": p["genre"], "chunk_tokens": C,
               "v_share": float(sig["grad_v"].clamp_min(0).sum() / (sig["grad_v"].clamp_min(0).sum() + sig["grad_k"].clamp_min(0).sum())),
               "gain_total": float(gain), "captured": {}}
        for r in RATIOS:
            k = math.ceil(r * C)
            row["captured"][f"{r:g}"] = {name: captured(sig, f(sig, k), k) for name, f in SCORES.items()}
        rows.append(row)
        print(f"[{i + 1}/{len(prompts)}] {p['id']} ({time.time() - t0:.0f} s): "
              + " ".join(f"{n} {v:.2f}" for n, v in row["captured"]["0.15"].items()), flush=True)
    command = "python " + " ".join(sys.argv)
    out.with_suffix(".json").write_text(json.dumps({"command": command, "dtype": dtype, "prompts": rows}, indent=1))
    lines = [f"# Selection proxy: captured first-order gain ({dtype}, {len(rows)} {args.split} prompts)", "",
             f"`{command}`", "", "Share of the grad oracle's predicted gain held by each score's top r of chunk "
             "tokens (mean over prompts, worst prompt in brackets); 1.0 = the oracle's own choice. See the "
             "script's docstring for what each score is.", "",
             "| score | " + " | ".join(f"r = {r:g}" for r in RATIOS) + " |", "|---|" + "---|" * len(RATIOS)]
    for name in SCORES:
        cells = []
        for r in RATIOS:
            v = [row["captured"][f"{r:g}"][name] for row in rows]
            cells.append(f"{sum(v) / len(v):.3f} [{min(v):.3f}]")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    share = [row["v_share"] for row in rows]
    lines += ["", f"Values' share of the positive predicted gain: mean {sum(share) / len(share):.2f} "
              f"(min {min(share):.2f}, max {max(share):.2f}); the keys' is the rest."]
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
