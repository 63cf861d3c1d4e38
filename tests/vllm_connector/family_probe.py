"""Run by test_families.py in a fresh interpreter (one vLLM engine per process): a tiny random-weight
model of one family (llama | qwen2 | mistral, saved as safetensors) served by vLLM in fp32, and
ragkv's VllmLayers checked against vLLM's own prefill of the same ids. Prints one JSON line.

    python tests/vllm_connector/family_probe.py KIND MODEL_DIR
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def save_tiny(kind: str, path: str):
    """A tiny model vLLM's CPU attention takes (head dim 32), saved; -> its fingerprint (the HF engine's)."""
    import torch

    from ragkv.fingerprint import fingerprint
    from ragkv.models import tiny_model

    model = tiny_model(kind, hidden_size=128, head_dim=32, intermediate_size=256, num_attention_heads=4,
                       num_key_value_heads=2, dtype=torch.float32)
    model.save_pretrained(path)
    return fingerprint(model)


def main() -> None:
    kind, path = sys.argv[1], sys.argv[2]
    import torch
    from vllm import LLM, SamplingParams

    from ragkv.blend.attention import position_attention
    from ragkv.fingerprint import fingerprint_dir
    from ragkv.integrations.vllm.layers import VllmLayers, _Written
    from ragkv.kernels import dispatch as ops

    hf_fingerprint = save_tiny(kind, path)
    # no connector here: vLLM's own prefill of one prompt in one step, captured layer by layer
    llm = LLM(model=path, dtype="float32", enforce_eager=True, enable_prefix_caching=False, max_model_len=1024,
              block_size=32, seed=0, gpu_memory_utilization=0.3, skip_tokenizer_init=True)
    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    a = VllmLayers(model)
    ids = torch.randint(3, 500, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    T, heads = len(ids), (len(ids), a.num_kv_heads, a.head_dim)
    hidden, kv = {}, {}
    hooks = []
    for li, layer in enumerate(model.model.layers):
        hooks.append(layer.register_forward_hook(
            lambda m, args, res, li=li: hidden.__setitem__(li, (res[0][:T] + res[1][:T]).clone())))
        hooks.append(layer.self_attn.attn.register_forward_hook(
            lambda m, args, res, li=li: kv.__setitem__(li, [t[:T].reshape(heads).transpose(0, 1).clone() for t in args[1:3]])))
    llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0, detokenize=False), use_tqdm=False)
    for h in hooks:
        h.remove()

    def rel(x, y):
        return float((x - y).abs().max() / y.abs().max())

    with torch.inference_mode():
        # every row, plain causal: vLLM's own prefill
        h, pos = a.embed(torch.tensor([ids])), torch.arange(T)
        full = []
        for li in range(a.num_layers):
            h = a.run_layer(li, h, pos, _Written(a.num_layers))
            full.append(rel(h[0] + h[1], hidden[li]))
        # scattered rows over vLLM's exact K/V, attending by original position
        rows = torch.tensor([0, 1, 5, 40, 41, 150, 151, 152, 298, 299])

        class Exact:  # the fused cache: vLLM's K/V with the rows' fresh K/V scattered over them
            def update(self, li, k, v, positions):
                keys, values = kv[li][0].clone()[None], kv[li][1].clone()[None]
                keys[0, :, rows], values[0, :, rows] = k[0], v[0]
                return keys, values

        plan = ops.blend_attention_plan(rows, T, a.num_heads // a.num_kv_heads, a.dtype)
        h = a.embed(torch.tensor([ids])[:, rows])
        part = []
        for li in range(a.num_layers):
            h = a.run_layer(li, h, rows, Exact(), attention=position_attention, ragkv_q_pos=rows, ragkv_plan=plan)
            part.append(rel(h[0] + h[1], hidden[li][rows]))
    print(json.dumps({"kind": kind, "model": type(model).__name__, "layers": a.num_layers, "full": full, "rows": part,
                      "digest_equal": fingerprint_dir(path, torch.float32, config=model.config) == hf_fingerprint}))


if __name__ == "__main__":
    main()
