"""The ``ragkv`` command line. Heavy imports (torch, transformers) happen inside commands so that
``ragkv --help`` and ``ragkv --version`` answer instantly.

    precompute    ragkv.cli.precompute   (--ray: ragkv.distributed)
    eval          ragkv.cli.evaluate
    stats, clear, evict   ragkv.cli.store
    serve         registered by ragkv[serve] under the entry-point group ``ragkv.commands``

Options shared by several commands (and by ``ragkv serve``) live in ``ragkv.cli.options``.
"""

from __future__ import annotations

import click

from ragkv._version import __version__
from ragkv.cli.evaluate import eval_cmd
from ragkv.cli.precompute import precompute
from ragkv.cli.store import clear, evict, stats


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


for _cmd in (precompute, eval_cmd, stats, clear, evict):
    main.add_command(_cmd)

__all__ = ["main"]
