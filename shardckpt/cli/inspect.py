"""`shardckpt inspect`: what a checkpoint holds (status, step, tensors, ranks, objects); reads manifests only.

Tables for people, one JSON object with --json; exit 1 when the checkpoint is not committed.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.table import Table

from shardckpt.cli.common import EXIT_FAILED, EXIT_OK, human_bytes, new_command, storage_options, when
from shardckpt.format import layout
from shardckpt.ops.inspect import inspect_checkpoint

NAME = "inspect"


def register(subparsers: Any) -> None:
    command = new_command(
        subparsers,
        NAME,
        "show a checkpoint's tensors, ranks, objects and status",
        "Show what a checkpoint holds: status, step, every tensor (dtype, shape, size, pieces, ranks), "
        "the data file of each rank and the plain objects. Reads only the manifests.",
        "examples:\n  shardckpt inspect /ckpts/step-00001000\n  shardckpt inspect s3://bucket/run/step-00001000 --json",
    )
    command.add_argument("url", help="checkpoint URL or path")


def run(args: argparse.Namespace, console: Console) -> int:
    summary = inspect_checkpoint(args.url, storage_options=storage_options(args.storage_option))
    if summary["status"] != "committed":
        return _show_incomplete(summary, args, console)
    tensors, ranks = summary["tensors"], summary["ranks"]
    if args.json:
        print(json.dumps(summary, default=str))
        return EXIT_OK
    console.print(f"[bold]{summary['url']}[/bold]  [green]committed[/green]")
    console.print(
        f"step {summary['step']}  ·  {summary['world_size']} ranks  ·  {len(tensors)} tensors  ·  "
        f"{human_bytes(summary['total_bytes'])}  ·  format {summary['format_version']}  ·  attempt "
        f"{summary['attempt']}  ·  {when(summary['created'])}"
    )
    table = Table(
        "tensor", "dtype", "shape", "size", "pieces", "ranks", "layout", title="tensors", title_justify="left"
    )
    for t in tensors:
        table.add_row(
            t["name"],
            t["dtype"],
            "[" + ", ".join(map(str, t["shape"])) + "]",
            human_bytes(t["bytes"]),
            str(t["pieces"]),
            str(len(t["pieces_per_rank"])),
            t["layout"],
        )
    console.print(table)
    rank_table = Table("rank", "data file", "size", "pieces", title="ranks", title_justify="left")
    for r in ranks:
        rank_table.add_row(str(r["rank"]), r["data"], human_bytes(r["bytes"]), str(r["pieces"]))
    console.print(rank_table)
    if summary["objects"]:
        object_table = Table("object", "rank", "value", title="objects", title_justify="left")
        for o in summary["objects"]:
            object_table.add_row(o["name"], "shared" if o["rank"] is None else str(o["rank"]), _preview(o["value"]))
        console.print(object_table)
    return EXIT_OK


def _preview(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _show_incomplete(summary: dict[str, Any], args: argparse.Namespace, console: Console) -> int:
    attempts, data_files = summary["attempts"], summary["data_files"]
    if args.json:
        print(json.dumps(summary))
    else:
        console.print(f"[bold]{summary['url']}[/bold]  [yellow]incomplete[/yellow] (no {layout.COMMITTED} marker)")
        if not attempts and not data_files:
            console.print("nothing here: not a checkpoint")
        for attempt, ranks in sorted(attempts.items()):
            console.print(f"attempt {attempt}: local manifests of ranks {sorted(ranks)}")
        console.print(f"{data_files} data files")
    return EXIT_FAILED
