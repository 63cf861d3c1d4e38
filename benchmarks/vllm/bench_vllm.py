"""TTFT of vLLM with RagKVConnector vs vLLM's own full prefill, per ratio, with fidelity and memory.

    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/vllm/bench_vllm.py --prompts 8 --ratios 0,0.15,1 --repeats 3 --memory

Prompts: the test split of the 4-genre blend set (benchmarks/blend/data), each asked in a chat with
a shared system prompt of several blocks (SYSTEM; --system default: the chat template's own) and
its chunks as documents, laid out as ragkv lays out a chat with documents (PromptTemplate.chat:
what `ragkv serve` and vLLM's chat endpoint with ragkv's renderer build). Chunks are precomputed into a disk store first
(ragkv.integrations.vllm.precompute: the transformers engine in a child process, as `ragkv
precompute` would). vLLM: SmolLM2-135M-Instruct in --dtype (float32: this CPU has no native bf16),
offline LLM in one process, eager, block 32, vLLM's defaults otherwise: prefix caching ON, chunked
prefill ON with vLLM's own budget. The blend runs on vLLM's own model (ragkv.integrations.vllm.layers).

Prefix cache, the same for both sides: before every request (timed or not) vLLM's prefix cache is
emptied and warmed with the system prompt (a request of the prompt's prefix alone: system prompt +
user header), so vLLM serves exactly that prefix's full blocks to vLLM's own prefill and to the
connector alike, and nothing else (blended blocks never enter it: prefix_cache.py). Round k asks with
the chunks rotated by k, an order no earlier round used: ragkv's store serves chunks in any order.

Per prompt: --repeats rounds of requests with max_tokens=1, the settings interleaved within each
round (TTFT = wall time of llm.generate, request in -> first token out, and the process's CPU time
over the same call; the best of each is kept). Then in every round's chunk order (quality samples =
prompts x --repeats; one order of 8 prompts is too few: see RESULTS.md), per setting: free-running
greedy answers of --new-tokens tokens (first token and identical leading tokens against vLLM's own
answer, gold answer in the text) and teacher-forced fidelity: vLLM's own greedy answer fed as the
continuation of the setting's prompt (kv_transfer_params ragkv_prompt_tokens: the
connector serves the prompt, vLLM computes the answer positions), the share of positions whose top-1
token is vLLM's own next token (1 for vLLM's own prefill by definition), its mean with a 95%
bootstrap interval over the samples.
--memory: resident memory of a vLLM process serving the same prompts without the connector and of
one with it (two child processes of this script, one offline LLM each; VmRSS at the end, VmHWM peak).
Writes results/vllm.md, results/vllm.json (+ vllm.png with matplotlib); results/vllm-bfloat16.*
with --dtype bfloat16.
On a machine shared with other work, OMP_NUM_THREADS=1 keeps OpenMP's spinning barriers from
stalling every op of both vLLM and the blend when a core is taken (seen here: 10x slower copies).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ragkv.evaluate import bootstrap_ci
from ragkv.integrations.vllm import CPU_MEMORY_UTILIZATION, kv_transfer_config

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
DATA = Path(__file__).resolve().parents[1] / "blend" / "data"
OUT = Path(__file__).resolve().parent / "results"
SYSTEM = ("You are the research assistant of a technical library. The user gives you documents retrieved "
          "for the question: manuals, reports, articles and notes of various lengths, in no particular "
          "order. Read all of them before you answer. Answer the question from the documents only, in one "
          "or two short sentences, quoting names, numbers, dates and units exactly as the documents give "
          "them. If two documents disagree, say so and give both answers with the document each one comes "
          "from. If the documents do not contain the answer, say that you do not know; never guess and "
          "never invent a source. Do not repeat the question, do not describe the documents, and do not "
          "add advice the user did not ask for.")


def load_prompts(n: int, split: str = "test") -> list[dict]:
    """``n`` prompts of the blend set's ``split``, spread over it (every k-th), with their chunk texts."""
    chunks = {c["id"]: c["text"] for c in map(json.loads, (DATA / "chunks.jsonl").open())}
    rows = [p for p in map(json.loads, (DATA / "prompts.jsonl").open()) if p["split"] == split]
    picked = rows[:: max(1, len(rows) // n)][:n]
    return [{**p, "contexts": [chunks[c] for c in p["chunks"]]} for p in picked]


def results_stem(name: str, dtype: str) -> str:
    """Where a run's results go: ``name`` in float32, ``name-<dtype>`` otherwise (results/)."""
    return name if dtype == "float32" else f"{name}-{dtype}"


def rotated(items: list, k: int) -> list:
    k %= len(items)
    return items[k:] + items[:k]


class Chat:
    """Token ids of each prompt's chat (SYSTEM + the question, its chunks in rotation k)."""

    def __init__(self, model_dir: str, system: str | None = SYSTEM):
        from transformers import AutoTokenizer

        from ragkv.prompt import PromptTemplate

        self.template = PromptTemplate.for_tokenizer(AutoTokenizer.from_pretrained(model_dir))
        self.system = system  # None: the chat template's own default system prompt

    def messages(self, p: dict) -> list[dict]:
        system = [{"role": "system", "content": self.system}] if self.system is not None else []
        return [*system, {"role": "user", "content": p["question"]}]

    def prompt(self, p: dict, k: int = 0):
        return self.template.chat(self.messages(p), rotated(p["contexts"], k))

    def ids(self, p: dict, k: int = 0) -> list[int]:
        return self.prompt(p, k).input_ids

    def prefix(self, p: dict) -> list[int]:
        return self.prompt(p).prefix_ids


def prepare(n: int, store: str, dtype: str, system: str = "library") -> tuple[str, list[dict], Chat]:
    """The converted SmolLM2 directory, ``n`` test prompts and their chat layout, every chunk
    precomputed into ``store`` first (in a child process: no transformers model here)."""
    from ragkv.gguf import convert_smollm2
    from ragkv.integrations.vllm.precompute import precompute

    model_dir = str(convert_smollm2())
    prompts = load_prompts(n)
    precompute(model_dir, dtype, store, [(p["question"], p["contexts"]) for p in prompts])
    return model_dir, prompts, Chat(model_dir, SYSTEM if system == "library" else None)


def build_llm(model_dir: str, args, connector: bool = True):
    from vllm import LLM

    kw = {"kv_transfer_config": kv_transfer_config(args.store)} if connector else {}
    return LLM(model=model_dir, dtype=args.dtype, enforce_eager=True, max_model_len=8192, block_size=32, seed=0,
               gpu_memory_utilization=args.memory_utilization, **kw)  # prefix caching, chunked prefill: vLLM's defaults


def warm(llm, prefix: list[int]) -> None:
    """vLLM's prefix cache holds exactly the system prompt's full blocks afterwards."""
    from vllm import SamplingParams

    llm.reset_prefix_cache()
    sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"ragkv_skip": True}})
    llm.generate({"prompt_token_ids": prefix}, sp, use_tqdm=False)


