"""Shared data of the integration tests."""

from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "examples" / "data" / "docs"

# three short chunks (~25 tokens each): keep CPU time down, the blend is the same at any size
CONTEXTS = [
    "The Harwick Point Lighthouse was designed by the engineer Agnes Tolland in 1871.",
    "Its light can be seen from 22 nautical miles away on a clear night.",
    "The lighthouse was built after the schooner Margaret Ellen sank on the reef.",
]
QUESTION = "Who designed the Harwick Point Lighthouse?"
