"""RagKVConnector with vLLM's offline LLM on SmolLM2 (fp32), real disk store, under vLLM v1's
defaults: prefix caching on, chunked prefill on with a budget of MAX_BATCHED_TOKENS per step (below one
block: every prefill vLLM runs takes several steps, the rest a blended prompt leaves to vLLM
included). The blend runs on vLLM's own model (tests/vllm_connector/test_native.py checks it layer by
layer). vLLM keeps its own prefills in its prefix cache, so a test that needs the connector to blend a
prompt vLLM has already prefilled empties that cache first (``llm.reset_prefix_cache()``)."""

from __future__ import annotations

from vllm_data import BLOCK, DOCS, DTYPE, MAX_BATCHED_TOKENS, SYSTEM

from ragkv.store.disk import DiskStore


def request(llm, ids, max_tokens=16, ratio=None, extra=None, fresh=False):
    """vLLM's RequestOutput for ``ids``. ``extra``: the request's kv_transfer_params (``ratio`` sets
    ragkv_ratio); ``fresh``: vLLM does not read its prefix cache for it."""
    from vllm import SamplingParams

    params = dict(extra or {})
    if ratio is not None:
        params["ragkv_ratio"] = ratio
    args = {"kv_transfer_params": params} if params else None
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, extra_args=args,
                        skip_reading_prefix_cache=True if fresh else None)
    return llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)[0]


def generate(llm, ids, max_tokens=16, ratio=None, extra=None, fresh=False):
    """-> (token ids, text, what the connector reported for the request)."""
    out = request(llm, ids, max_tokens, ratio, extra, fresh)
    return list(out.outputs[0].token_ids), out.outputs[0].text, (out.kv_transfer_params or {}).get("ragkv")


def agreement(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def forget(engine, docs) -> None:
    """Remove every entry of ``docs`` from the store (another test may have stored them)."""
    for ids in engine.template.chunks(docs):
        for key, _ in engine.keys.entry_keys(ids):
            engine.store.delete(key)


def offered_end(ids) -> int:
    """Where the connector's range ends: all of the prompt but its last token, block-aligned."""
    return (len(ids) - 1) // BLOCK * BLOCK


def test_ratio_1_matches_vllms_own_prefill_then_015_answers_from_stored_chunks(vllm_env):
    llm, engine = vllm_env
    docs = DOCS[:3]
    forget(engine, docs)
    ids = engine.build_prompt("Who built the lighthouse at Kerran Point?", docs).input_ids
    assert len(ids) > 4 * MAX_BATCHED_TOKENS
    # nothing stored: vLLM prefills the prompt itself (over several steps), the connector writes its chunks back
    own, own_text, info = generate(llm, ids)
    assert info["recognised"] and not info["offered"] and info["misses"] == 3
    assert "Ada Morrow" in own_text
    # the same prompt again: the chunks are stored now, but vLLM's prefix cache holds the whole
    # prompt (its own K/V): the connector offers nothing
    _, _, info = generate(llm, ids)
    assert info["hits"] == 3 and info["vllm_cached"] == offered_end(ids) and not info["offered"]
    assert info["reason"] == "vLLM's prefix cache held the range"
    llm.reset_prefix_cache()
    # ratio 1 recomputes every chunk token
    full, full_text, info = generate(llm, ids, ratio=1.0)
    assert info["offered"] and info["hits"] == 3 and info["blend"]["ratio"] == 1.0
    assert full == own, (own_text, full_text)  # vLLM's own modules and weights: token for token
    # ratio 0.15: most chunk tokens served from the store
    _, text, info = generate(llm, ids, ratio=0.15)
    blend = info["blend"]
    assert info["offered"] and blend["hits"] == 3 and blend["misses"] == 0
    assert blend["reused_tokens"] > 0 and blend["recomputed_tokens"] < blend["reused_tokens"]
    assert "Ada Morrow" in text


def test_chunks_precomputed_with_transformers_are_hits(vllm_env):
    """A store `ragkv precompute` filled (transformers model, another process) serves vLLM: same keys."""
    from ragkv.gguf import convert_smollm2
    from ragkv.integrations.vllm.precompute import precompute

    llm, engine = vllm_env
    docs = [DOCS[3], DOCS[0]]
    [ids] = precompute(str(convert_smollm2()), DTYPE, engine.store.uri, [
        ("Where is the lighthouse's first lens kept?", docs)])
    assert ids == engine.build_prompt("Where is the lighthouse's first lens kept?", docs).input_ids
    toks, text, info = generate(llm, ids)
    assert info["offered"] and info["blend"]["hits"] == 2 and info["blend"]["ratio"] == 0.15
    own, own_text, info = generate(llm, ids, extra={"ragkv_skip": True})
    assert not info["offered"]
    print(f"ratio 0.15 vs vLLM's own prefill: first {agreement(own, toks)} of {len(own)} tokens identical; "
          f"{own_text!r} vs {text!r}")
    assert toks[:1] == own[:1]


def test_a_missing_entry_falls_back_to_vllms_prefill(vllm_env):
    llm, engine = vllm_env
    docs = [DOCS[1], DOCS[2]]
    keys, _ = engine.ensure(docs)
    engine.store.delete(keys[1])
    ids = engine.build_prompt("How often do ferries leave in winter?", docs).input_ids
    toks, _, info = generate(llm, ids)
    assert info["recognised"] and not info["offered"] and info["hits"] == 1 and info["misses"] == 1
    own, _, _ = generate(llm, ids, extra={"ragkv_skip": True}, fresh=True)
    assert toks == own  # vLLM's own prefill, token for token
    assert engine.store.contains(keys[1])  # written back: the next request hits, in any order
    other = engine.build_prompt("How often do ferries leave in winter?", docs[::-1]).input_ids
    _, _, info2 = generate(llm, other)
    assert info2["offered"] and info2["blend"]["hits"] == 2


def test_a_corrupt_entry_is_recomputed_with_the_right_answer(vllm_env):
    llm, engine = vllm_env
    docs = DOCS[:3]
    keys, _ = engine.ensure(docs)
    assert isinstance(engine.store, DiskStore)
    path = engine.store.path(keys[1])  # the second chunk: read from this entry (the first has its lead entry)
    data = bytearray(path.read_bytes())
    for i in range(len(data) - 4096, len(data)):  # damage the last layers' blobs, keep the header
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    ids = engine.build_prompt("Who built the lighthouse at Kerran Point?", docs).input_ids
    llm.reset_prefix_cache()  # another test may have left vLLM's own prefill of this prompt there
    _, text, info = generate(llm, ids, max_tokens=32)
    assert info["offered"] and info["blend"]["corrupt"] == 1
    assert "Ada Morrow" in text


def test_other_prompts_are_left_to_vllm(vllm_env):
    llm, engine = vllm_env
    tok = engine.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=False)
    ids = tok(ids, add_special_tokens=False)["input_ids"]
    toks, text, info = generate(llm, ids)
    assert not info["recognised"] and not info["offered"]
    # vLLM's own answer, token for token (the answer itself depends on the CPU's bf16 kernels: with
    # AMX this 135M model says "L'Étoile, ...", emulated it said "Paris")
    own, _, _ = generate(llm, ids, extra={"ragkv_skip": True})
    assert text and toks == own


