"""Offline oracles for the selection benchmark: which chunk tokens would be best to recompute, knowing
what a selector at query time cannot know (the K/V of full prefill).

    kv     rank chunk tokens by the true error of their stored K/V: over every layer, the squared
           distance between the fused (re-rotated, stored) K/V and full prefill's K/V, each layer
           normalised by its mean energy, K and V summed. Recomputing exactly the worst tokens.
    grad   rank chunk tokens by the first-order effect on the answer of making their K/V exact: the
           gradient of the teacher-forced loss of full prefill's answer with respect to the fused
           cache, dotted with (exact - stored) K/V of each token, summed over layers (attribution
           patching). Knows the answer and the exact K/V: no selector at query time does.
    mix    the kv rank fused with the question's attention measured on full prefill's own cache (the
           query selector's score if its probe saw corrected K/V): a stale token the question does not
           read matters less.

Neither is a proof of optimality (the best subset depends on how errors propagate through layers;
an exhaustive search is out of reach), but both use information no online selector has, so they
bound what selection can reach from above in practice. ``FixedSelector`` replays a ranking through
the engine, recomputing the top ``ratio`` of chunk tokens in every layer as the query selector does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from ragkv.blend import BlendConfig, BlendEngine, QuerySelector
from ragkv.blend.select import Schedule, SelectionRequest, Selector
from ragkv.store import open_store


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Rank of each value, 0 = smallest (ties by position)."""
    out = torch.empty_like(x, dtype=torch.float32)
    out[torch.argsort(x)] = torch.arange(x.numel(), dtype=torch.float32, device=x.device)
    return out

@dataclass(frozen=True)
class FixedSelector(Selector):
    """Recompute the first ``ceil(ratio * C)`` chunk rows of ``order`` (best first) in every layer."""

    name: ClassVar[str] = "fixed"
    order: tuple[int, ...] = ()

    def schedule(self, req: SelectionRequest) -> Schedule:
        n = req.keep(req.ratio)
        if len(self.order) != req.chunk_len:
            raise ValueError(f"the order ranks {len(self.order)} rows, the prompt has {req.chunk_len}")
        return Schedule(torch.tensor(sorted(self.order[:n]), dtype=torch.long), {})


@torch.inference_mode()
def kv_error(engine: BlendEngine, prompt) -> torch.Tensor:
    """[C] true K/V error of each chunk token's stored K/V against full prefill (see module doc)."""
    a = engine.adapter
    ids = torch.tensor([prompt.input_ids], device=a.device)
    _, exact = a.forward(ids)
    stale = engine.prefill_prompt(prompt, ratio=0.0).cache  # chunk rows = stored K/V, re-rotated
    P, C = len(prompt.prefix_ids), sum(map(len, prompt.chunk_ids))
    err = torch.zeros(C)
    for li in range(a.num_layers):
        for ex, st in ((exact.layers[li].keys, stale.layers[li].keys), (exact.layers[li].values, stale.layers[li].values)):
            e, s = ex[0, :, P : P + C].float(), st[0, :, P : P + C].float()  # [H, C, D]
            err += ((e - s) ** 2).sum((0, 2)).cpu() / (e**2).sum((0, 2)).mean().clamp_min(1e-12).cpu()
    return err


@torch.inference_mode()
def exact_attention(engine: BlendEngine, prompt) -> torch.Tensor:
    """[C] the query selector's score computed over full prefill's exact K/V: the prompt's segments
    are stored exactly (sliced out of a full prefill) in a private memory store, then probed."""
    a = engine.adapter
    store = open_store("memory://?max_bytes=4G")
    probe = BlendEngine(engine.model, engine.tokenizer, store, BlendConfig(selector=QuerySelector(rows=None, offset_decay=0.0)),
                        template=engine.template, policy=engine.prefiller.policy, namespace="oracle")
    _, exact = a.forward(torch.tensor([prompt.input_ids], device=a.device))
    pieces = [(probe.keys.prefix_key(prompt.prefix_ids), prompt.prefix_ids, 0, "prefix")]
    pieces += [(probe.keys.chunk_key(c), c, s, "chunk") for c, s in zip(prompt.chunk_ids, prompt.chunk_positions())]
    for key, ids, start, kind in pieces:
        layers = [(lay.keys[0, :, start : start + len(ids)].clone(), lay.values[0, :, start : start + len(ids)].clone())
                  for lay in exact.layers]
        store.put(replace(probe.keys.meta(key, ids, kind), start_pos=start), layers)
    scores = {}
    sel = probe.config.selector

    class Capture(QuerySelector):  # keep the scores the probe computes
        def schedule(self, req):
            scores["s"] = sel.scores(req)
            return Schedule(torch.arange(req.chunk_len), {})

    probe.with_config(selector=Capture()).prefill_prompt(prompt, ratio=0.5)
    return scores["s"].cpu()


