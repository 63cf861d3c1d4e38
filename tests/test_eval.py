import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ragkv.cli import main
from ragkv.evaluate import load_questions, token_f1

DOCS = Path(__file__).parents[1] / "examples" / "data" / "docs"


def test_token_f1():
    assert token_f1("The Harlan Cup.", "the Harlan Cup") == 1.0
    assert token_f1("Paris", "London") == 0.0
    assert token_f1("it is 22 nautical miles", "22 nautical miles") == pytest.approx(2 * 0.6 * 1 / 1.6)


def test_bad_question_files_name_the_line(tmp_path):
    p = tmp_path / "q.jsonl"
    p.write_text('{"question": "q", "contexts": ["a"]}\n{"question": "q", "contexts": []}\n')
    with pytest.raises(ValueError, match=r"q.jsonl:2: 'contexts' must be a non-empty list"):
        load_questions(p)
    p.write_text("not json\n")
    with pytest.raises(ValueError, match=r"q.jsonl:1: not valid JSON"):
        load_questions(p)
    r = CliRunner().invoke(main, ["eval", "--questions", str(p), "--store", "memory"])
    assert r.exit_code != 0 and "not valid JSON" in r.output
    r = CliRunner().invoke(main, ["eval", "--questions", str(p), "--store", "memory", "--ratios", "2"])
    assert r.exit_code != 0 and "--ratios" in r.output


@pytest.mark.slow
def test_eval_cli_reports_every_method(tmp_path):
    lighthouse, sourdough = (DOCS / "lighthouse.md").read_text(), (DOCS / "sourdough.md").read_text()
    rows = [
        {"question": "Who designed the lighthouse?", "contexts": [sourdough, lighthouse], "answer": "Agnes Tolland"},
        {"question": "What is hooch?", "contexts": [lighthouse, sourdough]},
    ]
    q = tmp_path / "q.jsonl"
    q.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "report.json"
    r = subprocess.run(
        [sys.executable, "-m", "ragkv.cli", "eval", "--questions", str(q), "--store", f"disk://{tmp_path}/s",
         "--ratios", "0,0.15,1,auto", "--tokens", "16", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "fidelity" in r.stdout and "speedup" in r.stdout
    report = json.loads(out.read_text())
    methods = report["methods"]
    assert set(methods) == {"full", "0", "0.15", "1", "auto"}
    for m in methods.values():
        assert {"ttft_s", "fidelity", "kl", "f1"} <= set(m) and m["ttft_s"] > 0
    assert methods["full"]["fidelity"] == 1.0
    # recomputing every token is full prefill: same greedy tokens, same first-token distribution
    assert methods["1"]["fidelity"] == 1.0 and methods["1"]["kl"] < 1e-4
    assert 0.0 <= methods["0"]["fidelity"] <= 1.0 and methods["0"]["kl"] >= methods["1"]["kl"]
    assert report["questions"] == 2
    # time split per method, and the same requests with sequential loading
    assert {"load_s", "fuse_s", "compute_s", "ttft_sequential_s"} <= set(methods["0.15"])
    assert methods["auto"]["ratio"] >= 0.15 and methods["0.15"]["ratio"] == 0.15