def test_a_system_prefix_from_vllms_prefix_cache_and_chunks_from_ragkv_in_one_prompt(vllm_env):
    """A system prompt of several blocks shared with an earlier prompt comes from vLLM's prefix cache,
    the chunks (in an order no prompt had) from ragkv's store: the connector writes exactly the
    range vLLM lacks, and vLLM prefills the rest over several steps. The blended blocks never become
    prefix-cache hits: vLLM's own prefill of the same prompt afterwards reads only the system prefix."""
    llm, engine = vllm_env
    system = {"role": "system", "content": SYSTEM}

    def chat(question, docs):
        return engine.template.chat([system, {"role": "user", "content": question}], docs).input_ids

    engine.ensure(DOCS)
    warm = chat("Where is the first lens kept?", [DOCS[3]])
    generate(llm, warm, max_tokens=1, extra={"ragkv_skip": True})  # vLLM prefills it and keeps its blocks
    ids = chat("Who built the lighthouse at Kerran Point, and in which year did the engineer build it?",
               [DOCS[2], DOCS[0], DOCS[1]])
    shared = agreement(warm, ids) // BLOCK * BLOCK
    end = offered_end(ids)
    assert shared >= 2 * BLOCK and len(ids) - end > MAX_BATCHED_TOKENS  # (the premises)
    toks, text, info = generate(llm, ids, ratio=1.0)
    assert info["vllm_cached"] == shared and info["written"] == [shared, end]  # vLLM's blocks are read, not written
    assert info["blend"]["hits"] == 3 and "Ada Morrow" in text
    own = request(llm, ids, extra={"ragkv_skip": True})
    assert own.num_cached_tokens == shared  # the system prefix only: nothing of the blend
    assert list(own.outputs[0].token_ids) == toks  # ratio 1 is vLLM's own prefill
    # vLLM holds the whole prompt now (its own K/V): the connector offers nothing more
    _, _, info = generate(llm, ids)
    assert info["vllm_cached"] == end and not info["offered"]


def test_ragkv_prompt_tokens_blends_a_prompt_and_vllm_teacher_forces_a_continuation(vllm_env):
    """kv_transfer_params["ragkv_prompt_tokens"] = n: the first n ids are the ragkv prompt (blended),
    the rest a continuation vLLM computes on top, with its prompt log-probs: teacher forcing (the
    benchmark's fidelity against vLLM's own prefill). At ratio 1 it follows vLLM's own answer."""
    from vllm import SamplingParams

    llm, engine = vllm_env
    docs = [DOCS[2], DOCS[1]]
    engine.ensure(docs)
    ids = engine.build_prompt("How often do ferries to Vell leave in summer?", docs).input_ids
    target, _, _ = generate(llm, ids, max_tokens=12, extra={"ragkv_skip": True}, fresh=True)
    llm.reset_prefix_cache()
    # (prompt log-probs at positions vLLM did not compute hold no token: detokenize=False)
    sp = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1, skip_reading_prefix_cache=False,
                        detokenize=False, extra_args={"kv_transfer_params": {"ragkv_ratio": 1.0, "ragkv_prompt_tokens": len(ids)}})
    out = llm.generate({"prompt_token_ids": ids + target[:-1]}, sp, use_tqdm=False)[0]
    info = out.kv_transfer_params["ragkv"]
    assert info["offered"] and info["written"] == [0, offered_end(ids)] and info["blend"]["hits"] == 2
    steps = out.prompt_logprobs[len(ids):]  # the continuation's positions: vLLM's own forward
    chosen = [next(t for t, lp in step.items() if lp.rank == 1) for step in steps]
    assert chosen + list(out.outputs[0].token_ids) == target
    bad = request(llm, ids, max_tokens=1, extra={"ragkv_prompt_tokens": len(ids) + 1})
    info = bad.kv_transfer_params["ragkv"]
    assert not info["offered"] and "ragkv_prompt_tokens" in info["reason"]
