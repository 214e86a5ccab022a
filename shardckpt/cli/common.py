"""What the subcommands share: option parsing (sizes, regexes, KEY=VALUE), byte counts for people, progress bars,
strict JSON. Progress bars appear only on a terminal and never with --json, so pipes and scripts get clean output.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import json
import math
import os
import re
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from shardckpt import knobs
from shardckpt.errors import ShardckptUsageError

# The exit codes of every command (the --help epilog lists them): a failed check or a difference is an answer, an
# error is the absence of one, so a script can tell "diff says they differ" from "diff could not read B".
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_ERROR = 0, 1, 2, 3
EXIT_CODES_HELP = (
    "Exit codes: 0 ok; 1 a check failed, the checkpoint is incomplete or broken, or (diff) they differ; "
    "2 usage error (bad option or argument); 3 error (nothing there, e.g. a mistyped path or root, not a "
    "checkpoint, unreadable, refused). With --json an error is also JSON on stdout: "
    '{"error": {"type": ..., "message": ..., "exit_code": ...}}.'
)


def when(seconds: float) -> str:
    """A commit time for people (UTC), or "-" when unknown."""
    if not seconds:
        return "-"
    return dt.datetime.fromtimestamp(seconds, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def human_bytes(count: int) -> str:
    """A byte count in binary units (KiB = 1024 bytes), as every command and progress bar shows them."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{count} B"


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """ "1 rank", "2 ranks", "1 entry", "3 entries"."""
    return f"{count} {noun if count == 1 else nouns or noun + 's'}"


JSON_ENCODING_HELP = (
    '--json prints strict JSON (RFC 8259): tuples become arrays, bytes {"$bytes": BASE64}, NaN and infinities '
    '{"$float": "nan" | "inf" | "-inf"}, a map with a key that is not a string {"$map": [[KEY, VALUE], ...]}.'
)


def to_json(value: Any) -> Any:
    """`value` as strict JSON data, whole (JSON_ENCODING_HELP says how bytes, tuples, NaN and other keys look)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$float": "nan" if math.isnan(value) else f"{value:g}"}
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, dict):
        if all(isinstance(key, str) for key in value):
            return {key: to_json(item) for key, item in value.items()}
        return {"$map": [[to_json(key), to_json(item)] for key, item in value.items()]}
    if isinstance(value, (list, tuple)):
        return [to_json(item) for item in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return to_json(value.item())
    return str(value)  # nothing else reaches here from a manifest; a readable string beats a crash


def print_json(document: Any) -> None:
    """The one way a command prints --json: one line of strict JSON on stdout."""
    print(json.dumps(to_json(document), allow_nan=False))


def output_console() -> Console:
    """The console commands print to: the terminal's width ($COLUMNS first) on a terminal; for a pipe, plain text
    (no colour, tables one record per line, no line ever broken). Neither reads markup, emoji codes or highlights:
    what is printed is untrusted text (names, paths), styled only through Text objects (cli.text)."""
    if sys.stdout.isatty():
        return Console(markup=False, emoji=False, highlight=False)
    try:
        width = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        width = 80
    return Console(width=max(40, width), no_color=True, markup=False, emoji=False, highlight=False, soft_wrap=True)


def parse_size(text: str) -> int:
    """A byte count as people write it: 5GB (10^9), 512MiB (2^20), 1000 (bytes); for argparse `type=`."""
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 5GB, 512MiB, 1000000)")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size")
    return size


def parse_regex(text: str) -> str:
    """A valid regular expression, checked while parsing the command line; for argparse `type=`."""
    try:
        re.compile(text)
    except re.error as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a regular expression: {exc}") from None
    return text


def _option_pair(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--storage-option expects KEY=VALUE, got {text!r}")
    if value[:1] in "{[" or value in ("true", "false"):
        try:
            return key, json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--storage-option {key}: {value!r} is not valid JSON ({exc})") from None
    return key, value


def parse_storage_option(text: str) -> str:
    """A KEY=VALUE storage option (JSON values for objects, lists and booleans), checked while parsing the command
    line (argparse `type=`, so a malformed one exits 2 with the usage); the text is kept as written."""
    try:
        _option_pair(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def storage_options(pairs: Sequence[str]) -> dict[str, Any]:
    """--storage-option KEY=VALUE pairs as fsspec storage options (JSON values for objects and booleans)."""
    options: dict[str, Any] = {}
    for pair in pairs:
        try:
            key, value = _option_pair(pair)
        except ValueError as exc:
            raise ShardckptUsageError(str(exc)) from None
        options[key] = value
    return options


class HelpFormatter(argparse.HelpFormatter):
    """Wraps one-paragraph descriptions to the terminal; text with line breaks (the examples) keeps its lines, and
    a line too long for the terminal is broken (an example command with shell continuations)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line + "\n" for raw in text.splitlines() for line in fit_line(raw, width))
        return super()._fill_text(text, width, indent)


