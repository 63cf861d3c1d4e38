"""Quickstart: CacheBlend through the HuggingFace-style wrapper.

    .venv/bin/python examples/quickstart.py [--store disk:///path]

Two documents are split with ragkv's chunker; each chunk is one cached context. The first call finds
nothing in the store (every chunk is prefilled and written back), the second reuses every chunk and
recomputes only ~15% of its tokens; it streams its answer with transformers' TextIteratorStreamer.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from threading import Thread

from transformers import TextIteratorStreamer

from ragkv import models
from ragkv.blend import BlendConfig
from ragkv.chunking import chunk_document
from ragkv.integrations.hf import BlendedGenerator
from ragkv.store import open_store

DOCS = Path(__file__).parent / "data" / "docs"


def show(label: str, out) -> None:
    print(f"{label}: {out.text!r}")
    print(f"  chunks hit/missed {out.hits}/{out.misses}, tokens reused {out.reused_tokens}, "
          f"recomputed {out.recomputed_tokens}, TTFT {out.ttft * 1000:.0f} ms, total {out.t_total:.2f} s")


def main(store_uri: str) -> None:
    model, tokenizer = models.load("smollm2-135m")
    gen = BlendedGenerator(model, tokenizer, open_store(store_uri), BlendConfig(ratio=0.15))
    contexts = [c for name in ("lighthouse.md", "sourdough.md")
                for c in chunk_document((DOCS / name).read_text(), gen.engine.template, max_tokens=256)]
    question = "Who designed the Harwick Point Lighthouse?"
    print(f"store {store_uri}, {len(contexts)} chunks\nQ: {question}")

    show("call 1", gen.generate(question, contexts, max_new_tokens=24))

    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    box = {}
    thread = Thread(target=lambda: box.update(out=gen.generate(question, contexts, max_new_tokens=24,
                                                                   streamer=streamer)))
    thread.start()
    print("call 2 (streamed): ", end="", flush=True)
    for piece in streamer:
        print(piece, end="", flush=True)
    thread.join()
    print()
    show("call 2", box["out"])


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", help="store URI (default: a disk store in a temporary directory)")
    args = ap.parse_args()
    if args.store:
        main(args.store)
    else:
        with tempfile.TemporaryDirectory(prefix="ragkv-quickstart-") as tmp:
            main(f"disk://{tmp}")
