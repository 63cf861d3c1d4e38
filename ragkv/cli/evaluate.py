"""``ragkv eval``: how faithful blending is to full prefill on the user's own questions, and with gold
answers how right each method's answers are (ragkv.evaluate)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from ragkv.cli.options import (
    STORE_HELP,
    build,
    check_tiers,
    model_options,
    open_store,
    policy_options,
    writable,
)
from ragkv.cli.options import ratios as ratios_of


def _question_format(text: str) -> str:
    """A question format holding ``{question}`` once and no other field."""
    try:
        ok = text.format(question="\x00").count("\x00") == 1
    except (KeyError, IndexError, ValueError) as e:
        raise click.BadParameter(f"{text!r} is not a format with only {{question}} in it ({e})",
                                 param_hint="--question-format") from None
    if not ok:
        raise click.BadParameter(f"{text!r} must contain {{question}} once", param_hint="--question-format")
    return text


def _selectors(names: str, signal: str, check_layers: str | None) -> list:
    """Selector instances for --selectors (each ``name`` or ``name:field=value:...``); --signal and
    --check-layers configure a plain ``deviation``, which must then be among them."""
    from dataclasses import replace

    from ragkv.blend.select import DeviationSelector, parse_selector

    layers = None
    if check_layers is not None:
        try:
            layers = tuple(int(x) for x in check_layers.split(",") if x.strip())
            DeviationSelector(check_layers=layers)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--check-layers") from None
    out = []
    for spec in (n.strip() for n in names.split(",") if n.strip()):
        try:
            sel = parse_selector(spec)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--selectors") from None
        if spec == DeviationSelector.name:
            sel = replace(sel, check_layers=layers, signal=signal)
        out.append(sel)
    if not out:
        raise click.BadParameter("give at least one selector", param_hint="--selectors")
    if check_layers is not None and not any(spec.strip() == DeviationSelector.name for spec in names.split(",")):
        raise click.BadParameter("--check-layers configures the deviation selector: name it in --selectors "
                                 "(e.g. --selectors deviation)", param_hint="--check-layers")
    return out


class _Progress:
    """One line per question on stderr with the ETA, from the time of the questions that were computed
    (cached ones cost nothing); on a terminal the line is rewritten in place."""

    def __init__(self, total_label: str):
        import time

        self.clock, self.t0, self.busy, self.computed, self.label = time.monotonic, time.monotonic(), 0.0, 0, total_label
        self.last = self.t0
        self.tty = sys.stderr.isatty()

    def __call__(self, i: int, n: int, computed: bool) -> None:
        now = self.clock()
        if computed:
            self.busy += now - self.last
            self.computed += 1
        self.last = now
        eta = (n - i) * self.busy / self.computed if self.computed else 0.0
        bar = "#" * int(24 * i / n)
        line = (f"  [{bar:<24}] {i}/{n} questions{self.label}  {_hms(now - self.t0)} elapsed, "
                f"ETA {_hms(eta) if self.computed or i == n else '?'}  ({i - self.computed} from the cache)")
        click.echo(("\r" + line) if self.tty else line, err=True, nl=not self.tty or i == n)


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


@click.command("eval")
@click.option("--questions", "questions_paths", required=True, multiple=True,
              type=click.Path(exists=True, dir_okay=False),
              help="JSONL: one {question, contexts: [chunk, ...], answer?: str | [str], type?: str} per line (or "
                   "answers: [str]); with gold answers, exact match and token F1 are reported. Repeat it for "
                   "several datasets: each is reported on its own (by file name) and pooled.")
@click.option("--sample", type=click.IntRange(1, None), default=None,
              help="Evaluate N questions drawn from each questions file (seeded by --seed), in file order.")
@click.option("--seed", default=0, show_default=True, help="Seed of --sample.")
@model_options
@click.option("--store", "store_uris", required=True, envvar="RAGKV_STORE", help=STORE_HELP)
@click.option("--ratios", default=None,
              help="Comma-separated recompute ratios (0 = naive reuse); 'auto' = the loading controller's choice  "
                   "[default: 0 and the default ratio, ragkv.blend.config.DEFAULT_RATIO]")
@click.option("--selectors", default=None,
              help="Comma-separated selection strategies, measured side by side (deviation, query, starts)  "
                   "[default: the default one, ragkv.blend.config.DEFAULT_SELECTOR]")
@click.option("--methods", "method_specs", default=None,
              help="Explicit methods instead of --selectors x --ratios, space-separated: 0 (naive reuse), 1, "
                   "<selector>@<ratio> (e.g. '0 deviation@0.15 query:rows=16@0.3').")
@click.option("--signal", type=click.Choice(["v", "k", "kv"]), default="v", show_default=True,
              help="deviation selector: which deviation scores tokens.")
@click.option("--check-layers", default=None, help="deviation selector: check layers (default: 1,3,6 gradual).")
@policy_options
@click.option("--tokens", "n_tokens", default=32, show_default=True, type=click.IntRange(1, None),
              help="Answer tokens scored for fidelity.")
@click.option("--answer-tokens", default=64, show_default=True, type=click.IntRange(1, None),
              help="Most tokens of a greedy answer (it ends earlier at the end of the turn); its first line is "
                   "scored against the gold answers.")
@click.option("--question-format", default=None, callback=lambda c, p, v: v and _question_format(v),
              help="The prompt's text after the chunks, {question} marking the question (not part of any cache "
                   "key), e.g. an instruction to answer briefly  [default: ragkv.prompt.DEFAULT_QUESTION]")
@click.option("--repeats", default=1, show_default=True, type=click.IntRange(1, None),
              help="Timed runs per method and question (median).")
@click.option("--time-sequential", is_flag=True,
              help="Also time every blend with layers read in the compute thread (doubles the blends' cost).")
@click.option("--cache", "cache_dir", default=None, envvar="RAGKV_EVAL_CACHE",
              help="Folder of per-question results (full prefill's references, each method's outcomes), "
                   "written as they are computed: a rerun computes only what is missing and a killed run "
                   "resumes; 'none' keeps nothing (env RAGKV_EVAL_CACHE)  [default: $RAGKV_HOME/eval-cache]")
@click.option("--fresh", is_flag=True, help="Compute everything again (e.g. after changing the read path); "
                                            "the new results replace the cached ones.")
@click.option("--namespace", default="", help="Cache namespace (salt).")
@click.option("--json", "json_out", default=None, callback=lambda c, p, v: v and writable(v),
              help="Also write the report here.")
def eval_cmd(questions_paths, sample, seed, model_name, model_dtype, store_uris, ratios, selectors, method_specs, signal,
             check_layers, sink, gap, context, lead, n_tokens, answer_tokens, question_format, repeats,
             time_sequential, cache_dir, fresh, namespace, json_out):
    """Measure how faithful blending is to full prefill on your own questions: how often the answer
    stays full prefill's, and with gold answers how right each method's answers are (exact match,
    token F1), per dataset and per question type. Without --selectors/--ratios: full prefill, naive
    reuse and the default.

    Exit status 1 when some question could not be evaluated (the others are reported)."""
    from dataclasses import replace

    from ragkv.answers import load_questions
    from ragkv.blend import BlendConfig
    from ragkv.blend.config import DEFAULT_RATIO, DEFAULT_SELECTOR
    from ragkv.evalcache import EvalCache
    from ragkv.evaluate import evaluate, format_table, parse_methods, sample_questions
    from ragkv.gguf import ragkv_home

    ratio_list = ratios_of(f"0,{DEFAULT_RATIO}" if ratios is None else ratios)
    sels = _selectors(DEFAULT_SELECTOR if selectors is None else selectors, signal, check_layers)
    methods = None
    if method_specs is not None:
        if ratios is not None or selectors is not None:
            raise click.UsageError("give --methods or --selectors/--ratios, not both")
        try:
            methods = parse_methods(method_specs)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--methods") from None
    names = [Path(p).stem for p in questions_paths]
    if len(set(names)) < len(names):
        raise click.BadParameter(f"two questions files share a name ({', '.join(names)}): each names its "
                                 "dataset in the report", param_hint="--questions")
    try:
        qs = [q for p in questions_paths for q in sample_questions(load_questions(p), sample, seed)]
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    try:
        cache = EvalCache(None if cache_dir == "none" else (cache_dir or ragkv_home() / "eval-cache"), fresh=fresh)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--cache") from None
    with open_store(store_uris) as store:
        check_tiers([store])
        engine = build(model_name, model_dtype, store, BlendConfig(selector=sels[0]), sink=sink, gap=gap,
                       namespace=namespace, context=context, lead=lead)
        if question_format is not None:  # the suffix only: chunk and prefix keys do not depend on it
            engine.template = replace(engine.template, question_format=question_format)
        try:
            report = evaluate(engine, qs, ratios=ratio_list, n_tokens=n_tokens, max_new_tokens=answer_tokens,
                              repeats=repeats, progress=_Progress(f" ({', '.join(names)})"), selectors=sels,
                              cache=cache, time_sequential=time_sequential, methods=methods)
        except ValueError as e:  # e.g. a check layer beyond the model's depth
            raise click.ClickException(str(e)) from None
    report["model"], report["model_dtype"], report["store"] = model_name, str(engine.adapter.dtype), store.uri
    report["sample"], report["seed"] = sample, seed
    click.echo(format_table(report))
    if json_out:
        Path(json_out).write_text(json.dumps(report, indent=1) + "\n")
        click.echo(f"report written to {json_out}", err=True)
    if report["errors"]:
        sys.exit(1)
