"""`shardckpt diff`: which tensors and objects of two checkpoints differ, and by how much.

The command line over shardckpt.tools.diff; exit 0 when identical, 1 when not (like diff(1)).
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console
from rich.text import Text

from shardckpt.cli.common import add_memory_limit, new_command, print_json, progress_bar, storage_options
from shardckpt.cli.tables import Cell, Column, print_table
from shardckpt.cli.text import line, styled

NAME = "diff"


def register(subparsers: Any) -> None:
    command = new_command(
        subparsers,
        NAME,
        "compare two checkpoints tensor by tensor (exit 1 when they differ)",
        "Compare two committed checkpoints, streaming both under --memory-limit. For each tensor: equal (bit "
        "for bit), or the number of differing elements and the largest absolute difference; a changed shape or "
        "dtype; present in only one of them. Plain objects are compared by value. Exit 0 when nothing differs "
        "(tensors within --atol count as close), 1 when something differs, 3 when A or B cannot be read (e.g. a "
        "typo). World size and sharding do not matter.",
        "examples:\n"
        "  shardckpt diff /ckpts/step-00001000 /ckpts/step-00002000\n"
        "  shardckpt diff run-a/step-00000100 run-b/step-00000100 --atol 1e-6\n"
        "  shardckpt diff A B --json | jq '.tensors[] | select(.status != \"equal\")'",
    )
    command.add_argument("a", metavar="A", help="first checkpoint URL or path")
    command.add_argument("b", metavar="B", help="second checkpoint URL or path")
    command.add_argument("--atol", type=float, help="tensors whose largest absolute difference is <= ATOL are close")
    command.add_argument("--all", action="store_true", help="list equal tensors too")
    add_memory_limit(command)


def run(args: argparse.Namespace, console: Console) -> int:
    from shardckpt.tools.diff import diff

    with progress_bar(console, "comparing", not (args.json or args.quiet)) as progress:
        report = diff(
            args.a,
            args.b,
            atol=args.atol,
            memory_limit=args.memory_limit,
            storage_options=storage_options(args.storage_option),
            progress=progress,
        )
    code = 0 if report.identical else 1
    if args.json:
        summary = {
            "a": report.a,
            "b": report.b,
            "identical": report.identical,
            "step_a": report.step_a,
            "step_b": report.step_b,
            "tensors": [
                {
                    "name": t.name,
                    "status": t.status,
                    "dtype_a": t.dtype_a,
                    "dtype_b": t.dtype_b,
                    "shape_a": None if t.shape_a is None else list(t.shape_a),
                    "shape_b": None if t.shape_b is None else list(t.shape_b),
                    "mismatched": t.mismatched,
                    "max_abs_diff": t.max_abs_diff,
                }
                for t in report.tensors
            ],
            "objects": [
                {"name": o.name, "rank": o.rank, "status": o.status, "a": o.value_a, "b": o.value_b}
                for o in report.objects
            ],
        }
        print_json(summary)
        return code
    console.print(line(f"A: {report.a} (step {report.step_a})"))
    console.print(line(f"B: {report.b} (step {report.step_b})"))
    shown = [t for t in report.tensors if args.all or t.status != "equal"]
    if shown:
        columns = [
            Column("tensor"),
            Column("status"),
            Column("dtype", drop=2),
            Column("shape", drop=3),
            Column("differing", right=True, drop=1),
            Column("max |A-B|", right=True, drop=4),
        ]
        rows: list[list[Cell]] = [
            [
                t.name,
                _color(t.status),
                _pair(t.dtype_a, t.dtype_b),
                _pair(_shape(t.shape_a), _shape(t.shape_b)),
                str(t.mismatched) if t.mismatched else "-",
                "-" if t.max_abs_diff is None else f"{t.max_abs_diff:.6g}",
            ]
            for t in shown
        ]
        print_table(console, columns, rows, title="tensors")
    if report.objects:
        object_columns = [
            Column("object"),
            Column("rank", drop=1),
            Column("status"),
            Column("A", crop=True),
            Column("B", crop=True),
        ]
        object_rows: list[list[Cell]] = [
            [o.name, "shared" if o.rank is None else str(o.rank), o.status, _preview(o.value_a), _preview(o.value_b)]
            for o in report.objects
        ]
        print_table(console, object_columns, object_rows, title="objects")
    same = sum(1 for t in report.tensors if t.same)
    if report.identical:
        console.print(line(("identical", "green"), f": {same} tensors, objects equal"))
    else:
        console.print(
            line(
                ("different", "red"),
                f": {len(report.tensors) - same} of {len(report.tensors)} tensors, {len(report.objects)} objects",
            )
        )
    return code


def _color(status: str) -> Text:
    return styled(status, {"equal": "green", "close": "cyan", "different": "red"}.get(status, "yellow"))


def _pair(a: str | None, b: str | None) -> str:
    return (a or "-") if a == b else f"{a or '-'} -> {b or '-'}"


def _shape(shape: tuple[int, ...] | None) -> str | None:
    return None if shape is None else "[" + ", ".join(map(str, shape)) + "]"


def _preview(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