def run(llm, ids, max_tokens, extra, prefix):
    from vllm import SamplingParams

    warm(llm, prefix)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, extra_args={"kv_transfer_params": extra})
    c0, t0 = time.process_time(), time.perf_counter()
    out = llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)[0]
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return (wall, cpu), list(out.outputs[0].token_ids), out.outputs[0].text, \
        (out.kv_transfer_params or {}).get("ragkv") or {}


def teacher_forced(llm, ids, target, extra, prefix) -> float:
    """Share of ``target``'s positions whose top-1 token, ``target`` fed as the continuation of the
    setting's prompt, is ``target``'s own."""
    from vllm import SamplingParams

    if extra.get("ragkv_skip") or not target:
        return 1.0  # vLLM's own prefill against its own answer
    warm(llm, prefix)
    sp = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1, skip_reading_prefix_cache=False,
                        detokenize=False,  # (vLLM's prompt log-probs of positions it did not compute hold no token)
                        extra_args={"kv_transfer_params": {**extra, "ragkv_prompt_tokens": len(ids)}})
    out = llm.generate({"prompt_token_ids": ids + target[:-1]}, sp, use_tqdm=False)[0]
    chosen = [next(t for t, lp in step.items() if lp.rank == 1) for step in out.prompt_logprobs[len(ids):]]
    chosen += list(out.outputs[0].token_ids)
    return sum(c == t for c, t in zip(chosen, target)) / len(target)


