"""``ragkv eval`` over many questions: per-question records on disk (resume, new methods alone),
sampling, and the per-dataset / per-type report with answer agreement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from ragkv.answers import Question, load_questions
from ragkv.blend import BlendEngine
from ragkv.cli import main
from ragkv.evalcache import EvalCache
from ragkv.evaluate import evaluate, sample_questions
from ragkv.store.memory import MemoryStore

DOCS = Path(__file__).parents[1] / "examples" / "data" / "docs"
LIGHTHOUSE, SOURDOUGH = (DOCS / "lighthouse.md").read_text()[:600], (DOCS / "sourdough.md").read_text()[:600]


def _questions(dataset="a"):
    return [Question("Who designed the lighthouse?", [SOURDOUGH, LIGHTHOUSE], ("Agnes Tolland",), "q1", "bridge", dataset),
            Question("What is hooch?", [LIGHTHOUSE, SOURDOUGH], ("liquid",), "q2", "comparison", dataset),
            Question("Where is the lighthouse?", [LIGHTHOUSE], ("Merrow Bay",), "q3", "bridge", dataset)]


@pytest.fixture
def engine(tiny_smollm2):
    model, tok = tiny_smollm2
    return BlendEngine(model, tok, MemoryStore())


def _run(engine, qs, cache, ratios=(0.0,), **kw):
    seen = []
    report = evaluate(engine, qs, ratios=ratios, n_tokens=4, max_new_tokens=4, cache=cache,
                      progress=lambda i, n, computed: seen.append(computed), **kw)
    return report, seen


def test_a_rerun_reads_every_record_and_reports_the_same(engine, tmp_path):
    qs = _questions()
    first, seen = _run(engine, qs, EvalCache(tmp_path / "c"))
    assert seen == [True, True, True]
    assert len(list((tmp_path / "c" / "ref").glob("*.json"))) == 3
    assert len(list((tmp_path / "c" / "method").glob("*.json"))) == 3
    cache = EvalCache(tmp_path / "c")
    again, seen = _run(engine, qs, cache)
    assert seen == [False, False, False] and cache.writes == 0 and cache.hits == 6
    for label in ("full", "0"):
        a, b = first["methods"][label], again["methods"][label]
        assert a["per_question"] == b["per_question"] and a["agreement"] == b["agreement"]


def test_a_killed_run_resumes_where_it_stopped(engine, tmp_path):
    """What a run killed after two questions left is read back; only the third is computed."""
    qs = _questions()
    _run(engine, qs[:2], EvalCache(tmp_path / "c"))
    cache = EvalCache(tmp_path / "c")
    report, seen = _run(engine, qs, cache)
    assert seen == [False, False, True] and cache.writes == 2  # the third question's reference and method
    assert report["questions"] == 3


def test_a_new_method_computes_only_that_method(engine, tmp_path):
    qs = _questions()[:2]
    _run(engine, qs, EvalCache(tmp_path / "c"))
    cache = EvalCache(tmp_path / "c")
    report, _ = _run(engine, qs, cache, ratios=(0.0, 1.0))
    assert cache.writes == 2 and cache.hits == 4  # 2 references + 2 naive-reuse records read
    assert report["methods"]["1"]["agreement"] == 1.0  # everything recomputed: full prefill's answers


def test_a_damaged_record_is_computed_again_never_trusted(engine, tmp_path):
    qs = _questions()[:1]
    _run(engine, qs, EvalCache(tmp_path / "c"))
    [ref] = (tmp_path / "c" / "ref").glob("*.json")
    ref.write_text('{"format": 1, "key": "')  # cut off mid-write by a crash of the disk
    cache = EvalCache(tmp_path / "c")
    with pytest.warns(UserWarning, match="unreadable"):
        _run(engine, qs, cache)
    assert cache.writes == 1 and json.loads(ref.read_text())["ids"]
    other = tmp_path / "c" / "method"
    [m] = other.glob("*.json")
    m.write_text(json.dumps({**json.loads(m.read_text()), "key": "someone-else"}))  # a record under the wrong name
    cache = EvalCache(tmp_path / "c")
    _run(engine, qs, cache)
    assert cache.writes == 1


def test_fresh_computes_everything_again(engine, tmp_path):
    qs = _questions()[:1]
    _run(engine, qs, EvalCache(tmp_path / "c"))
    cache = EvalCache(tmp_path / "c", fresh=True)
    _run(engine, qs, cache)
    assert cache.hits == 0 and cache.writes == 2


def test_report_breaks_down_by_dataset_and_type_with_agreement(engine):
    qs = _questions("a") + _questions("b")[:1]
    report, _ = _run(engine, qs, None, ratios=(0.0, 1.0))
    groups = report["groups"]
    assert set(groups) == {"a", "a/bridge", "a/comparison", "b", "b/bridge"}
    assert groups["a"]["full"]["n"] == 3 and groups["a/bridge"]["0"]["n"] == 2 and groups["b"]["1"]["n"] == 1
    assert [q["dataset"] for q in report["per_question"]] == ["a", "a", "a", "b"]
    for m in [report["methods"], *groups.values()]:
        assert m["full"]["agreement"] == 1.0 and m["full"]["speedup"] == 1.0
        for label in ("0", "1"):
            lo, hi = m[label]["agreement_ci"]
            assert lo <= m[label]["agreement"] <= hi
            assert m[label]["worse"] + m[label]["better"] <= m[label]["n"]
            assert m[label]["delta_f1_ci"][0] <= m[label]["delta_f1"] <= m[label]["delta_f1_ci"][1]
    pooled = report["methods"]["0"]["per_question"]
    assert report["methods"]["0"]["agreement"] == sum(pooled["agreement"]) / 4
    # agreement is the normalised answer's equality with full prefill's
    full = report["methods"]["full"]["per_question"]["answer"]
    from ragkv.answers import normalize_answer
    assert pooled["agreement"] == [float(normalize_answer(a) == normalize_answer(f)) for a, f in zip(pooled["answer"], full)]


def test_sample_is_seeded_in_file_order_and_all_when_large():
    qs = [Question(f"question {i}?", ["a"]) for i in range(12)]
    a, b = sample_questions(qs, 5, seed=3), sample_questions(qs, 5, seed=3)
    assert a == b and len(a) == 5 and sample_questions(qs, 5, seed=4) != a
    idx = [qs.index(x) for x in a]
    assert idx == sorted(idx)
    assert sample_questions(qs, 100) == qs and sample_questions(qs, None) == qs
    with pytest.raises(ValueError, match="sample size"):
        sample_questions(qs, 0)


def test_questions_carry_their_dataset_type_and_id(tmp_path):
    p = tmp_path / "hotpot_dev.jsonl"
    p.write_text(json.dumps({"id": "5a8", "question": "q", "contexts": ["a"], "type": "bridge", "answer": "x"}) + "\n"
                 + json.dumps({"question": "q", "contexts": ["a"]}) + "\n")
    a, b = load_questions(p)
    assert (a.dataset, a.type, a.id) == ("hotpot_dev", "bridge", "5a8") and (b.type, b.id) == (None, None)
    p.write_text(json.dumps({"question": "q", "contexts": ["a"], "type": ["bridge"]}) + "\n")
    with pytest.raises(ValueError, match=r"hotpot_dev.jsonl:1: 'type' must be a string"):
        load_questions(p)


def test_eval_cli_samples_each_file_and_resumes_from_its_cache(tmp_path, tiny_smollm2_dir):
    files = []
    for name in ("hotpot", "wiki"):
        p = tmp_path / f"{name}.jsonl"
        p.write_text("".join(json.dumps({"question": q.question, "contexts": q.contexts, "answer": q.answers[0],
                                         "type": q.type}) + "\n" for q in _questions()))
        files += ["--questions", str(p)]
    args = ["eval", *files, "--model", str(tiny_smollm2_dir), "--model-dtype", "float32", "--store", "memory",
            "--tokens", "2", "--answer-tokens", "2", "--sample", "2", "--seed", "1", "--cache", str(tmp_path / "c"),
            "--json", str(tmp_path / "r.json")]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["questions"] == 4 and set(report["methods"]) == {"full", "0", "0.15"}  # naive + the default
    from ragkv.blend.config import DEFAULT_RATIO, DEFAULT_SELECTOR
    assert report["method_settings"]["0.15"] == [DEFAULT_SELECTOR, DEFAULT_RATIO]
    assert {"hotpot", "wiki", "hotpot/bridge"} <= set(report["groups"]) and "ETA" in r.output
    assert "2/4 questions" in r.output and "(0 from the cache)" in r.output
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0 and "4/4 questions" in r.output and "(4 from the cache)" in r.output
    assert json.loads((tmp_path / "r.json").read_text())["methods"]["0"]["per_question"] == report["methods"]["0"]["per_question"]
    same = CliRunner().invoke(main, [a.replace("wiki.jsonl", "hotpot.jsonl") for a in args])
    assert same.exit_code == 2 and "share a name" in same.output


def test_selectors_with_settings_are_read_from_text_and_labelled_back():
    from ragkv.blend.select import DeviationSelector, QuerySelector, parse_selector, selector_label

    sel = parse_selector("query:rows=all:offset_decay=0")
    assert sel == QuerySelector(rows=None, offset_decay=0) and selector_label(sel) == "query:rows=none:offset_decay=0"
    assert parse_selector(selector_label(sel)) == sel
    dev = parse_selector("deviation:check_layers=1,3:signal=k")
    assert dev == DeviationSelector(check_layers=(1, 3), signal="k") and parse_selector(selector_label(dev)) == dev
    assert selector_label(parse_selector("query")) == "query"
    for bad, needle in (("query:depth=3", "'depth=3' is not a setting"), ("query:rows", "is not a setting"),
                        ("query:rows=0", "rows must be"), ("psychic", "unknown selector")):
        with pytest.raises(ValueError, match=needle):
            parse_selector(bad)


def test_explicit_methods_are_parsed_with_their_labels():
    from ragkv.blend.select import DeviationSelector, QuerySelector
    from ragkv.evaluate import methods_of, parse_methods

    got = parse_methods("0 deviation@0.15  query:rows=16@0.3 1")
    assert got == {"0": (QuerySelector(), 0.0), "deviation@0.15": (DeviationSelector(), 0.15),
                   "query:rows=16@0.3": (QuerySelector(rows=16), 0.3), "1": (QuerySelector(), 1.0)}
    # the labels (and so the cached records) are those of the same methods given as --selectors x --ratios
    grid = methods_of(["query", QuerySelector(rows=16)], [0.0, 0.3])
    assert grid["0"] == got["0"] and grid["query:rows=16@0.3"] == got["query:rows=16@0.3"]
    for bad, needle in (("0.15", "name its selector"), ("query@2", "must be a number in"), ("", "at least one"),
                        ("psychic@0.1", "unknown selector")):
        with pytest.raises(ValueError, match=needle):
            parse_methods(bad)
