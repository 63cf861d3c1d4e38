"""The ``ragkv`` command line. Heavy imports (torch, transformers) happen inside commands so that
``ragkv --help`` and ``ragkv --version`` answer instantly."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from ragkv._version import __version__
from ragkv.cli_ray import precompute_ray, ray_options

_STORE_HELP = "store URI(s), comma-separated = tiers (env RAGKV_STORE)"


class _Commands(click.Group):
    """The core commands plus those installed packages register under the entry-point group
    ``ragkv.commands`` (e.g. ``serve`` from ``ragkv[serve]``), loaded only when named or listed, so the
    core never imports the integrations and ``ragkv --help`` stays fast."""

    def _plugins(self) -> dict:
        from importlib.metadata import entry_points

        return {ep.name: ep for ep in entry_points(group="ragkv.commands") if ep.name not in self.commands}

    def list_commands(self, ctx):
        return sorted([*super().list_commands(ctx), *self._plugins()])

    def get_command(self, ctx, name):
        cmd = super().get_command(ctx, name)
        if cmd is not None:
            return cmd
        ep = self._plugins().get(name)
        if ep is None:
            return None
        try:
            return ep.load()
        except ImportError as e:  # an extra's command whose module (or a dependency) is missing
            return _unavailable(name, ep.value, e)


def _unavailable(name: str, target: str, error: ImportError) -> click.Command:
    @click.command(name, help=f"(unavailable: {error})", context_settings={"ignore_unknown_options": True})
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def cmd(args):
        raise click.ClickException(f"`ragkv {name}` cannot load ({target}: {error}); "
                                   f"install it with: pip install 'ragkv[{name}]'")

    return cmd


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "-V", "--version", prog_name="ragkv")
def main() -> None:
    """ragkv: precompute document-chunk K/V once, reuse it in any RAG prompt (CacheBlend).

    \b
    Store URIs (comma-separated list = tiers, fastest first):
      memory[://?max_bytes=1G]   disk:///path[?max_bytes=10G]   redis://host:6379/0[?namespace=ns]
    """


def _open_store(uris: str, param_hint: str = "--store", **options):
    """The store of --store: a bad URI is a usage error (exit 2), a backend that cannot be opened
    (e.g. an unwritable disk root) an error (exit 1). Messages never show secrets. ``options``:
    ``open_store``'s (``create=False``: a missing disk store is an error, not created;
    ``read_only=True``: nothing is created, locked or swept)."""
    from ragkv.store import StoreError, open_store

    try:
        return open_store(uris, **options)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint=param_hint) from None
    except StoreError as e:
        raise click.ClickException(f"store unavailable: {e}") from None


def _check(tiers) -> None:
    """Every tier is usable, or a clear error (exit 1) before anything is changed."""
    from ragkv.store import StoreUnavailable

    for tier in tiers:
        try:
            tier.check()
        except StoreUnavailable as e:
            raise click.ClickException(f"store unavailable: {e}") from None


def _policy_options(f):
    """--sink/--gap/--context/--lead: the precompute policy; writers and readers of one store must agree
    on sink, gap and context (lead only adds entries: a reader without them falls back)."""
    from ragkv.policy import MAX_CONTEXT, PrecomputePolicy

    f = click.option("--lead/--no-lead", default=PrecomputePolicy.lead, show_default=True,
                     help="precompute policy: also store each chunk right behind the sink, read when it is a "
                          "prompt's first chunk (2x entries; readers fall back when a store has none)")(f)
    f = click.option("--context", type=click.IntRange(0, MAX_CONTEXT), default=PrecomputePolicy.context,
                     show_default=True,
                     help="precompute policy: neighbour chunks (most similar in the corpus) each chunk is "
                          "prefilled behind; 0 = none")(f)
    f = click.option("--gap", type=click.IntRange(min=0), default=None,
                     help="precompute policy: positions between sink and chunk  [default: min(1024, model positions/4)]")(f)
    return click.option("--sink", type=click.Choice(["template", "bos", "none"]), default="template",
                        show_default=True, help="precompute policy: what each chunk is prefilled behind")(f)


def _shard(ctx, param, value):
    from ragkv.precompute import parse_shard

    try:
        return parse_shard(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _model_options(f):
    """--model/--model-dtype: which model computes, in which dtype (part of every key: writers and
    readers of one store must agree)."""
    f = click.option("--model-dtype", type=click.Choice(["auto", "bfloat16", "float32", "float16"]), default="auto",
                     show_default=True, help="auto = bfloat16 on a GPU or a CPU with native bf16, else float32")(f)
    return click.option("--model", "model_name", default="smollm2-135m", show_default=True,
                        help="smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b (fetched and converted into "
                             "$RAGKV_HOME on first use) or a local HuggingFace model directory")(f)


def _engine(model_name: str, model_dtype: str, store, config=None, sink="template", gap=None, namespace="",
            storage=None, context=None, lead=None, write_path: bool = False):
    """The BlendEngine every command builds from its options, or with ``write_path`` the Prefiller
    (model errors are clear, not tracebacks)."""
    from ragkv import models
    from ragkv.spec import EngineSpec

    given = {name: v for name, v in (("context", context), ("lead", lead)) if v is not None}  # else the policy's
    spec = EngineSpec(model_name, model_dtype, sink=sink, gap=gap, namespace=namespace, storage=storage, **given)
    try:
        spec.policy()  # (checked before the model loads)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    try:
        return spec.prefiller(store) if write_path else spec.engine(store, config)
    except models.ModelNotFoundError as e:
        raise click.ClickException(str(e)) from None


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=str))
@click.option("--store", "store_uri", required=True, envvar="RAGKV_STORE", help=_STORE_HELP)
@_model_options
@click.option("--chunk-tokens", default=512, show_default=True, type=click.IntRange(16, None),
              help="max cached tokens per chunk")
@click.option("--dtype", "storage_dtype", type=click.Choice(["float32", "float16", "bfloat16", "int8"]),
              default=None, help="storage dtype of the entries  [default: the model's]")
@click.option("--quant-axis", type=click.Choice(["auto", "token", "channel"]), default=None,
              help="int8 scale axis  [default: auto = K per channel, V per token]")
@click.option("--namespace", default="", help="cache salt; readers must use the same one")
@click.option("--batch-tokens", default=4096, show_default=True, type=click.IntRange(1, None),
              help="padded tokens per forward")
@click.option("--shard", callback=_shard, default=None, metavar="I/N",
              help="only chunks whose key is in shard I of N (split one corpus over N machines)")
@click.option("--allow-eviction", is_flag=True,
              help="write even when the planned entries exceed a tier's max_bytes (they evict each other)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON summary on stdout")
@click.option("--progress/--no-progress", default=True, show_default=True, help="progress bars on stderr")
@_policy_options
@ray_options
def precompute(paths, store_uri, model_name, model_dtype, chunk_tokens, storage_dtype, quant_axis, namespace,
               batch_tokens, shard, allow_eviction, as_json, progress, sink, gap, context, lead, use_ray, ray_address,
               workers, cpus_per_worker):
    """Chunk, prefill and store documents: .txt/.md files, .jsonl (field "text"), folders (recursive).

    Idempotent: chunks already in the store are skipped (and copied into tiers that lack them), so a
    killed run just runs again. Files that are binary, empty or not UTF-8, anything that is not a
    regular file (FIFOs, devices) and symlinked folders inside a folder (not followed) are reported and
    skipped; so are .jsonl lines that are not valid JSON or Unicode.

    \b
    Exit status: 0 every chunk stored; 1 some chunk failed, or the job stopped early after repeated
    write failures (the summary says how to resume); 2 bad usage, no document could be read, or the
    corpus cannot fit the store's budget.
    """
    from ragkv.policy import StorageFormat
    from ragkv.precompute import OverBudget
    from ragkv.precompute import precompute as run

    if quant_axis is not None and storage_dtype != "int8":
        raise click.BadParameter("only meaningful with --dtype int8", param_hint="--quant-axis")
    storage = StorageFormat(storage_dtype, quant_axis)
    if use_ray:  # the same job on Ray Data (ragkv/cli_ray.py)
        try:
            summary = precompute_ray(paths, store_uri, shard, allow_eviction, progress, ray_address, workers,
                                     cpus_per_worker, chunk_tokens=chunk_tokens, batch_tokens=batch_tokens,
                                     model=model_name, model_dtype=model_dtype, sink=sink, gap=gap,
                                     context=context, lead=lead, namespace=namespace, storage=storage)
        except OverBudget as e:
            _over_budget(e, as_json)
        return _precompute_done(summary, paths, as_json)
    store = _open_store(store_uri)
    with store:
        _check([store])
        prefiller = _engine(model_name, model_dtype, store, sink=sink, gap=gap, namespace=namespace, storage=storage,
                            context=context, lead=lead, write_path=True)
        try:
            summary = run(prefiller, paths=list(paths), chunk_tokens=chunk_tokens, batch_tokens=batch_tokens,
                          shard=shard, allow_eviction=allow_eviction, progress=progress)
        except OverBudget as e:
            _over_budget(e, as_json)
    _precompute_done(summary, paths, as_json)


def _over_budget(e, as_json: bool) -> None:
    """Exit 2 for a corpus that cannot fit the store; with --json the summary so far and the error
    on stdout, as every other exit of the command prints its JSON."""
    click.echo(f"Error: {e}", err=True)
    if as_json:
        click.echo(json.dumps({**(e.summary.as_dict() if e.summary is not None else {}), "error": str(e)}))
    sys.exit(2)


def _precompute_done(summary, paths, as_json) -> None:
    """The summary on stderr (and JSON on stdout), the exit status: the same for --ray."""
    click.echo(summary.describe(), err=True)
    if as_json:
        click.echo(json.dumps(summary.as_dict()))
    if summary.docs == 0:
        click.echo("Error: no document could be read from " + ", ".join(paths) + " (see the reasons above)", err=True)
        sys.exit(2)
    if summary.failed or summary.stopped:
        sys.exit(1)


def _tier_rows(store) -> list[dict]:
    """stats() of each tier; an unusable tier is a row with available=False and its error."""
    from ragkv.store import StoreError

    rows = []
    for tier in store.tiers:
        try:
            tier.check()
            row = {**tier.stats(), "available": True}
            if row.get("entries") is None:  # a backend that does not count: list its keys
                row["entries"] = sum(1 for _ in tier.keys())  # noqa: SIM118 - KVStore.keys()
        except StoreError as e:
            row = {"uri": tier.uri, "available": False, "error": str(e), "entries": None, "bytes": None}
        rows.append(row)
    return rows


@main.command()
@click.option("--store", "store_uri", required=True, envvar="RAGKV_STORE", help=_STORE_HELP)
@click.option("--json", "as_json", is_flag=True, help='one JSON object: {"tiers": [{"uri", "entries", ...}]}')
def stats(store_uri, as_json):
    """Entries and bytes per tier, and this process's hit/miss/corruption counters. Exit status 1
    when a tier is unavailable (shown as such). Only looks: creates, locks, sweeps nothing."""
    with _open_store(store_uri, read_only=True) as store:
        rows = _tier_rows(store)
    if as_json:
        click.echo(json.dumps({"tiers": rows}))
    else:
        cols = ("entries", "bytes", "max_bytes", "hits", "misses", "corruptions", "evictions", "errors")
        width = max(len("uri"), *(len(r["uri"]) for r in rows))
        click.echo(f"{'uri':<{width}}  " + "  ".join(f"{c:>11}" for c in cols))
        for r in rows:
            if not r["available"]:
                click.echo(f"{r['uri']:<{width}}  unavailable: {r['error']}")
                continue
            vals = ["-" if r.get(c) is None else str(r[c]) for c in cols]
            click.echo(f"{r['uri']:<{width}}  " + "  ".join(f"{v:>11}" for v in vals))
    if not all(r["available"] for r in rows):
        sys.exit(1)


@main.command()
@click.option("--store", "store_uri", required=True, envvar="RAGKV_STORE", help=_STORE_HELP)
@click.option("--yes", is_flag=True, help="do not ask for confirmation")
def clear(store_uri, yes):
    """Delete every entry of the store (every tier); a disk store that is not there is an error
    (nothing is created), files in it that are not entries are left alone."""
    from ragkv.store import StoreError

    with _open_store(store_uri, create=False) as store:
        _check(store.tiers)
        try:
            n = sum(1 for _ in store.keys())  # noqa: SIM118 - KVStore.keys()
            if not yes:
                click.confirm(f"delete {n} entries from {store.uri}?", abort=True, err=True)
            store.clear()
        except StoreError as e:
            raise click.ClickException(str(e)) from None
        click.echo(f"cleared {n} entries from {store.uri}", err=True)
        for tier in store.tiers:
            others = tier.foreign_files() if hasattr(tier, "foreign_files") else []
            if others:
                click.echo(f"{tier.uri}: left {len(others)} file(s) that are not ragkv entries, e.g. {others[0]}",
                           err=True)


@main.command()
@click.option("--store", "store_uri", required=True, envvar="RAGKV_STORE", help=_STORE_HELP)
@click.option("--max-bytes", required=True, help="evict least recently used entries down to this size (e.g. 10G, at least 1M)")
@click.option("--yes", is_flag=True, help="do not ask for confirmation")
def evict(store_uri, max_bytes, yes):
    """Evict least recently used entries of disk tiers until each fits --max-bytes (`ragkv clear`
    empties a store). Shows what it would delete and asks first."""
    from ragkv.store import StoreError
    from ragkv.store.values import typed_budget

    try:
        limit = typed_budget(max_bytes)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--max-bytes") from None
    if limit is None:
        raise click.BadParameter("give a size of at least 1M (to empty a store: `ragkv clear`)", param_hint="--max-bytes")
    with _open_store(store_uri, create=False) as store:
        tiers = store.tiers
        _check(t for t in tiers if hasattr(t, "plan_eviction"))
        for tier in tiers:
            if not hasattr(tier, "plan_eviction"):
                click.echo(f"{tier.uri}: no eviction here (redis: use maxmemory/ttl)", err=True)
                continue
            try:
                n, nbytes = tier.plan_eviction(limit)
                if n and not yes:
                    click.confirm(f"evict {n} entries ({nbytes} bytes) from {tier.uri} to fit {limit} bytes?",
                                  abort=True, err=True)
                n = tier.evict(limit) if n else 0
            except (StoreError, OSError) as e:
                raise click.ClickException(f"{tier.uri}: {e}") from None
            click.echo(f"{tier.uri}: evicted {n} entries", err=True)


def _writable(path: str) -> str:
    """Fail before a long run, not after it, when a report cannot be written to ``path``."""
    p = Path(path)
    if p.is_dir():
        raise click.BadParameter(f"{path} is a directory", param_hint="--json")
    if not p.parent.is_dir():
        raise click.BadParameter(f"directory {p.parent} does not exist", param_hint="--json")
    try:
        with open(p, "a"):
            pass
    except OSError as e:
        raise click.BadParameter(f"cannot write {path}: {e.strerror or e}", param_hint="--json") from None
    return path


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


def _ratios(text: str) -> list:
    from ragkv.blend import check_ratio

    try:
        out = [check_ratio("auto" if r.strip() == "auto" else float(r)) for r in text.split(",") if r.strip()]
    except ValueError as e:
        raise click.BadParameter(f"{e} (in {text!r})", param_hint="--ratios") from None
    if not out:
        raise click.BadParameter("give at least one ratio", param_hint="--ratios")
    return out


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


@main.command("eval")
@click.option("--questions", "questions_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="JSONL: one {question, contexts: [chunk, ...], answer?: str | [str]} per line (or "
                   "answers: [str]); with gold answers, exact match and token F1 are reported.")
@_model_options
@click.option("--store", "store_uris", required=True, envvar="RAGKV_STORE", help=_STORE_HELP)
@click.option("--ratios", default="0,0.15,0.3,1", show_default=True,
              help="Comma-separated recompute ratios; 'auto' = the loading controller's choice.")
@click.option("--selectors", default="deviation", show_default=True,  # (ragkv.blend.config.DEFAULT_SELECTOR)
              help="Comma-separated selection strategies, measured side by side (deviation, query, starts).")
@click.option("--signal", type=click.Choice(["v", "k", "kv"]), default="v", show_default=True,
              help="deviation selector: which deviation scores tokens.")
@click.option("--check-layers", default=None, help="deviation selector: check layers (default: 1,3,6 gradual).")
@_policy_options
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
@click.option("--json", "json_out", default=None, callback=lambda c, p, v: v and _writable(v),
              help="Also write the report here.")
def eval_cmd(questions_path, model_name, model_dtype, store_uris, ratios, selectors, signal, check_layers, sink, gap,
             context, lead, n_tokens, answer_tokens, question_format, repeats, namespace, json_out):
    """Measure how faithful blending is to full prefill on your own questions, and with gold answers
    how right each method's answers are (exact match, token F1).

    Exit status 1 when some question could not be evaluated (the others are reported)."""
    from dataclasses import replace

    from ragkv.blend import BlendConfig
    from ragkv.evaluate import evaluate, format_table, load_questions

    ratio_list = _ratios(ratios)
    sels = _selectors(selectors, signal, check_layers)
    try:
        qs = load_questions(questions_path)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    store = _open_store(store_uris)
    _check([store])
    engine = _engine(model_name, model_dtype, store, BlendConfig(selector=sels[0]), sink=sink, gap=gap,
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


if __name__ == "__main__":
    main()
