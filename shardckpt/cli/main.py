"""The `shardckpt` command: a registry of subcommands, each a module with NAME, register(subparsers), run(...).

Exit codes: common.EXIT_CODES_HELP (0 ok, 1 a check failed or they differ, 2 usage, 3 error). Command modules
import only argparse and torch-free code at the top; what a command needs to run loads when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import NoReturn

from rich.console import Console

from shardckpt.cli.common import (
    EXIT_CODES_HELP,
    EXIT_ERROR,
    EXIT_USAGE,
    HelpFormatter,
    output_console,
    print_json,
)
from shardckpt.cli.text import printable
from shardckpt.errors import ShardckptError, ShardckptUsageError

# In the order `shardckpt --help` lists them.
COMMAND_MODULES = (
    "ls",
    "inspect",
    "verify",
    "du",
    "gc",
    "copy",
    "diff",
    "export",
    "import_dcp",
    "import_deepspeed",
    "goodput",
)


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"shardckpt.cli.{name}")


def command_runner(name: str) -> Callable[[argparse.Namespace, Console], int]:
    """The run(args, console) of the subcommand called `name` on the command line (e.g. "import-dcp")."""
    return next(module.run for module in map(_module, COMMAND_MODULES) if name == module.NAME)  # type: ignore[no-any-return]


class _UsageError(Exception):
    """A command line argparse refuses: reported by main (as text, or as JSON with --json)."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error comes back to main instead of exiting, so that --json can report it as JSON."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(self, message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="shardckpt",
        description="Inspect, verify, compare, export and clean up shardckpt checkpoints (local paths, s3://, "
        "memory:// and other fsspec URLs). `shardckpt COMMAND --help` explains each command with examples.",
        epilog="examples:\n"
        "  shardckpt ls /ckpts                       # what is there, committed or not\n"
        "  shardckpt inspect /ckpts/step-00001000     # tensors, ranks, objects\n"
        "  shardckpt verify /ckpts/step-00001000      # read everything, check every checksum\n"
        "  shardckpt export /ckpts/step-00001000 ./hf --dtype bf16 --strip-prefix model.\n"
        "\n" + EXIT_CODES_HELP,
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--version", action=_PrintVersion, nargs=0, help="show the version and the checkpoint formats, then exit"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        _module(name).register(sub)
    sub.add_parser(
        "train",
        help="run the bundled ZeRO-3 training loop (FSDP2, or --engine deepspeed; torchrun for several ranks)",
        description="Same as python -m shardckpt.train; see `shardckpt train --help`.",
        add_help=False,
    )
    return parser


class _PrintVersion(argparse.Action):
    """argparse's own version action wraps the line to the terminal; scripts read it whole."""

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        print(_version())
        parser.exit()


def _version() -> str:
    """The package version and the newest checkpoint format this build writes and reads."""
    from shardckpt import __version__
    from shardckpt.format.strict import FORMAT_VERSION, NEWEST_VERSION

    newest, plain = "{}.{}".format(*NEWEST_VERSION), "{}.{}".format(*FORMAT_VERSION)
    return f"shardckpt {__version__} (checkpoint format {newest}: reads and writes {plain} to {newest})"


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["train"]:  # the training loop parses its own options, --help included
        from shardckpt.train.loop import main as train_main

        return train_main(arguments[1:])
    json_output = "--json" in arguments
    try:
        args = build_parser().parse_args(arguments)
    except ShardckptUsageError as exc:  # a malformed SHARDCKPT_* knob a command reads as its parser is built
        return _fail(type(exc).__name__, str(exc), EXIT_USAGE, json_output)
    except _UsageError as exc:
        exc.parser.print_usage(sys.stderr)
        print(f"{exc.parser.prog}: error: {printable(str(exc))}", file=sys.stderr)  # argparse's own words
        if json_output:
            print_json(
                {"error": {"type": "UsageError", "message": f"{exc.parser.prog}: {exc}", "exit_code": EXIT_USAGE}}
            )
        sys.exit(EXIT_USAGE)  # as argparse exits
    run = next(module.run for module in map(_module, COMMAND_MODULES) if args.command == module.NAME)
    console = output_console()
    try:
        return int(run(args, console))
    except ShardckptUsageError as exc:  # asked for something impossible (no tensor matches, limit too small)
        return _fail(type(exc).__name__, str(exc), EXIT_USAGE, args.json)
    except ShardckptError as exc:
        return _fail(type(exc).__name__, str(exc), EXIT_ERROR, args.json)
    except KeyboardInterrupt:
        print("shardckpt: interrupted", file=sys.stderr)
        return 130


def _fail(kind: str, message: str, code: int, json_output: bool) -> int:
    """Report an error: one line on stderr (controls escaped: messages quote untrusted names) and, with --json, the
    error as JSON on stdout, where a script reads the result; returns the exit code."""
    print(f"shardckpt: error: {printable(message)}", file=sys.stderr)
    if json_output:
        print_json({"error": {"type": kind, "message": message, "exit_code": code}})
    return code


if __name__ == "__main__":
    sys.exit(main())
