import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ragkv.adapter import ModelAdapter
from ragkv.answers import exact_match, load_questions, token_f1
from ragkv.cli import main
from ragkv.evalreport import margin_from_top
from ragkv.evaluate import bootstrap_ci, kl_from_top, pareto, teacher_forced_logits, top_logprobs

DOCS = Path(__file__).parents[1] / "examples" / "data" / "docs"


def test_gold_answers_come_from_answer_or_answers(tmp_path):
    p = tmp_path / "q.jsonl"
    rows = [{"question": "q", "contexts": ["a"]}, {"question": "q", "contexts": ["a"], "answer": "Paris"},
            {"question": "q", "contexts": ["a"], "answer": ["Paris", "City of Paris"]},
            {"question": "q", "contexts": ["a"], "answers": ["yes"]}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [q.answers for q in load_questions(p)] == [(), ("Paris",), ("Paris", "City of Paris"), ("yes",)]
    for bad, needle in (({"answer": "x", "answers": ["x"]}, "not both"), ({"answers": []}, "'answers' must be"),
                        ({"answer": 3}, "'answer' must be"), ({"answer": ["x", ""]}, "'answer' must be")):
        p.write_text(json.dumps({"question": "q", "contexts": ["a"], **bad}) + "\n")
        with pytest.raises(ValueError, match=f"q.jsonl:1: .*{needle}"):
            load_questions(p)


def test_bootstrap_interval_brackets_the_mean_and_is_reproducible():
    values = [0.0] * 10 + [1.0] * 10
    lo, hi = bootstrap_ci(values)
    assert lo < 0.5 < hi and (lo, hi) == bootstrap_ci(values) and bootstrap_ci([0.7] * 5) == (0.7, 0.7)
    assert lo >= 0.25 and hi <= 0.75  # ~0.5 +- 1.96 * 0.11


def test_divergence_margin_is_full_prefills_lead_at_the_first_difference():
    # full prefill's top teacher-forced logits per answer position, best first: [ids, logits]
    top = [[[1, 2, 0], [5.0, 1.0, 0.0]],
           [[2, 3, 1], [3.0, 2.5, 1.0]],
           [[0, 1, 2], [9.0, 0.0, 0.0]]]
    target = [1, 2, 0]  # full prefill's greedy answer: the best of each row
    assert margin_from_top(top, target, target) is None
    assert margin_from_top(top, [1, 3, 0], target) == pytest.approx(0.5)  # a near-tie
    assert margin_from_top(top, [2, 2, 0], target) == pytest.approx(4.0)  # a sure call overturned
    assert margin_from_top(top, [1, 2], target) is None  # stopped early: nothing to compare
    assert margin_from_top(top, [1, 7, 0], target) == pytest.approx(2.0)  # outside the kept top: a lower bound


def test_kl_over_the_top_tokens_and_a_tail_bin_bounds_the_exact_kl_from_below():
    torch.manual_seed(0)
    p, q = torch.randn(1000) * 3, torch.randn(1000) * 3
    exact = float((torch.softmax(p.double(), -1) * (torch.log_softmax(p.double(), -1)
                                                   - torch.log_softmax(q.double(), -1))).sum())
    assert kl_from_top(top_logprobs(p, 1000), q) == pytest.approx(exact, rel=1e-5)  # every token kept: exact
    few = kl_from_top(top_logprobs(p, 20), q)
    assert 0.5 * exact < few <= exact + 1e-9  # merging the tail never raises it
    assert kl_from_top(top_logprobs(p, 20), p) == pytest.approx(0.0, abs=1e-6)


def test_pareto_front_keeps_what_nothing_beats_on_both_ttft_and_fidelity():
    methods = {"full": {"ttft_s": 1.50, "fidelity": 1.0},
               "deviation@0.15": {"ttft_s": 0.67, "fidelity": 0.954},
               "starts@0.15": {"ttft_s": 0.53, "fidelity": 0.959},  # faster and more faithful: beats deviation
               "query@0.15": {"ttft_s": 0.69, "fidelity": 0.963},  # slower but more faithful: stays
               "starts@0.05": {"ttft_s": 0.30, "fidelity": 0.947},
               "deviation@0.05": {"ttft_s": 0.40, "fidelity": 0.939},
               "tie@0.05": {"ttft_s": 0.30, "fidelity": 0.947},  # equal on both: neither beats the other
               "1": {"ttft_s": 1.60, "fidelity": 1.0}}  # as faithful as full prefill, slower
    got = pareto(methods)
    assert got["front"] == ["starts@0.05", "tie@0.05", "starts@0.15", "query@0.15", "full"]
    # each dominated method names the most faithful of those at least as fast and as faithful
    assert got["dominated"] == {"deviation@0.15": "starts@0.15", "deviation@0.05": "starts@0.05", "1": "full"}
    assert pareto({}) == {"front": [], "dominated": {}}


def test_teacher_forced_logits_over_the_generated_cache_equal_one_plain_forward(tiny_smollm2):
    """What ``ragkv eval`` does to get full prefill's reference logits for div_margin: the cache that
    generate extended, cut back to the prompt minus its last token, then the answer fed in."""
    model, tok = tiny_smollm2
    a = ModelAdapter.of(model)
    ids = torch.tensor([tok("Where does the light of the lighthouse reach?")["input_ids"]])
    with torch.inference_mode():
        _, cache = a.forward(ids, logits_to_keep=1)
        cache.crop(-1)
        target = a.generate(ids, cache, tok, max_new_tokens=6, do_sample=False)
        a.truncate(cache, ids.shape[1] - 1)
        got = teacher_forced_logits(a, ids[0, -1:], cache, target)
        want = model(torch.cat([ids[0], target[:-1]])[None]).logits[0, ids.shape[1] - 1:].float()
    assert got.shape == (target.numel(), want.shape[-1])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), target)  # greedy generation picked each row's argmax


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
         "--ratios", "0,0.15,1,auto", "--tokens", "16", "--json", str(out), "--model-dtype", "float32",
         "--time-sequential", "--cache", str(tmp_path / "cache")],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "fidelity" in r.stdout and "speedup" in r.stdout
    report = json.loads(out.read_text())
    methods = report["methods"]
    assert set(methods) == {"full", "0", "0.15", "1", "auto"}
    for m in methods.values():
        assert {"ttft_s", "fidelity", "same_answer", "agree_tokens", "div_margin", "kl", "em", "f1", "f1_ci"} <= set(m)
        assert m["ttft_s"] > 0
        # a margin exactly where the answer left full prefill's, and >= 0 (full prefill's own argmax there)
        for same, lead in zip(m["per_question"]["same_answer"], m["per_question"]["div_margin"]):
            assert (lead is None) == bool(same) and (lead is None or lead >= 0)
        # fidelity is teacher-forced agreement over 16 tokens: a multiple of 1/16 per question
        assert all(abs(f * 16 - round(f * 16)) < 1e-6 for f in m["per_question"]["fidelity"])
    assert methods["full"]["fidelity"] == 1.0 and methods["full"]["same_answer"] == 1.0
    # SmolLM2 names the lighthouse's designer with full prefill (its answer's first line is scored)
    assert "Tolland" in methods["full"]["per_question"]["answer"][0] and methods["full"]["f1"] > 0
    # recomputing every token is full prefill: same greedy tokens, same first-token distribution
    assert methods["1"]["fidelity"] == 1.0 and methods["1"]["kl"] < 1e-4 and methods["1"]["same_answer"] == 1.0
    assert methods["1"]["agree_tokens"] == 16 and methods["1"]["div_margin"] is None
    assert "div_mrg" in r.stdout
    # naive reuse misses the cross-attention between chunks: the first token's distribution moves
    assert methods["0"]["kl"] > 100 * max(methods["1"]["kl"], 1e-6)
    assert report["questions"] == 2 and report["errors"] == []
    # time split per method, and the same requests with sequential loading
    assert {"load_s", "fuse_s", "compute_s", "ttft_sequential_s"} <= set(methods["0.15"])
    assert methods["auto"]["ratio"] >= 0.15 and methods["0.15"]["ratio"] == 0.15


