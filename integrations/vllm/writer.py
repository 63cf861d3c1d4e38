"""The worker's two jobs: blend a prompt and write its K/V into vLLM's paged cache; write back the
chunks of a prompt vLLM prefilled itself."""

from __future__ import annotations

import torch

from ragkv.prompt import Prompt

STAT_KEYS = ("chunks", "hits", "misses", "corrupt", "vanished", "store_errors", "timeouts", "prompt_tokens",
             "reused_tokens", "recomputed_tokens", "ratio", "selector", "t_total")


def prompt_of(job) -> Prompt:
    """The ragkv Prompt of a job's ids split by the scheduler's layout."""
    ids, pos = list(job.token_ids), job.prefix_len
    chunks = []
    for n in job.chunk_lens:
        chunks.append(ids[pos:pos + n])
        pos += n
    return Prompt(ids[:job.prefix_len], chunks, ids[pos:])


def slot_mapping(block_ids, start: int, end: int, block_size: int) -> torch.Tensor:
    """vLLM's slot of every prompt position in [start, end): block id * block size + offset."""
    pos = torch.arange(start, end)
    blocks = torch.as_tensor(block_ids, dtype=torch.long)
    if (end - 1) // block_size >= len(blocks):
        raise ValueError(f"positions up to {end - 1} need {(end - 1) // block_size + 1} blocks, "
                         f"the request has {len(blocks)}")
    return blocks[pos // block_size] * block_size + pos % block_size


@torch.inference_mode()
def blend_and_write(engine, job, layers, block_size: int) -> dict:
    """Blend the job's prompt (ragkv.blend) and write positions [start, end) of every layer's K/V
    into vLLM's cache through the layer's own ``impl.do_kv_cache_update`` (whatever the backend's
    block layout is). -> the blend's stats."""
    res = engine.prefill_prompt(prompt_of(job), ratio=job.ratio)
    if len(res.cache) != len(layers):  # VllmLayers.cache_from: per layer (K, V) [1, kv_heads, T - 1, hd]
        raise RuntimeError(f"blend returned {len(res.cache)} layers, vLLM has {len(layers)}")
    slots = None
    for layer, (keys, values) in zip(layers, res.cache):
        dev = layer.kv_cache.device
        if slots is None:
            slots = slot_mapping(job.block_ids, job.start, job.end, block_size).to(dev)
        k = keys[0, :, job.start:job.end].transpose(0, 1).contiguous().to(dev)  # [n, kv_heads, hd]
        v = values[0, :, job.start:job.end].transpose(0, 1).contiguous().to(dev)
        layer.impl.do_kv_cache_update(layer, k, v, layer.kv_cache, slots)
    stats = res.stats.as_dict()
    return {k: stats[k] for k in STAT_KEYS}


@torch.inference_mode()
def write_back(engine, job) -> int:
    """Prefill on their own (ragkv's precompute policy) and store the prompt's chunks (and prefix)
    the store lacks, and the first chunk's lead entry under ``engine.keys.lead``. -> entries written."""
    prompt, keys = prompt_of(job), engine.keys
    entries = [(keys.chunk_key(ids), ids, "chunk") for ids, stored in zip(prompt.chunk_ids, job.stored) if not stored]
    if keys.lead and prompt.chunk_ids:
        entries.append((keys.lead_key(prompt.chunk_ids[0]), prompt.chunk_ids[0], "lead"))
    if prompt.prefix_ids:
        entries.append((keys.prefix_key(prompt.prefix_ids), prompt.prefix_ids, "prefix"))
    missing = [e for e in entries if not engine.store.contains(e[0])]
    if missing:
        engine.prefiller.compute(missing, pool=prompt.chunk_ids)
    return len(missing)
