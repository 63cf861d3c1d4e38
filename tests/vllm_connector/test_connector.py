"""RagKVConnector with vLLM's offline LLM on SmolLM2 (fp32, prefix caching off), real disk store; the
blend runs on vLLM's own model (tests/vllm_connector/test_native.py checks it layer by layer)."""

from __future__ import annotations

from vllm_data import DOCS, DTYPE

from ragkv.store.disk import DiskStore


def generate(llm, ids, max_tokens=16, ratio=None, extra=None):
    """-> (token ids, text, what the connector reported for the request). ``extra``: the request's
    kv_transfer_params (``ratio`` sets ragkv_ratio)."""
    from vllm import SamplingParams

    params = dict(extra or {})
    if ratio is not None:
        params["ragkv_ratio"] = ratio
    args = {"kv_transfer_params": params} if params else None
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                 extra_args=args), use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), out.outputs[0].text, (out.kv_transfer_params or {}).get("ragkv")


def agreement(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_ratio_1_matches_vllms_own_prefill_then_015_answers_from_stored_chunks(vllm_env):
    llm, engine = vllm_env
    docs = DOCS[:3]
    ids = engine.build_prompt("Who built the lighthouse at Kerran Point?", docs).input_ids
    # nothing stored: vLLM prefills the prompt itself, the connector writes its chunks back
    own, own_text, info = generate(llm, ids)
    assert info["recognised"] and not info["offered"] and info["misses"] == 3
    assert "Ada Morrow" in own_text
    # the same prompt again: the chunks are stored now; ratio 1 recomputes every chunk token
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
    own, own_text, info = generate(llm, ids, extra={"ragkv_skip": True})
    assert not info["offered"]
    toks, text, info = generate(llm, ids)
    assert info["offered"] and info["blend"]["hits"] == 2 and info["blend"]["ratio"] == 0.15
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
    own, _, _ = generate(llm, ids, extra={"ragkv_skip": True})
    assert toks == own  # vLLM's own prefill, token for token
    assert engine.store.contains(keys[1])  # written back: the next request hits
    _, _, info2 = generate(llm, ids)
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