# ----------------------------------------------------------------------------- fast: a tiny model


def _qfile(tmp_path, rows):
    q = tmp_path / "q.jsonl"
    q.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return q


def test_bad_options_fail_before_any_work(tmp_path):
    q = _qfile(tmp_path, [{"question": "q?", "contexts": ["a"]}])
    for args, needle in ((["--repeats", "0"], "--repeats"), (["--tokens", "0"], "--tokens"),
                         (["--json", str(tmp_path / "no" / "dir" / "r.json")], "does not exist"),
                         (["--json", str(tmp_path)], "is a directory"),
                         (["--ratios", "0.1,x"], "--ratios"), (["--selectors", "psychic"], "unknown selector"),
                         (["--check-layers", "-1"], ">= 0"), (["--check-layers", "1,3"], "name it in --selectors"),
                         (["--question-format", "Answer briefly."], "must contain {question} once"),
                         (["--question-format", "{question} in {lang}"], "not a format with only {question}")):
        r = CliRunner().invoke(main, ["eval", "--questions", str(q), "--store", "memory", *args])
        assert r.exit_code == 2 and needle in r.output, (args, r.output)
        assert "Traceback" not in r.output


def test_one_bad_question_is_reported_and_the_others_go_on(tmp_path, tiny_smollm2_dir):
    lighthouse = (DOCS / "lighthouse.md").read_text()
    rows = [{"question": "Who designed the lighthouse?", "contexts": [lighthouse]},
            {"question": "Too long?", "contexts": ["word " * 3000]},  # > the tiny model's 2048 positions
            {"question": "Where is it?", "contexts": [lighthouse]}]
    out = tmp_path / "r.json"
    r = CliRunner().invoke(main, ["eval", "--questions", str(_qfile(tmp_path, rows)), "--model", str(tiny_smollm2_dir),
                                  "--model-dtype", "float32", "--store", "memory", "--ratios", "0,1", "--tokens", "4",
                                  "--json", str(out)])
    assert r.exit_code == 1, r.output
    report = json.loads(out.read_text())
    assert report["questions"] == 2 and [e["question"] for e in report["errors"]] == [2]
    assert "longer than the model's window" in report["errors"][0]["error"]
    assert "question 2 skipped" in r.output and report["methods"]["1"]["fidelity"] == 1.0