def lead(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def bench_prompt(llm, chat: Chat, p: dict, settings, rows: dict, args) -> None:
    prefix, times = chat.prefix(p), {name: [] for name, _ in settings}
    for k in range(args.repeats):  # settings interleaved, so a burst of other work hits them alike
        ids = chat.ids(p, k)
        for name, extra in settings:
            times[name].append(run(llm, ids, 1, extra, prefix)[0])
    for name, _ in settings:
        rows[name]["ttft"].append(min(w for w, _ in times[name]))
        rows[name]["cpu"].append(min(c for _, c in times[name]))
    for k in range(args.repeats):  # quality in every round's chunk order: prompts x repeats samples
        ids, ref = chat.ids(p, k), None
        for name, extra in settings:
            _, toks, text, info = run(llm, ids, args.new_tokens, extra, prefix)
            ref = toks if ref is None else ref
            r = rows[name]
            r["first"].append(toks[:1] == ref[:1])
            r["lead"].append(lead(toks, ref))
            r["answer"].append(p["answer"].lower() in text.lower())
            r["offered"] += bool(info.get("offered"))
            r["vllm_cached"].append(info.get("vllm_cached", 0))
            r["fidelity"].append(teacher_forced(llm, ids, ref, extra, prefix))
    print(p["id"], len(ids), "tokens", {n: (round(rows[n]["ttft"][-1], 3), rows[n]["fidelity"][-args.repeats:])
                                               for n, _ in settings}, flush=True)


def memory_probe(args) -> None:
    """--memory-probe plain|ragkv: one vLLM process serving the prompts (without / with the
    connector); prints {"rss_mb", "peak_mb"} as JSON on the last line."""
    model_dir, prompts, chat = prepare(args.prompts, args.store, args.dtype, args.system)
    llm = build_llm(model_dir, args, connector=args.memory_probe == "ragkv")
    for p in prompts:
        run(llm, chat.ids(p), 1, {}, chat.prefix(p))
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    mb = {k: int(status[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM")}
    print(json.dumps({"rss_mb": round(mb["VmRSS"]), "peak_mb": round(mb["VmHWM"])}))


def measure_memory(args) -> dict:
    out = {}
    for mode in ("plain", "ragkv"):
        cmd = [sys.executable, __file__, "--memory-probe", mode, "--prompts", str(args.prompts), "--system", args.system,
               "--store", args.store, "--dtype", args.dtype, "--memory-utilization", str(args.memory_utilization)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"memory probe {mode} failed:\n{proc.stderr[-3000:]}")
        out[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def report(rows: dict, settings, prompts, chat: Chat, args, llm, load0: float, memory: dict | None) -> list[str]:
    import torch
    import vllm

    sched = llm.llm_engine.vllm_config.scheduler_config
    n_tok = statistics.mean(len(chat.ids(p)) for p in prompts)
    n_sys = statistics.mean(len(chat.prefix(p)) for p in prompts)
    lines = [f"prompts: {len(prompts)} (test split, mean {n_tok:.0f} tokens, a shared system prompt of "
             f"{n_sys:.0f} tokens), SmolLM2-135M {args.dtype}, vLLM {vllm.__version__}, block 32, prefix caching "
             f"on (warmed with the system prompt before every request), chunked prefill on (budget "
             f"{sched.max_num_batched_tokens}), {torch.get_num_threads()} threads (OMP_NUM_THREADS="
             f"{os.environ.get('OMP_NUM_THREADS', 'unset')}), best of {args.repeats}, load average {load0:.1f} -> "
             f"{os.getloadavg()[0]:.1f} (its own threads count in it)", "",
             "| setting | TTFT median (s) | speed-up | CPU s median | speed-up (CPU) | offered | vLLM cache hit "
             f"(tokens) | first token = vLLM's | identical leading tokens (of {args.new_tokens}) | teacher-forced "
             "fidelity [95% CI] | gold answer in text |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    base = statistics.median(rows[settings[0][0]]["ttft"])
    base_cpu = statistics.median(rows[settings[0][0]]["cpu"])
    n = len(prompts) * args.repeats  # quality samples: every prompt in every round's chunk order
    for name, _ in settings:
        r = rows[name]
        med, cpu = statistics.median(r["ttft"]), statistics.median(r["cpu"])
        lo, hi = bootstrap_ci(r["fidelity"])
        lines.append(f"| {name} | {med:.3f} | {base / med:.2f}x | {cpu:.3f} | {base_cpu / cpu:.2f}x | {r['offered']}/{n} | "
                     f"{statistics.mean(r['vllm_cached']):.0f} | {sum(r['first'])}/{n} | {statistics.mean(r['lead']):.1f} | "
                     f"{statistics.mean(r['fidelity']):.3f} [{lo:.3f}, {hi:.3f}] | {sum(r['answer'])}/{n} |")
    if memory:
        plain, ours = memory["plain"], memory["ragkv"]
        lines += ["", "| resident memory of the vLLM process | at the end (MB) | peak (MB) |", "|---|---|---|",
                  f"| vLLM alone | {plain['rss_mb']} | {plain['peak_mb']} |",
                  f"| vLLM + RagKVConnector | {ours['rss_mb']} | {ours['peak_mb']} |",
                  f"| difference | {ours['rss_mb'] - plain['rss_mb']:+d} | {ours['peak_mb'] - plain['peak_mb']:+d} |"]
    return lines


def plot(rows: dict, settings, stem: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = [n for n, _ in settings]
    ax.bar(names, [statistics.median(rows[n]["ttft"]) for n in names])
    ax.set_ylabel("median TTFT (s)")
    ax.set_title("vLLM TTFT: RagKVConnector vs vLLM's own prefill")
    fig.tight_layout()
    fig.savefig(OUT / f"{stem}.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--ratios", default="0,0.15,1")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--store", default="disk:///tmp/ragkv-bench-vllm")
    ap.add_argument("--system", default="library", choices=["library", "default"],
                    help="the chat's system prompt: SYSTEM (several blocks, vLLM's prefix cache serves it) or the "
                         "chat template's own default (SmolLM2's: 24 tokens, less than a block)")
    ap.add_argument("--memory", action="store_true", help="also measure the resident memory with and without the "
                    "connector (two more vLLM processes)")
    ap.add_argument("--memory-probe", choices=["plain", "ragkv"], help=argparse.SUPPRESS)
    ap.add_argument("--memory-utilization", type=float, default=CPU_MEMORY_UTILIZATION,
                    help="vLLM's gpu_memory_utilization: on CPU the share of a NUMA node's RAM it reserves "
                         "(vLLM's own 0.92 default fails when the node is partly used)")
    args = ap.parse_args()
    if args.memory_probe:
        return memory_probe(args)
    ratios = [float(r) for r in args.ratios.split(",")]
    model_dir, prompts, chat = prepare(args.prompts, args.store, args.dtype, args.system)
    load0 = os.getloadavg()[0]
    llm = build_llm(model_dir, args)
    settings = [("vLLM full prefill", {"ragkv_skip": True})] + [(f"ragkv r={r:g}", {"ragkv_ratio": r}) for r in ratios]
    for _, extra in settings:  # warm-up; the blend stores the prompts' shared prefix entry once
        run(llm, chat.ids(prompts[0]), 1, extra, chat.prefix(prompts[0]))
    keys = ("ttft", "cpu", "first", "lead", "answer", "vllm_cached", "fidelity")
    rows = {name: {**{k: [] for k in keys}, "offered": 0} for name, _ in settings}
    for p in prompts:
        bench_prompt(llm, chat, p, settings, rows, args)
    memory = measure_memory(args) if args.memory else None
    lines = report(rows, settings, prompts, chat, args, llm, load0, memory)
    OUT.mkdir(exist_ok=True)
    stem = results_stem("vllm", args.dtype)
    (OUT / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (OUT / f"{stem}.json").write_text(json.dumps({"rows": rows, "memory": memory}, indent=1))
    print("\n".join(lines))
    plot(rows, settings, stem)


if __name__ == "__main__":
    main()
