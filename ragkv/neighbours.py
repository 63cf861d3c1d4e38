"""Which chunks a chunk is prefilled behind under ``PrecomputePolicy(context=k)``: its k most similar
other chunks, by TF-IDF cosine over the model's own token ids.

Lexical, deterministic and model-free: no embedding model to install, and the same corpus gives the
same neighbours on every machine and shard. On the blend benchmark's corpus (benchmarks/blend) the
top neighbour comes from the chunk's own document for 111 of 123 dev and 186 of 251 test chunks.
Chunks with identical token ids are never each other's neighbours. Scores are computed in blocks of
rows (memory ``block x len(chunks)``), so a corpus of 10^5 chunks needs no N x N matrix.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from collections.abc import Sequence

import torch


def tfidf(chunks: Sequence[Sequence[int]]) -> torch.Tensor:
    """Sparse [len(chunks), vocab seen] rows of (1 + log tf) x log((1 + N) / (1 + df)), unit length."""
    n = len(chunks)
    df = Counter(t for ids in chunks for t in set(ids))
    col = {t: j for j, t in enumerate(sorted(df))}
    idf = {t: math.log((1 + n) / (1 + d)) for t, d in df.items()}
    rows, cols, vals = [], [], []
    for i, ids in enumerate(chunks):
        counts = Counter(ids)
        w = {t: (1 + math.log(c)) * idf[t] for t, c in counts.items()}
        norm = math.sqrt(sum(x * x for x in w.values())) or 1.0
        for t, x in w.items():
            rows.append(i)
            cols.append(col[t])
            vals.append(x / norm)
    return torch.sparse_coo_tensor(torch.tensor([rows, cols], dtype=torch.long).reshape(2, -1),
                                   torch.tensor(vals, dtype=torch.float32), (n, len(col)),
                                   check_invariants=True).coalesce()


def lexical_neighbours(chunks: Sequence[Sequence[int]], k: int, block: int = 256,
                       rows: Sequence[int] | None = None) -> list[list[int]]:
    """For each chunk (or each of ``rows``), the indices of its ``k`` most similar other chunks, most
    similar first (ties by index); fewer when fewer chunks share a weighted token with it (a token in
    every chunk weighs nothing). ``chunks``: token ids, the whole corpus the weights come from."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    n = len(chunks)
    rows = list(range(n)) if rows is None else list(rows)
    if n == 0 or k == 0 or not rows:
        return [[] for _ in rows]
    m = tfidf(chunks)
    m_t = m.t().coalesce()  # [vocab, N], sparse
    keys = [tuple(ids) for ids in chunks]
    out: list[list[int]] = []
    for lo in range(0, len(rows), block):
        part = rows[lo : lo + block]
        with warnings.catch_warnings():  # "sparse CSR support is in beta", raised inside torch.sparse.mm
            warnings.simplefilter("ignore", UserWarning)
            sims = torch.sparse.mm(m.index_select(0, torch.tensor(part, dtype=torch.long)), m_t).to_dense()  # [b, N]
        out.extend(_top(sims[r], i, k, keys) for r, i in enumerate(part))
    return out


def _top(row: torch.Tensor, i: int, k: int, keys: list[tuple]) -> list[int]:
    row[i] = 0.0
    wide = min(len(keys), 4 * k + 8)
    while True:
        cand = torch.topk(row, wide).indices.tolist()
        picked = [j for j in sorted(cand, key=lambda j: (-float(row[j]), j)) if row[j] > 0 and keys[j] != keys[i]]
        if len(picked) >= k or wide == len(keys):
            return picked[:k]
        wide = min(len(keys), 4 * wide)


def neighbour_contexts(chunks: Sequence[Sequence[int]], pool: Sequence[Sequence[int]], k: int) -> list[list[int]]:
    """Per chunk of ``chunks``, the token ids it is prefilled behind under ``context=k``: its k nearest
    chunks among ``pool`` (and ``chunks``), concatenated with the most similar one last, so that it
    sits right before the chunk. ``pool``: the corpus the writer sees (the precompute job's corpus, or
    the prompt's chunks for a chunk computed at query time)."""
    universe: list[tuple[int, ...]] = []
    index: dict[tuple[int, ...], int] = {}
    for ids in (*pool, *chunks):
        t = tuple(ids)
        if t not in index:
            index[t] = len(universe)
            universe.append(t)
    wanted = [index[tuple(ids)] for ids in chunks]
    near = lexical_neighbours(universe, k, rows=wanted)
    return [[t for j in reversed(nb) for t in universe[j]] for nb in near]