def test_selectors_side_by_side(tmp_path, tiny_smollm2_dir):
    lighthouse, sourdough = (DOCS / "lighthouse.md").read_text(), (DOCS / "sourdough.md").read_text()
    q = _qfile(tmp_path, [{"question": "Who designed the lighthouse?", "contexts": [sourdough, lighthouse]}])
    out = tmp_path / "r.json"
    r = CliRunner().invoke(main, ["eval", "--questions", str(q), "--model", str(tiny_smollm2_dir), "--store", "memory",
                                  "--model-dtype", "float32", "--ratios", "0,0.15,1", "--selectors",
                                  "deviation,query,starts", "--tokens", "4", "--json", str(out)])
    assert r.exit_code == 0, r.output
    methods = json.loads(out.read_text())["methods"]
    assert set(methods) == {"full", "0", "1", "deviation@0.15", "query@0.15", "starts@0.15"}
    assert all(name in r.output for name in methods)
    assert methods["1"]["fidelity"] == 1.0  # ratio 0 and 1 are the same for every selector: run once
    # every method is on the front or beaten by one that is listed, in the JSON and on screen
    best = json.loads(out.read_text())["pareto"]
    assert sorted(best["front"] + list(best["dominated"])) == sorted(methods)
    assert best["front"] and set(best["dominated"].values()) <= set(methods)
    assert "pareto front (fastest first" in r.output and ", ".join(best["front"]) in r.output