def answer_gradient(engine: BlendEngine, prompt, target: torch.Tensor, parts: bool = False):
    """[C] first-order decrease of the teacher-forced loss of ``target`` (full prefill's answer) when
    a chunk token's K/V go from stored to exact in every layer (see module doc); with ``parts``, the
    keys' and the values' shares ([C], [C]) instead of their sum."""
    a = engine.adapter
    P, C, T = len(prompt.prefix_ids), sum(map(len, prompt.chunk_ids)), len(prompt.input_ids)
    ids = torch.tensor([prompt.input_ids], device=a.device)
    with torch.inference_mode():
        _, exact = a.forward(ids)
        stale = engine.prefill_prompt(prompt, ratio=0.0).cache  # positions [0, T-1)
        deltas = [(ex.keys[:, :, P : P + C] - st.keys[:, :, P : P + C], ex.values[:, :, P : P + C] - st.values[:, :, P : P + C])
                  for ex, st in zip(exact.layers, stale.layers)]
    needed = [p.requires_grad for p in engine.model.parameters()]
    for p in engine.model.parameters():
        p.requires_grad_(False)
    try:  # clones made outside inference mode are ordinary tensors that can require grad
        with torch.inference_mode(False), torch.enable_grad():
            leaves = [(st.keys.clone().requires_grad_(), st.values.clone().requires_grad_()) for st in stale.layers]
            cache = a.cache_from([k for k, _ in leaves], [v for _, v in leaves])
            inp = torch.cat([ids[0, -1:], target[:-1]])[None].clone()
            logits, _ = a.forward(inp, cache, torch.arange(T - 1, T - 1 + inp.shape[1], device=a.device)[None])
            loss = torch.nn.functional.cross_entropy(logits[0].float(), target.clone())
            loss.backward()
    finally:
        for p, n in zip(engine.model.parameters(), needed):
            p.requires_grad_(n)
    by_k, by_v = torch.zeros(C), torch.zeros(C)
    for (k, v), (dk, dv) in zip(leaves, deltas):
        gk, gv = k.grad[0, :, P : P + C].float(), v.grad[0, :, P : P + C].float()
        by_k -= (gk * dk[0].float()).sum((0, 2)).cpu()
        by_v -= (gv * dv[0].float()).sum((0, 2)).cpu()
    # loss decrease predicted by patching each token: larger is better
    return (by_k, by_v) if parts else by_k + by_v


def orders(engine: BlendEngine, prompt, target: torch.Tensor, kinds=("kv", "mix", "grad")) -> dict[str, tuple[int, ...]]:
    """Oracle rankings of the chunk rows, best first, for each of ``kinds`` ("kv", "mix", "grad";
    "grad" scores against full prefill's answer ``target``)."""
    unknown = set(kinds) - {"kv", "mix", "grad"}
    if unknown:
        raise ValueError(f"unknown oracle(s) {sorted(unknown)}; valid: kv, mix, grad")
    scores = {}
    if {"kv", "mix"} & set(kinds):
        scores["kv"] = kv_error(engine, prompt)
    if "mix" in kinds:
        scores["mix"] = _ranks(scores["kv"]) + _ranks(exact_attention(engine, prompt))
    if "grad" in kinds:
        scores["grad"] = answer_gradient(engine, prompt, target)
    return {name: tuple(torch.argsort(x, descending=True).tolist()) for name, x in scores.items()}
