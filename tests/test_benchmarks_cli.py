"""Every benchmark script with a command line still starts: `--help` exits 0 (an import moved by a
refactor once broke bench_precompute.py without any test noticing)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (REPO / "benchmarks").rglob("*.py")
                 if "argparse" in (text := p.read_text()) and '__name__ == "__main__"' in text)


def test_scripts_are_found():
    assert {"bench_precompute.py", "run_qa.py", "bench_blend.py", "bench_vllm.py"} <= {p.name for p in SCRIPTS}


@pytest.mark.parametrize("script", SCRIPTS, ids=[str(p.relative_to(REPO / "benchmarks")) for p in SCRIPTS])
def test_help(script):
    r = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "usage" in r.stdout.lower()
