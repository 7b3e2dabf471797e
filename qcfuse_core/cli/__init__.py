"""The `qcfuse` command line: argparse entry points over the public API (thin)."""

from qcfuse_core.cli.commands import main

__all__ = ["main"]
