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
    """Selector instances for --selectors; --signal/--check-layers configure the deviation selector."""
    from ragkv.blend.select import SELECTORS, DeviationSelector

    out = []
    for name in (n.strip() for n in names.split(",") if n.strip()):
        if name not in SELECTORS:
            raise click.BadParameter(f"unknown selector {name!r}; valid: {', '.join(SELECTORS)}",
                                     param_hint="--selectors")
        if name == DeviationSelector.name:
            try:
                layers = None if check_layers is None else tuple(int(x) for x in check_layers.split(",") if x.strip())
                out.append(DeviationSelector(check_layers=layers, signal=signal))
            except ValueError as e:
                raise click.BadParameter(str(e), param_hint="--check-layers") from None
        else:
            out.append(SELECTORS[name]())
    if not out:
        raise click.BadParameter("give at least one selector", param_hint="--selectors")
    return out


@click.command("eval")
@click.option("--questions", "questions_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="JSONL: one {question, contexts: [chunk, ...], answer?: str | [str]} per line (or "
                   "answers: [str]); with gold answers, exact match and token F1 are reported.")
@model_options
@click.option("--store", "store_uris", required=True, envvar="RAGKV_STORE", help=STORE_HELP)
@click.option("--ratios", default="0,0.15,0.3,1", show_default=True,
              help="Comma-separated recompute ratios; 'auto' = the loading controller's choice.")
@click.option("--selectors", default="deviation", show_default=True,  # (ragkv.blend.config.DEFAULT_SELECTOR)
              help="Comma-separated selection strategies, measured side by side (deviation, query, starts).")
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
@click.option("--namespace", default="", help="Cache namespace (salt).")
@click.option("--json", "json_out", default=None, callback=lambda c, p, v: v and writable(v),
              help="Also write the report here.")
def eval_cmd(questions_path, model_name, model_dtype, store_uris, ratios, selectors, signal, check_layers, sink, gap,
             context, lead, n_tokens, answer_tokens, question_format, repeats, namespace, json_out):
    """Measure how faithful blending is to full prefill on your own questions, and with gold answers
    how right each method's answers are (exact match, token F1).

    Exit status 1 when some question could not be evaluated (the others are reported)."""
    from dataclasses import replace

    from ragkv.answers import load_questions
    from ragkv.blend import BlendConfig
    from ragkv.evaluate import evaluate, format_table

    ratio_list = ratios_of(ratios)
    sels = _selectors(selectors, signal, check_layers)
    try:
        qs = load_questions(questions_path)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    with open_store(store_uris) as store:
        check_tiers([store])
        engine = build(model_name, model_dtype, store, BlendConfig(selector=sels[0]), sink=sink, gap=gap,
                       namespace=namespace, context=context, lead=lead)
        if question_format is not None:  # the suffix only: chunk and prefix keys do not depend on it
            engine.template = replace(engine.template, question_format=question_format)

        def progress(i, n):
            click.echo(f"  question {i}/{n}", err=True)

        try:
            report = evaluate(engine, qs, ratios=ratio_list, n_tokens=n_tokens, max_new_tokens=answer_tokens,
                              repeats=repeats, progress=progress, selectors=sels)
        except ValueError as e:  # e.g. a check layer beyond the model's depth
            raise click.ClickException(str(e)) from None
    report["model"], report["model_dtype"], report["store"] = model_name, str(engine.adapter.dtype), store.uri
    click.echo(format_table(report))
    if json_out:
        Path(json_out).write_text(json.dumps(report, indent=1) + "\n")
        click.echo(f"report written to {json_out}", err=True)
    if report["errors"]:
        sys.exit(1)
