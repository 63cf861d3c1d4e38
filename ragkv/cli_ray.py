"""``ragkv precompute --ray``: its options and how the command runs it (ragkv.distributed). Light to
import: Ray, torch and the model load only when --ray is given."""

from __future__ import annotations

import sys

import click


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


def precompute_ray(paths, store_uri, shard, allow_eviction, progress, address, workers, cpus_per_worker, *,
                    chunk_tokens, batch_tokens, **spec):
    from ragkv import models
    from ragkv.precompute import OverBudget
    from ragkv.spec import EngineSpec
    from ragkv.store import StoreError

    if shard is not None:
        raise click.BadParameter("--shard splits a corpus over jobs started by hand; --ray splits it over Ray "
                                 "workers: use one or the other", param_hint="--shard")
    from ragkv.cli import _open_store
    from ragkv.distributed import precompute_ray as run

    _open_store(store_uri).close()  # a bad URI is a usage error here, before Ray starts
    try:
        return run(EngineSpec(store_uri=store_uri, **spec), paths=list(paths), chunk_tokens=chunk_tokens,
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
