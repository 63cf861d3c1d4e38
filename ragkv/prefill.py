"""The one write path: prefill entries of a keyspace on the model and store them.

    Prefiller.prefill   chunks -> per chunk, per layer (K, V), each prefilled on its own as an entry
                        of its kind (ragkv.keys.Keyspace.layout): 'chunk' behind the sink, the gap
                        and its neighbour context; 'lead' right behind the sink; 'prefix' at 0
    Prefiller.write     one entry encoded (ragkv.store.entry) and put into the store
    Prefiller.compute   entries of mixed kinds prefilled and written back (a failed write is logged,
                        never raised): the read path's misses
    Prefiller.ensure    every chunk of some texts stored (what a demo or a test needs in one call)

The precompute job (ragkv.precompute, ragkv.writer) and every Ray actor (ragkv.distributed) write
through ``prefill`` and ``write``; the read path (ragkv.blend) calls ``compute`` for what it misses,
so a chunk is always stored the same way, whoever computed it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from ragkv.adapter import ModelAdapter
from ragkv.fingerprint import fingerprint
from ragkv.keys import Keyspace, ModelFingerprint
from ragkv.neighbours import neighbour_contexts
from ragkv.policy import PrecomputePolicy, StorageFormat
from ragkv.prompt import PromptTemplate, check_window
from ragkv.store.entry import encode
from ragkv.store.errors import StoreError

log = logging.getLogger("ragkv.prefill")
KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V), each [kv_heads, n, head_dim]


class Prefiller:
    """Entries of one model under one precompute policy, namespace and storage format, computed on
    the model and written to ``store``. ``keys`` (Keyspace) names them; readers and writers of one
    store agree on the policy and namespace. ``model_fingerprint``: the model's (ragkv.fingerprint),
    when the caller has it (e.g. ``fingerprint_dir`` of the checkpoint); computed from the model
    otherwise."""

    def __init__(self, model, tokenizer, store, *, template: PromptTemplate | None = None,
                 policy: PrecomputePolicy | None = None, storage: StorageFormat | None = None,
                 namespace: str = "", model_fingerprint: ModelFingerprint | None = None):
        self.model, self.tokenizer, self.store = model, tokenizer, store
        self.adapter = ModelAdapter.of(model)
        self.template = template or PromptTemplate.for_tokenizer(tokenizer)
        self.policy = (policy or PrecomputePolicy()).resolve(self.adapter.max_positions)
        self.storage = storage or StorageFormat()
        fp = model_fingerprint or fingerprint(model)
        self.keys = Keyspace.for_template(fp, self.template, self.policy, namespace)

    def prefill(self, chunks: Sequence[Sequence[int]], kind: str = "chunk",
                contexts: Sequence[Sequence[int]] | None = None, batch_tokens: int = 4096) -> list[KV]:
        """Per chunk, per layer (K, V) of each chunk prefilled on its own as an entry of ``kind``;
        ``contexts[i]``: the neighbour chunks a 'chunk' entry is prefilled behind under ``context=k``."""
        start, _ = self.keys.layout(kind)  # (a clear error for an unknown kind)
        sink = [] if kind == "prefix" else list(self.keys.sink_ids)
        gap = start - len(sink)
        with self.adapter.lock:
            return prefill_kv(self.adapter, sink, chunks, batch_tokens, gap=gap,
                              contexts=contexts if kind == "chunk" and self.policy.context else None)

    def write(self, key: str, ids: Sequence[int], kv: KV, kind: str = "chunk") -> int:
        """Encode and store one entry; -> bytes written (0: the store already held it). Raises
        StoreError when the store could not take it."""
        storage = self.storage.resolve(self.keys.fingerprint.dtype)
        enc = encode(self.keys.meta(key, ids, kind, storage), kv)
        return enc.nbytes if self.store.put_encoded(key, enc) else 0

    def compute(self, entries: Sequence[tuple[str, Sequence[int], str]], write_back: bool = True,
                pool: Sequence[Sequence[int]] | None = None) -> list[KV]:
        """Prefill (key, ids, kind) entries, grouped by kind, and write them back unless
        ``write_back`` is off; a failed write-back (store down or full) is logged, never raised.
        ``pool``: the chunks neighbours are chosen from under ``context=k`` (a prompt's chunks).
        -> the entries' K/V in their order."""
        out: list[KV | None] = [None] * len(entries)
        for kind in ("prefix", "lead", "chunk"):
            idx = [i for i, e in enumerate(entries) if e[2] == kind]
            if not idx:
                continue
            ids = [entries[i][1] for i in idx]
            contexts = None
            if kind == "chunk" and self.policy.context:
                contexts = neighbour_contexts(ids, ids if pool is None else pool, self.policy.context)
            for i, kv in zip(idx, self.prefill(ids, kind, contexts)):
                out[i] = kv
                if write_back:
                    try:
                        self.write(entries[i][0], entries[i][1], kv, kind)
                    except StoreError as e:
                        log.warning("write-back of %s failed: %s", entries[i][0], e)
        return out

    def ensure(self, contexts: Sequence[str], pool: Sequence[Sequence[int]] | None = None) -> tuple[list[str], int]:
        """Make sure every context's entries are in the store (its chunk entry and, under ``lead``,
        its lead entry, as the precompute job writes them); -> (the chunks' keys, number of chunks
        with an entry computed). ``pool``: the chunks (token ids) neighbours are chosen from
        (default: the contexts' own)."""
        chunks = self.template.chunks(contexts, self.adapter.max_positions)
        keys, missing, computed = [], [], 0
        for ids in chunks:
            entries = self.keys.entry_keys(ids)
            keys.append(entries[0][0])
            todo = [(key, ids, kind) for key, kind in entries if not self.store.contains(key)]
            missing += todo
            computed += bool(todo)
        if missing:
            self.compute(missing, pool=chunks if pool is None else pool)
        return keys, computed


def batches(lengths: Sequence[int], sink_len: int, batch_tokens: int) -> list[list[int]]:
    """Indices of chunks grouped for one forward each: longest first (similar lengths batch together,
    little padding), each group within ``batch_tokens`` padded tokens (sink included)."""
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    out, i = [], 0
    while i < len(order):
        n = max(1, batch_tokens // (sink_len + lengths[order[i]]))
        out.append(order[i : i + n])
        i += n
    return out


@torch.inference_mode()
def prefill_kv(
    adapter: ModelAdapter, sink_ids: Sequence[int], chunks: Sequence[Sequence[int]], batch_tokens: int = 4096, gap: int = 0,
    contexts: Sequence[Sequence[int]] | None = None,
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Prefill every chunk behind ``sink_ids`` (and behind ``contexts[i]``, which ends right before
    chunk i: at most ``gap`` of its last tokens, at positions len(sink) + gap - len(context) ...);
    return per chunk, per layer (K, V), each ``[kv_heads, len(chunk), head_dim]`` (keys rotated at
    positions len(sink) + gap + i). Only the chunk's own rows are kept.

    Chunks are batched (``batches``; right-padded: with a causal mask, padding at the end never
    reaches a real token, so no attention mask is needed), one forward per batch.
    """
    s = len(sink_ids)
    longest = max(map(len, chunks), default=0)
    check_window(s + gap + longest, adapter.max_positions, f"a chunk of {longest} behind a {s}-token sink and a "
                 f"gap of {gap}", "use shorter chunks or a smaller PrecomputePolicy gap")
    if contexts is None:
        contexts = [()] * len(chunks)
    elif len(contexts) != len(chunks):
        raise ValueError(f"{len(contexts)} contexts for {len(chunks)} chunks")
    contexts = [list(c)[len(c) - min(len(c), gap):] for c in contexts]
    out: list = [None] * len(chunks)
    rows = [len(x) + len(c) for x, c in zip(contexts, chunks)]
    for group in batches(rows, s, batch_tokens):
        width = s + max(rows[ci] for ci in group)
        ids = torch.zeros((len(group), width), dtype=torch.long)
        pos = torch.zeros((len(group), width), dtype=torch.long)
        for row, ci in enumerate(group):
            n_ctx = len(contexts[ci])
            ids[row, : s + rows[ci]] = torch.tensor([*sink_ids, *contexts[ci], *chunks[ci]])
            # sink at 0.., then context + chunk contiguous, the chunk from s + gap
            pos[row, :s] = torch.arange(s)
            pos[row, s : s + rows[ci]] = torch.arange(s + gap - n_ctx, s + gap + len(chunks[ci]))
            pos[row, s + rows[ci] :] = s + gap + len(chunks[ci]) - 1  # padding: never past the chunk's end
        layers = adapter.prefill_layers(ids.to(adapter.device), pos.to(adapter.device))
        for row, ci in enumerate(group):
            a, b = s + len(contexts[ci]), s + rows[ci]
            out[ci] = [(k[row, :, a:b].clone(), v[row, :, a:b].clone()) for k, v in layers]
    return out
