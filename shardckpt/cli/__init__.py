"""The `shardckpt` command: one module per subcommand, loaded only when that subcommand runs.

`main` is the console entry point.
"""

from shardckpt.cli.main import main

__all__ = ["main"]
