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
from shardckpt.errors import ShardckptError
from shardckpt.format import layout
from shardckpt.storage import open_storage

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
    from shardckpt.read.checkpoint import read_commit_marker

    root = open_storage(args.root, storage_options(args.storage_option))
    rows = []
    for name in root.list():
        child = root.child(name)
        row: dict[str, Any] = {"name": name, "url": child.url}
        try:
            marker = read_commit_marker(child)
        except ShardckptError as exc:
            row.update(status="broken", error=str(exc))
            rows.append(row)
            continue
        if marker is not None:
            row.update(
                status="committed",
                step=marker.step,
                bytes=marker.total_bytes,
                created=marker.created,
                world_size=marker.world_size,
            )
        elif child.list(layout.RANKS_DIR) or child.list(layout.DATA_DIR):
            sizes = 0
            for data in child.list(layout.DATA_DIR):
                try:
                    sizes += child.size(f"{layout.DATA_DIR}/{data}")
                except ShardckptError:
                    continue
            row.update(status="incomplete", bytes=sizes)
        else:
            continue  # not a checkpoint
        rows.append(row)
    rows.sort(key=lambda r: (r.get("step") is None, r.get("step") or 0, r["name"]))
    if args.json:
        print(json.dumps({"root": root.url, "checkpoints": rows}))
        return EXIT_OK
    table = Table("checkpoint", "status", "step", "ranks", "size", "committed at", title=root.url, title_justify="left")
    colors = {"committed": "green", "incomplete": "yellow", "broken": "red"}
    for r in rows:
        table.add_row(
            r["name"],
            f"[{colors[r['status']]}]{r['status']}[/]",
            "-" if r.get("step") is None else str(r["step"]),
            str(r.get("world_size", "-")),
            human_bytes(r["bytes"]) if "bytes" in r else "-",
            when(r.get("created", 0.0)),
        )
    console.print(table)
    if not rows:
        console.print("no checkpoints")
    return EXIT_OK
