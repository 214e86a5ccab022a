"""`shardckpt du`: bytes used by each checkpoint under a root, and how many of them are reclaimable leftovers.

The command line over shardckpt.ops.du; see `shardckpt du --help`.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import Any

from rich.console import Console

from shardckpt.cli.common import human_bytes, new_command, plural, print_json, storage_options
from shardckpt.cli.tables import Cell, Column, print_table
from shardckpt.cli.text import line, styled

NAME = "du"


def register(subparsers: Any) -> None:
    command = new_command(
        subparsers,
        NAME,
        "disk usage per checkpoint: committed bytes and leftovers of failed attempts",
        "Show, for every checkpoint directly under ROOT (or for ROOT itself when it is a checkpoint), the bytes "
        "of its committed attempt (data files, manifests and COMMITTED; `ls` shows the data files alone, which "
        "--json gives here as data_bytes), the leftovers of failed attempts (files of other attempts; every file of a "
        "checkpoint that never committed) and files the format does not name, with totals. Reads only listings "
        "and sizes, never data.",
        "examples:\n  shardckpt du /ckpts\n  shardckpt du s3://bucket/run --json | jq .total.leftover_bytes",
    )
    command.add_argument("root", metavar="ROOT", help="directory or URL that holds checkpoints")


def run(args: argparse.Namespace, console: Console) -> int:
    from shardckpt.ops.du import disk_usage

    report = disk_usage(args.root, storage_options=storage_options(args.storage_option))
    fields = ("committed_bytes", "leftover_bytes", "leftover_files", "other_bytes", "total_bytes")
    totals = {name: report.total(name) for name in fields}
    if args.json:
        rows = [{**asdict(c), "total_bytes": c.total_bytes} for c in report.checkpoints]
        print_json({"root": report.root, "checkpoints": rows, "total": totals})
        return 0
    colors = {"committed": "green", "incomplete": "yellow", "broken": "red"}
    table_rows: list[list[Cell]] = [
        [
            c.name,
            styled(c.status, colors[c.status]),
            "-" if c.step is None else str(c.step),
            human_bytes(c.committed_bytes) if c.committed_bytes else "-",
            _leftovers(c.leftover_bytes, c.leftover_files),
            human_bytes(c.other_bytes) if c.other_bytes else "-",
            human_bytes(c.total_bytes),
        ]
        for c in report.checkpoints
    ]
    table_rows.append(
        [
            "total",
            plural(len(report.checkpoints), "checkpoint"),
            "",
            human_bytes(totals["committed_bytes"]),
            _leftovers(totals["leftover_bytes"], totals["leftover_files"]),
            human_bytes(totals["other_bytes"]),
            human_bytes(totals["total_bytes"]),
        ]
    )
    columns = [
        Column("checkpoint"),
        Column("status", drop=5),
        Column("step", right=True, drop=1),
        Column("committed", right=True, drop=4),
        Column("leftovers", right=True, drop=6),
        Column("other", right=True, drop=2),
        Column("total", right=True),
    ]
    incremental = any(c.referenced_bytes for c in report.checkpoints)
    if incremental:  # format 1.1: what each checkpoint reads from older ones (their bytes, counted there)
        referenced = [human_bytes(c.referenced_bytes) if c.referenced_bytes else "-" for c in report.checkpoints]
        for row, cell in zip(table_rows, [*referenced, ""]):
            row.insert(4, cell)
        columns.insert(4, Column("referenced", right=True, drop=3))
    if any(c.compressed_bytes for c in report.checkpoints):  # format 1.2: the data's size decompressed
        logical = [
            human_bytes(c.data_bytes + c.compressed_bytes) if c.compressed_bytes else "-" for c in report.checkpoints
        ]
        for row, cell in zip(table_rows, [*logical, ""]):
            row.insert(4, cell)
        columns.insert(4, Column("uncompressed", right=True, drop=3))
    columns, table_rows = _without_empty(columns, table_rows, optional=("leftovers", "other"))
    print_table(console, columns, table_rows, title=report.root)
    if incremental:
        console.print(
            line(
                "referenced: bytes a checkpoint stores by reference to older checkpoints' data files (counted once, "
                "under the checkpoint that holds them; deleting the referencing checkpoint frees none of them)"
            )
        )
    for c in report.checkpoints:
        if c.error:  # e.g. a walk cut at its bound: the sizes above leave something out (Text: no markup)
            console.print(styled(f"{c.name}: {c.error}", "yellow"))
    if totals["leftover_bytes"]:
        console.print(
            line(f"{human_bytes(totals['leftover_bytes'])} of leftovers can be reclaimed by a garbage collector")
        )
    return 0


def _without_empty(
    columns: list[Column], rows: list[list[Cell]], optional: tuple[str, ...]
) -> tuple[list[Column], list[list[Cell]]]:
    """Leave out the `optional` columns that say nothing (no row has a size in them), so that the names keep
    their width on an 80-column console; the JSON output keeps every field."""
    empty = {
        i
        for i, column in enumerate(columns)
        if column.header in optional and all(str(row[i]) in ("-", "0 B") for row in rows)
    }
    kept = [i for i in range(len(columns)) if i not in empty]
    return [columns[i] for i in kept], [[row[i] for i in kept] for row in rows]


def _leftovers(nbytes: int, files: int) -> str:
    return f"{human_bytes(nbytes)} ({plural(files, 'file')})" if files else "-"
