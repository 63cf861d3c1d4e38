"""``ragkv stats`` / ``clear`` / ``evict``: look at a store, empty it, shrink its disk tiers. ``stats``
only looks (creates, locks, sweeps nothing); ``clear`` and ``evict`` never create a store."""

from __future__ import annotations

import json
import sys

import click

from ragkv.cli.options import STORE_HELP, check_tiers, open_store


def _tier_rows(store) -> list[dict]:
    """stats() of each tier, with ``stale``: entries of an older key scheme (ragkv.keys.STALE_PREFIXES),
    which this version never reads; an unusable tier is a row with available=False and its error."""
    from ragkv.keys import STALE_PREFIXES
    from ragkv.store import StoreError

    rows = []
    for tier in store.tiers:
        try:
            tier.check()
            row = {**tier.stats(), "available": True}
            keys = list(tier.keys())
            row["stale"] = sum(k.startswith(STALE_PREFIXES) for k in keys)
            if row.get("entries") is None:  # a backend that does not count: its keys do
                row["entries"] = len(keys)
        except StoreError as e:
            row = {"uri": tier.uri, "available": False, "error": str(e), "entries": None, "bytes": None}
        rows.append(row)
    return rows


@click.command()
@click.option("--store", "store_uri", required=True, envvar="RAGKV_STORE", help=STORE_HELP)
@click.option("--json", "as_json", is_flag=True, help='one JSON object: {"tiers": [{"uri", "entries", ...}]}')
def stats(store_uri, as_json):
    """Entries and bytes per tier, and this process's hit/miss/corruption counters. Exit status 1
    when a tier is unavailable (shown as such). Only looks: creates, locks, sweeps nothing."""
    with open_store(store_uri, read_only=True) as store:
        rows = _tier_rows(store)
    if as_json:
        click.echo(json.dumps({"tiers": rows}))
    else:
        cols = ("entries", "stale", "bytes", "max_bytes", "hits", "misses", "corruptions", "evictions", "errors")
        width = max(len("uri"), *(len(r["uri"]) for r in rows))
        click.echo(f"{'uri':<{width}}  " + "  ".join(f"{c:>11}" for c in cols))
        for r in rows:
            if not r["available"]:
                click.echo(f"{r['uri']:<{width}}  unavailable: {r['error']}")
                continue
            vals = ["-" if r.get(c) is None else str(r[c]) for c in cols]
            click.echo(f"{r['uri']:<{width}}  " + "  ".join(f"{v:>11}" for v in vals))
        if any(r.get("stale") for r in rows):
            click.echo("stale: entries written by ragkv <= 0.3 (another key scheme); this version never reads them. "
                       "Rerun `ragkv precompute` (it writes what is missing); they leave by eviction or "
                       "`ragkv clear`.", err=True)
    if not all(r["available"] for r in rows):
        sys.exit(1)


@click.command()
@click.option("--store", "store_uri", required=True, envvar="RAGKV_STORE", help=STORE_HELP)
@click.option("--yes", is_flag=True, help="do not ask for confirmation")
def clear(store_uri, yes):
    """Delete every entry of the store (every tier); a disk store that is not there is an error
    (nothing is created), files in it that are not entries are left alone."""
    from ragkv.store import StoreError

    with open_store(store_uri, create=False) as store:
        check_tiers(store.tiers)
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


@click.command()
@click.option("--store", "store_uri", required=True, envvar="RAGKV_STORE", help=STORE_HELP)
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
    with open_store(store_uri, create=False) as store:
        check_tiers(t for t in store.tiers if hasattr(t, "plan_eviction"))
        for tier in store.tiers:
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
