"""What several commands share, ``ragkv serve`` included: the store, model and precompute-policy
options, building the engine from them, ratio parsing, and errors that are messages, not tracebacks
(a bad value is a usage error, exit 2; a backend or model that cannot be used an error, exit 1)."""

from __future__ import annotations

import os
from pathlib import Path

import click

STORE_HELP = "store URI(s), comma-separated = tiers (env RAGKV_STORE)"


def open_store(uris: str, param_hint: str = "--store", **options):
    """The store of --store. ``options``: ``ragkv.store.open_store``'s (``create=False``: a missing
    disk store is an error, not created; ``read_only=True``: nothing is created, locked or swept).
    Messages never show secrets."""
    from ragkv.store import StoreError
    from ragkv.store import open_store as _open

    try:
        return _open(uris, **options)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint=param_hint) from None
    except StoreError as e:
        raise click.ClickException(f"store unavailable: {e}") from None


def check_tiers(tiers) -> None:
    """Every tier is usable, or a clear error (exit 1) before anything is changed."""
    from ragkv.store import StoreUnavailable

    for tier in tiers:
        try:
            tier.check()
        except StoreUnavailable as e:
            raise click.ClickException(f"store unavailable: {e}") from None


def policy_options(f):
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


def model_options(f):
    """--model/--model-dtype: which model computes, in which dtype (part of every key: writers and
    readers of one store must agree)."""
    f = click.option("--model-dtype", type=click.Choice(["auto", "bfloat16", "float32", "float16"]), default="auto",
                     show_default=True, help="auto = bfloat16 on a GPU or a CPU with native bf16, else float32")(f)
    return click.option("--model", "model_name", default="smollm2-135m", show_default=True,
                        help="smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b (fetched and converted into "
                             "$RAGKV_HOME on first use) or a local HuggingFace model directory")(f)


def build(model_name: str, model_dtype: str, store, config=None, *, write_path: bool = False, sink="template",
          gap=None, namespace="", storage=None, context=None, lead=None):
    """The BlendEngine of a command's options, or with ``write_path`` its Prefiller (the policy is
    checked before the model loads; model errors are messages, not tracebacks)."""
    from ragkv import models
    from ragkv.spec import EngineSpec

    given = {name: v for name, v in (("context", context), ("lead", lead)) if v is not None}  # else the policy's
    spec = EngineSpec(model_name, model_dtype, sink=sink, gap=gap, namespace=namespace, storage=storage, **given)
    try:
        spec.policy()
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    try:
        return spec.prefiller(store) if write_path else spec.engine(store, config)
    except models.ModelNotFoundError as e:  # (a ModelFetchError too)
        raise click.ClickException(str(e)) from None


def ratio(ctx, param, value: str):
    """Click callback: one recompute ratio (a number in [0, 1] or 'auto')."""
    from ragkv.blend import parse_ratio

    try:
        return parse_ratio(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def ratios(text: str) -> list:
    """Comma-separated recompute ratios (--ratios)."""
    from ragkv.blend import parse_ratio

    try:
        out = [parse_ratio(r) for r in text.split(",") if r.strip()]
    except ValueError as e:
        raise click.BadParameter(f"{e} (in {text!r})", param_hint="--ratios") from None
    if not out:
        raise click.BadParameter("give at least one ratio", param_hint="--ratios")
    return out


def writable(path: str, param_hint: str = "--json") -> str:
    """Fail before a long run, not after it, when a report cannot be written to ``path`` (nothing is
    created: a run that fails early leaves no empty report behind)."""
    p = Path(path)
    if p.is_dir():
        raise click.BadParameter(f"{path} is a directory", param_hint=param_hint)
    if not p.parent.is_dir():
        raise click.BadParameter(f"directory {p.parent} does not exist", param_hint=param_hint)
    if not (os.access(p, os.W_OK) if p.exists() else os.access(p.parent, os.W_OK | os.X_OK)):
        raise click.BadParameter(f"cannot write {path}: permission denied", param_hint=param_hint)
    return path
