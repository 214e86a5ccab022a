"""`shardckpt inspect`: what a checkpoint holds (status, step, tensors, ranks, objects); reads manifests only.

Tables for people, one JSON object with --json; exit 1 when the checkpoint is not committed.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from typing import Any

from rich.console import Console
from rich.table import Table

from shardckpt.cli.common import EXIT_FAILED, EXIT_OK, human_bytes, new_command, storage_options, when
from shardckpt.errors import ShardckptError
from shardckpt.format import layout
from shardckpt.storage import Storage, open_storage

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
    from shardckpt.read.checkpoint import open_checkpoint, read_commit_marker

    storage = open_storage(args.url, storage_options(args.storage_option))
    if read_commit_marker(storage) is None:
        return _inspect_incomplete(storage, args, console)
    checkpoint = open_checkpoint(storage)
    manifest = checkpoint.manifest
    tensors: list[dict[str, Any]] = []
    for entry in manifest.tensors:
        files = entry.pieces.file
        tensors.append(
            {
                "name": entry.name,
                "dtype": entry.dtype,
                "shape": list(entry.shape),
                "layout": entry.layout,
                "bytes": entry.nbytes,
                "pieces": entry.pieces.count,
                "pieces_per_rank": dict(Counter(manifest.files[int(f)].rank for f in files.tolist())),
            }
        )
    ranks = [
        {
            "rank": f.rank,
            "data": f.data,
            "bytes": f.data_size,
            "pieces": sum(t["pieces_per_rank"].get(f.rank, 0) for t in tensors),
        }
        for f in manifest.files
    ]
    summary: dict[str, Any] = {
        "url": storage.url,
        "status": "committed",
        "format_version": f"{manifest.version[0]}.{manifest.version[1]}",
        "attempt": manifest.attempt,
        "step": manifest.step,
        "created": manifest.created,
        "world_size": manifest.world_size,
        "block_size": manifest.block_size,
        "total_bytes": manifest.total_bytes,
        "tensors": tensors,
        "ranks": ranks,
        "objects": [{"name": o.name, "rank": o.rank, "value": _preview(o.value)} for o in manifest.objects],
        "metadata": manifest.metadata,
    }
    if args.json:
        print(json.dumps(summary, default=str))
        return EXIT_OK
    console.print(f"[bold]{storage.url}[/bold]  [green]committed[/green]")
    console.print(
        f"step {manifest.step}  ·  {manifest.world_size} ranks  ·  {len(tensors)} tensors  ·  "
        f"{human_bytes(manifest.total_bytes)}  ·  format {summary['format_version']}  ·  attempt {manifest.attempt}"
        f"  ·  {when(manifest.created)}"
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
            object_table.add_row(o["name"], "shared" if o["rank"] is None else str(o["rank"]), o["value"])
        console.print(object_table)
    return EXIT_OK


def _preview(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _inspect_incomplete(storage: Storage, args: argparse.Namespace, console: Console) -> int:
    attempts: dict[str, list[int]] = {}
    for name in storage.list(layout.RANKS_DIR):
        try:
            rank, attempt = layout.parse_local_manifest_path(f"{layout.RANKS_DIR}/{name}")
        except ShardckptError:
            continue
        attempts.setdefault(attempt, []).append(rank)
    data_files = len(storage.list(layout.DATA_DIR))
    summary = {
        "url": storage.url,
        "status": "incomplete",
        "attempts": {a: sorted(r) for a, r in attempts.items()},
        "data_files": data_files,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        console.print(f"[bold]{storage.url}[/bold]  [yellow]incomplete[/yellow] (no {layout.COMMITTED} marker)")
        if not attempts and not data_files:
            console.print("nothing here: not a checkpoint")
        for attempt, ranks in sorted(attempts.items()):
            console.print(f"attempt {attempt}: local manifests of ranks {sorted(ranks)}")
        console.print(f"{data_files} data files")
    return EXIT_FAILED