def test_a_question_with_a_lone_surrogate_names_the_line(tmp_path):
    """JSON may escape a lone surrogate (\\ud800); it reached the tokenizer as a TypeError before."""
    p = tmp_path / "q.jsonl"
    p.write_text('{"question": "q", "contexts": ["a"]}\n{"question": "q", "contexts": ["ok", "bad \\udc01"]}\n')
    with pytest.raises(ValueError, match=r"q.jsonl:2: 'contexts\[1\]' holds a lone surrogate \(\\udc01\)"):
        load_questions(p)


def test_answers_are_scored_against_the_gold_answers_for_every_method(tmp_path, tiny_smollm2_dir):
    lighthouse, sourdough = (DOCS / "lighthouse.md").read_text(), (DOCS / "sourdough.md").read_text()
    golds = [("Agnes Tolland",), None, ("yes", "Yes, it does")]
    rows = [{"question": "Who designed the lighthouse?", "contexts": [sourdough, lighthouse], "answer": "Agnes Tolland"},
            {"question": "What is hooch?", "contexts": [lighthouse, sourdough]},
            {"question": "Does the lamp turn?", "contexts": [lighthouse], "answers": list(golds[2])}]
    out = tmp_path / "r.json"
    r = CliRunner().invoke(main, ["eval", "--questions", str(_qfile(tmp_path, rows)), "--model", str(tiny_smollm2_dir),
                                  "--model-dtype", "float32", "--store", "memory", "--ratios", "0,1", "--tokens", "4",
                                  "--answer-tokens", "6", "--json", str(out)])
    assert r.exit_code == 0, r.output
    report = json.loads(out.read_text())
    assert report["max_new_tokens"] == 6 and "f1 [95% CI]" in r.output and "em/f1:" in r.output
    methods = report["methods"]
    for m in methods.values():
        pq = m["per_question"]
        assert pq["em"][1] is None and pq["f1"][1] is None  # no gold answer: not scored
        for qi in (0, 2):  # the first line of the answer, best over the gold answers
            assert pq["f1"][qi] == max(token_f1(pq["answer"][qi], g) for g in golds[qi])
            assert pq["em"][qi] == max(exact_match(pq["answer"][qi], g) for g in golds[qi])
        assert m["f1"] == pytest.approx((pq["f1"][0] + pq["f1"][2]) / 2) and m["em"] == (pq["em"][0] + pq["em"][2]) / 2
        lo, hi = m["f1_ci"]
        assert lo <= m["f1"] <= hi and m["em_ci"][0] <= m["em"] <= m["em_ci"][1]
        assert all("\n" not in a for a in pq["answer"])
    assert methods["1"]["per_question"]["answer"] == methods["full"]["per_question"]["answer"]


def test_question_format_changes_only_the_prompts_suffix(tmp_path, tiny_smollm2_dir, smollm2_tokenizer):
    from ragkv.prompt import PromptTemplate

    lighthouse = (DOCS / "lighthouse.md").read_text()
    q = _qfile(tmp_path, [{"question": "Who designed the lighthouse?", "contexts": [lighthouse], "answer": "Agnes"}])
    fmt = "Reply with the answer only: no other words, no sentence, no explanation.\nQ: {question}"
    out = tmp_path / "r.json"
    r = CliRunner().invoke(main, ["eval", "--questions", str(q), "--model", str(tiny_smollm2_dir), "--store", "memory",
                                  "--model-dtype", "float32", "--ratios", "0", "--tokens", "2", "--answer-tokens", "2",
                                  "--question-format", fmt, "--json", str(out)])
    assert r.exit_code == 0, r.output
    report = json.loads(out.read_text())
    want = PromptTemplate.for_tokenizer(smollm2_tokenizer, question_format=fmt).build("Who designed the lighthouse?",
                                                                                      [lighthouse])
    default = PromptTemplate.for_tokenizer(smollm2_tokenizer).build("Who designed the lighthouse?", [lighthouse])
    assert report["question_format"] == fmt and report["prompt_tokens"] == [want.num_tokens] != [default.num_tokens]
