"""Subcommands of the `shardckpt` command beyond inspect/verify/ls: export, import-dcp, import-deepspeed, diff and du.

Each module has NAME, register(subparsers) and run(args, console) -> exit code; cli.py wires them in.
"""

from shardckpt.commands import diff as diff_command
from shardckpt.commands import du as du_command
from shardckpt.commands import export as export_command
from shardckpt.commands import import_dcp as import_dcp_command
from shardckpt.commands import import_deepspeed as import_deepspeed_command

MODULES = (export_command, import_dcp_command, import_deepspeed_command, diff_command, du_command)

__all__ = ["MODULES"]
