"""`shardckpt ls`: the checkpoints under a root with their status, step, ranks, size and commit time.

Committed, incomplete (a save failed or is running) and broken checkpoints; --json for scripts.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.table import Table

from shardckpt.cli.common import EXIT_OK, human_bytes, new_command, storage_options, when
from shardckpt.ops.ls import list_checkpoints

NAME = "ls"


def register(subparsers: Any) -> None:
    command = new_command(
        subparsers,
        NAME,
        "list the checkpoints under a root with their status",
        "List the checkpoints directly under ROOT: committed or incomplete, step, ranks, size, commit time.",
        "examples:\n  shardckpt ls /ckpts\n"
        "  shardckpt ls s3://bucket/run --storage-option endpoint_url=http://127.0.0.1:8333",
    )
    command.add_argument("root", help="directory or URL that holds checkpoints")


def run(args: argparse.Namespace, console: Console) -> int:
    listing = list_checkpoints(args.root, storage_options=storage_options(args.storage_option))
    rows = listing["checkpoints"]
    if args.json:
        print(json.dumps(listing))
        return EXIT_OK
    table = Table(
        "checkpoint", "status", "step", "ranks", "size", "committed at", title=listing["root"], title_justify="left"
    )
    colors = {"committed": "green", "incomplete": "yellow", "broken": "red", "alias": "cyan"}
    for r in rows:
        table.add_row(
            r["name"],
            f"[{colors[r['status']]}]{r['status']}[/]" + (f" of {r['alias_of']}" if "alias_of" in r else ""),
            "-" if r.get("step") is None else str(r["step"]),
            str(r.get("world_size", "-")),
            human_bytes(r["bytes"]) if "bytes" in r else "-",
            when(r.get("created", 0.0)),
        )
    console.print(table)
    if not rows:
        console.print("no checkpoints")
    return EXIT_OK