def fit_line(line: str, width: int) -> list[str]:
    """`line` as lines of at most `width` columns: an example command is continued with a backslash (its
    comment goes on the line above), prose is wrapped under its own indentation."""
    if len(line) <= width:
        return [line]
    lead = line[: len(line) - len(line.lstrip())]
    if line.lstrip().startswith("shardckpt "):
        command, _, comment = line.partition("  # ")
        above = fit_line(f"{lead}# {comment.strip()}", width) if comment else []
        pieces = textwrap.wrap(command.strip(), width - len(lead) - 6, break_on_hyphens=False, break_long_words=False)
        body = [f"{lead}{'    ' if i else ''}{piece}" for i, piece in enumerate(pieces)]
        return above + [f"{piece} \\" for piece in body[:-1]] + body[-1:]
    return textwrap.wrap(line, width, initial_indent=lead, subsequent_indent=lead) or [line]


def add_memory_limit(command: argparse.ArgumentParser) -> None:
    """The --memory-limit option of the streaming commands (export, diff)."""
    command.add_argument(
        "--memory-limit",
        type=parse_size,
        default="1GiB",
        metavar="SIZE",
        help="bound on tensor data in memory (default: 1GiB)",
    )


def new_command(subparsers: Any, name: str, help_text: str, description: str, epilog: str) -> argparse.ArgumentParser:
    """A subcommand with its description, examples in the epilog (kept as written), --storage-option and --json."""
    command: argparse.ArgumentParser = subparsers.add_parser(
        name,
        help=help_text,
        description=description,
        epilog=epilog,
        formatter_class=HelpFormatter,
    )
    command.add_argument(
        "--storage-option",
        action="append",
        default=[],
        type=parse_storage_option,
        metavar="KEY=VALUE",
        help="fsspec storage option, e.g. endpoint_url=http://127.0.0.1:8333 (repeatable)",
    )
    command.add_argument(
        "--json", action="store_true", help="print one strict JSON object for scripts (no progress bar)"
    )
    command.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    return command


class BinarySpeedColumn(ProgressColumn):
    """Transfer speed in binary units (MiB/s), so the bar and the result line count bytes alike."""

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text("?" if speed is None else f"{human_bytes(int(speed))}/s", style="progress.data.speed")


def description_column() -> TextColumn:
    """A bar's description (one of our own words), styled without markup: the console reads none."""
    return TextColumn("{task.description}", style="progress.description", markup=False)


def transfer_columns() -> tuple[Any, ...]:
    """The columns of every bytes progress bar: description, bar, done/total and rate (binary units)."""
    return (
        description_column(),
        BarColumn(),
        DownloadColumn(binary_units=True),
        BinarySpeedColumn(),
    )


@contextmanager
def progress_bar(console: Console, description: str, enabled: bool) -> Iterator[Callable[[int, int], None]]:
    """A `progress(nbytes, total)` callback that drives a bytes/rate bar on a terminal, or does nothing."""
    if not enabled or not console.is_terminal:
        yield lambda nbytes, total: None
        return
    with Progress(*transfer_columns(), TimeRemainingColumn(), console=console, transient=True) as bar:
        task = bar.add_task(description, total=None)
        yield lambda nbytes, total: bar.update(task, advance=nbytes, total=total)


def knob_text(name: str) -> str:
    """A knob's value for a help text, or its variable's name when its override is malformed: every command's parser
    is built for any command line, so one command's bad knob must not fail the others or --help (it fails the
    command that reads it, naming the variable)."""
    try:
        return f"{getattr(knobs, name):g}"
    except ShardckptUsageError:
        return f"SHARDCKPT_{name}, not valid now"
