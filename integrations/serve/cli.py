"""``ragkv serve``: registered under the entry-point group ``ragkv.commands`` (pyproject), so the core
CLI finds it without importing the integrations. Only click is imported here; fastapi, uvicorn and the
model load when the command runs."""

from __future__ import annotations

import logging
import signal
from pathlib import Path

import click

from ragkv.cli.options import build, check_tiers, model_options, open_store, policy_options, ratio

from .guard import allowed_hosts, is_loopback
from .writes import DEFAULT_WRITE_STORE, POLICIES, WritePolicy, check_write_store

log = logging.getLogger("ragkv.serve")


def _size(ctx, param, value: str) -> int:
    from ragkv.store.values import size_from_str

    try:
        n = size_from_str(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    if n is None:
        raise click.BadParameter(f"give a size (e.g. 2M), got {value!r}")
    return n


@click.command("serve")
@click.option("--store", "store_uri", required=True, envvar="RAGKV_STORE",
              help="store URI(s), comma-separated = tiers (env RAGKV_STORE)")
@model_options
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on (loopback by default)")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535))
@click.option("--ratio", default="0.15", show_default=True, callback=ratio,
              help="fraction of reused chunk tokens recomputed: 0..1 (1 = full prefill) or 'auto'")
@click.option("--selector", default="query", show_default=True,  # (ragkv.blend.config.DEFAULT_SELECTOR)
              help="which chunk tokens are recomputed (deviation, query, starts)")
@click.option("--max-queue", default=32, show_default=True, type=click.IntRange(1, None),
              help="requests admitted at once (running or waiting); more get 429 + Retry-After")
@click.option("--max-tokens", "default_max_tokens", default=256, show_default=True, type=click.IntRange(1, None),
              help="max_tokens of a request that sets none")
@click.option("--served-model-name", default=None, help="the model id clients send  [default: --model]")
@click.option("--namespace", default="", help="cache salt; must match the precompute job's")
@click.option("--shutdown-timeout", default=30.0, show_default=True, type=click.FloatRange(0, None),
              help="seconds in-flight requests get to finish after SIGTERM/SIGINT")
@click.option("--threads", type=click.IntRange(1, None), default=None,
              help="torch intra-op threads of the model  [default: torch's]")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
@click.option("--api-key", envvar="RAGKV_API_KEY", default=None,
              help="require 'Authorization: Bearer KEY' (401 otherwise; /health stays open). Prefer the env "
                   "RAGKV_API_KEY: a command line is visible to other users")
@click.option("--metrics-public", is_flag=True, help="serve /metrics without the API key")
@click.option("--allow-host", "allow_hosts", multiple=True, metavar="NAME",
              help="also answer requests whose Host is NAME (repeatable); a loopback bind answers only "
                   "localhost/127.0.0.1/::1 otherwise (DNS rebinding), any other bind any Host unless given")
@click.option("--max-body", default="2M", show_default=True, callback=_size,
              help="largest request body (413 beyond it, refused before it is parsed)")
@click.option("--write-policy", type=click.Choice(POLICIES), default="quota", show_default=True,
              help="which K/V computed for requests (chunks the store lacks) is kept in --write-store: "
                   "quota = up to --write-quota per --write-window, all, none")
@click.option("--write-quota", default="256M", show_default=True, callback=_size,
              help="bytes of entries kept per --write-window under --write-policy quota")
@click.option("--write-window", default=3600.0, show_default=True, type=click.FloatRange(0, None, min_open=True),
              help="seconds of the --write-quota window (sliding)")
@click.option("--write-store", envvar="RAGKV_WRITE_STORE", default=DEFAULT_WRITE_STORE, show_default=True,
              help="bounded store for entries computed for requests, read after --store; never one of --store's "
                   "(--store is only read: client writes never evict the precomputed corpus)")
@policy_options
def serve(store_uri, model_name, model_dtype, host, port, ratio, selector, max_queue, default_max_tokens,
          served_model_name, namespace, shutdown_timeout, threads, log_level, api_key, metrics_public, allow_hosts,
          max_body, write_policy, write_quota, write_window, write_store, sink, gap, context, lead):
    """OpenAI-compatible chat completions answered from cached chunks (needs ragkv[serve]).

    \b
    POST /v1/chat/completions  (messages + "documents": each one cached chunk; stream: true = SSE)
    GET  /v1/models  /health  /metrics (Prometheus)
    Stops cleanly on SIGTERM: in-flight requests get --shutdown-timeout seconds, the store is closed.

    \b
    Exposing it beyond this machine: set RAGKV_API_KEY, bind --host 0.0.0.0 (it warns without a
    key), keep --max-body small; --store is only read, chunks computed for clients go to the
    bounded --write-store under --write-policy.
    """
    try:
        import uvicorn

        from .app import create_app
    except ImportError as e:
        raise click.ClickException(f"`ragkv serve` needs its extra ({e}); install it with: "
                                   "pip install 'ragkv[serve]'") from None
    from ragkv.blend import SELECTORS, BlendConfig

    if selector not in SELECTORS:
        raise click.BadParameter(f"{selector!r}; valid: {', '.join(sorted(SELECTORS))}", param_hint="--selector")
    if api_key is not None and not api_key.strip():
        raise click.BadParameter("the API key is empty (unset RAGKV_API_KEY for a server without one)",
                                 param_hint="--api-key")
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not is_loopback(host) and not api_key:
        log.warning("listening on %s without an API key: anyone who can reach this address can use the model "
                    "and fill the write store; set RAGKV_API_KEY (or --api-key)", host)
    policy = WritePolicy(write_policy, write_quota, write_window)
    engine = _engine(store_uri, write_store, policy, model_name, model_dtype, BlendConfig(ratio=ratio, selector=selector),
                     sink=sink, gap=gap, namespace=namespace, context=context, lead=lead)
    model_id = served_model_name or (Path(model_name).name if Path(model_name).is_dir() else model_name)
    app = create_app(engine, model_id, max_queue=max_queue, default_max_tokens=default_max_tokens, api_key=api_key,
                     metrics_public=metrics_public, max_body=max_body,
                     allowed_hosts=allowed_hosts(host, allow_hosts))
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout,
                            access_log=log_level == "debug")
    # uvicorn re-raises the signal it stopped on once it has shut down; with these handlers in place that
    # ends nothing, so a clean shutdown (in-flight requests done, store closed) exits 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    uvicorn.Server(config).run()
    click.echo("ragkv serve: stopped", err=True)


def _engine(store_uri, write_store, policy: WritePolicy, model_name, model_dtype, config, **options):
    """The engine over the corpus store (only read) and the write store (``policy``), checked before
    the model loads; both stores are closed again when anything fails."""
    from .store import ServeStore

    store = open_store(store_uri, "--store", create=False)
    writes = None
    try:
        writes = open_store(write_store, "--write-store")
        if policy.policy != "none":
            try:
                check_write_store(store, writes)
            except ValueError as e:
                raise click.BadParameter(str(e), param_hint="--write-store") from None
        check_tiers([store, writes])
        engine = build(model_name, model_dtype, ServeStore(store, writes, policy), config, **options)
    except BaseException:
        store.close()
        if writes is not None:
            writes.close()
        raise
    log.info("chunks computed for requests: %s, kept in %s", policy.describe(), writes.uri)
    return engine
