"""Precompute chunks into a store for vLLM, as ``ragkv precompute`` does, without a transformers
model in the caller's process (with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` that process is vLLM's).

    ids = precompute(model_dir, "float32", store, [(question, contexts), ...])   # -> each prompt's ids

A spawned child loads the transformers model, writes every context's chunk entries (``BlendEngine.ensure``:
the same keys, policy and encoding the connector reads) and returns the prompts' token ids built by
ragkv's PromptTemplate. The dtype must be vLLM's: it is part of every key.
"""

from __future__ import annotations

import multiprocessing as mp


def _run(model_dir: str, dtype: str, store: str, prompts: list, namespace: str, out) -> None:
    try:
        from ragkv.blend import BlendEngine
        from ragkv.models import load
        from ragkv.store import open_store

        model, tok = load(model_dir, dtype=dtype)
        engine = BlendEngine(model, tok, open_store(store), namespace=namespace)
        ids = []
        for question, contexts in prompts:
            engine.ensure(contexts)
            ids.append(engine.build_prompt(question, contexts).input_ids)
        out.put(("ok", ids))
    except BaseException as e:  # reported to the parent, which raises it
        out.put(("error", f"{type(e).__name__}: {e}"))


def precompute(model_dir: str, dtype: str, store: str, prompts: list[tuple[str, list[str]]],
               namespace: str = "", timeout: float = 1800) -> list[list[int]]:
    """Store the chunk entries of every (question, contexts) pair; -> each prompt's token ids."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_run, args=(model_dir, dtype, store, list(prompts), namespace, out))
    child.start()
    try:
        status, value = out.get(timeout=timeout)
    finally:
        child.join(timeout=60)
    if status != "ok":
        raise RuntimeError(f"precompute in a child process failed: {value}")
    return value
