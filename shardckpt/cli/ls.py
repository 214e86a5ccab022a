"""`shardckpt ls`: the checkpoints under a root with their status, step, ranks, size and commit time.

Committed, incomplete (a save failed or is running) and broken checkpoints; --json for scripts.
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console
from rich.text import Text

from shardckpt.cli.common import EXIT_OK, human_bytes, new_command, print_json, storage_options, when
from shardckpt.cli.tables import Cell, fitted_table
from shardckpt.ops.ls import list_checkpoints

NAME = "ls"


def register(subparsers: Any) -> None:
    command = new_command(
        subparsers,
        NAME,
        "list the checkpoints under a root with their status",
        "List the checkpoints directly under ROOT: committed or incomplete, step, ranks, data (the bytes of the data "
        "files, from COMMITTED: `du` also counts manifests and leftovers), commit time, and the parents an "
        "incremental checkpoint stores pieces in (marked missing when ROOT lacks them: it cannot be loaded). A ROOT "
        "that does not exist is an error (exit 1); one without checkpoints says what it is instead.",
        "examples:\n  shardckpt ls /ckpts\n"
        "  shardckpt ls s3://bucket/run --storage-option endpoint_url=http://127.0.0.1:8333",
    )
    command.add_argument("root", help="directory or URL that holds checkpoints")


def run(args: argparse.Namespace, console: Console) -> int:
    listing = list_checkpoints(args.root, storage_options=storage_options(args.storage_option))
    rows = listing["checkpoints"]
    if args.json:
        print_json(listing)
        return EXIT_OK
    colors = {"committed": "green", "incomplete": "yellow", "broken": "red", "alias": "cyan"}
    table_rows: list[list[Cell]] = []
    for r in rows:
        status = Text(r["status"], style=colors[r["status"]])
        if "alias_of" in r:
            status.append(f" of {r['alias_of']}")
        table_rows.append(
            [
                r["name"],
                status,
                "-" if r.get("step") is None else str(r["step"]),
                str(r.get("world_size", "-")),
                human_bytes(r["bytes"]) if "bytes" in r else "-",
                when(r.get("created", 0.0)),
                _parents(r),
            ]
        )
    if rows:
        headers: tuple[str, ...] = ("checkpoint", "status", "step", "ranks", "data", "committed at", "parents")
        if not any("parents" in r for r in rows):  # a root of self-contained checkpoints: no column to show
            headers, table_rows = headers[:-1], [cells[:-1] for cells in table_rows]
        console.print(fitted_table(console, headers, table_rows, title=listing["root"], right=(2, 3, 4)))
    if "note" in listing:
        console.print(listing["note"], highlight=False)
    return EXIT_OK


def _parents(row: dict[str, Any]) -> Text:
    """The checkpoints an incremental one stores pieces in ('-' for a self-contained one); missing ones in red."""
    names = row.get("parents")
    if not names:
        return Text("-")
    missing = set(row.get("missing_parents", ()))
    cell = Text()
    for number, name in enumerate(names):
        if number:
            cell.append(", ")
        # "missing" first: the one word that must survive a narrow terminal.
        cell.append(f"missing {name}" if name in missing else name, style="red" if name in missing else "")
    return cell
