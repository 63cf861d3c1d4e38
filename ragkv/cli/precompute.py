"""``ragkv precompute``: chunk, prefill and store documents, on this machine or on Ray Data (--ray:
ragkv.distributed; Ray, torch and the model load only when the command runs)."""

from __future__ import annotations

import json
import sys

import click

from ragkv.cli.options import STORE_HELP, build, check_tiers, model_options, open_store, policy_options


def _shard(ctx, param, value):
    from ragkv.precompute import parse_shard

    try:
        return parse_shard(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def ray_options(f):
    """--ray/--ray-address/--workers/--cpus-per-worker: the precompute job on Ray Data (ragkv[ray])."""
    f = click.option("--cpus-per-worker", type=click.IntRange(1, None), default=1, show_default=True,
                     help="--ray: CPUs (and torch threads) of each worker")(f)
    f = click.option("--workers", type=click.IntRange(1, None), default=1, show_default=True,
                     help="--ray: actors, each with its own copy of the model")(f)
    f = click.option("--ray-address", default=None, metavar="auto|HOST:PORT",
                     help="--ray: join this Ray cluster ('auto': the one `ray start` set up here)  "
                          "[default: start a local Ray]")(f)
    return click.option("--ray", "use_ray", is_flag=True,
                        help="run on Ray Data: workers write straight to the shared store (pip install 'ragkv[ray]')")(f)


@click.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=str))
@click.option("--store", "store_uri", required=True, envvar="RAGKV_STORE", help=STORE_HELP)
@model_options
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
@policy_options
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
    policy = dict(sink=sink, gap=gap, context=context, lead=lead, namespace=namespace, storage=storage)
    try:
        if use_ray:  # the same job on Ray Data
            summary = _on_ray(paths, store_uri, shard, allow_eviction, progress, ray_address, workers, cpus_per_worker,
                              chunk_tokens=chunk_tokens, batch_tokens=batch_tokens, model=model_name,
                              model_dtype=model_dtype, **policy)
        else:
            with open_store(store_uri) as store:
                check_tiers([store])
                prefiller = build(model_name, model_dtype, store, write_path=True, **policy)
                summary = run(prefiller, paths=list(paths), chunk_tokens=chunk_tokens, batch_tokens=batch_tokens,
                              shard=shard, allow_eviction=allow_eviction, progress=progress)
    except OverBudget as e:  # exit 2; with --json the summary so far and the error, as every other exit
        click.echo(f"Error: {e}", err=True)
        if as_json:
            click.echo(json.dumps({**(e.summary.as_dict() if e.summary is not None else {}), "error": str(e)}))
        sys.exit(2)
    _done(summary, paths, as_json)


def _on_ray(paths, store_uri, shard, allow_eviction, progress, address, workers, cpus_per_worker, *,
            chunk_tokens, batch_tokens, **spec):
    from ragkv import models
    from ragkv.distributed import precompute_ray
    from ragkv.precompute import OverBudget
    from ragkv.spec import EngineSpec
    from ragkv.store import StoreError

    if shard is not None:
        raise click.BadParameter("--shard splits a corpus over jobs started by hand; --ray splits it over Ray "
                                 "workers: use one or the other", param_hint="--shard")
    open_store(store_uri).close()  # a bad URI is a usage error here, before Ray starts
    try:
        return precompute_ray(EngineSpec(store_uri=store_uri, **spec), paths=list(paths), chunk_tokens=chunk_tokens,
                              batch_tokens=batch_tokens, workers=workers, cpus_per_worker=cpus_per_worker,
                              address=address, allow_eviction=allow_eviction, progress=progress)
    except OverBudget:
        raise  # (the command prints it, with --json as JSON)
    except ValueError as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(2)
    except StoreError as e:
        raise click.ClickException(f"store unavailable: {e}") from None
    except (models.ModelNotFoundError, RuntimeError) as e:
        raise click.ClickException(str(e)) from None


def _done(summary, paths, as_json) -> None:
    """The summary on stderr (and JSON on stdout), the exit status: the same for --ray."""
    click.echo(summary.describe(), err=True)
    if as_json:
        click.echo(json.dumps(summary.as_dict()))
    if summary.docs == 0:
        click.echo("Error: no document could be read from " + ", ".join(paths) + " (see the reasons above)", err=True)
        sys.exit(2)
    if summary.failed or summary.stopped:
        sys.exit(1)
