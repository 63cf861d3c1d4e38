"""The ``ragkv`` command line. Heavy imports (torch, transformers) happen inside commands so that
``ragkv --help`` and ``ragkv --version`` answer instantly."""

from __future__ import annotations

import click

from ragkv._version import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "-V", "--version", prog_name="ragkv")
def main() -> None:
    """ragkv: precompute document-chunk K/V once, reuse it in any RAG prompt (CacheBlend).

    \b
    Store URIs (comma-separated list = tiers, fastest first):
      memory[://?max_bytes=1G]   disk:///path[?max_bytes=10G]   redis://host:6379/0
    """


if __name__ == "__main__":
    main()
