"""`shardckpt inspect`: what a checkpoint holds (status, step, tensors, ranks, objects); reads manifests only.

Tables for people, one JSON object with --json; exit 1 when the checkpoint is not committed.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from rich.console import Console

from shardckpt import knobs
from shardckpt.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    JSON_ENCODING_HELP,
    human_bytes,
    knob_text,
    new_command,
    parse_regex,
    plural,
    print_json,
    storage_options,
    to_json,
    when,
)
from shardckpt.cli.ls import local_node_text, ranks_text
from shardckpt.cli.tables import Cell, Column, print_table, tree_rows
from shardckpt.cli.text import line, styled
from shardckpt.format import layout
from shardckpt.ops.inspect import inspect_checkpoint

NAME = "inspect"


def register(subparsers: Any) -> None:
    command = new_command(
        subparsers,
        NAME,
        "show a checkpoint's tensors, ranks, objects and status",
        "Show what a checkpoint holds: status, step, every tensor (dtype, shape, size, pieces, ranks), "
        "the data file of each rank and the plain objects. Reads only the manifests. Tables fit the terminal, "
        "names always whole (a long name folds; less useful columns go first); a pipe gets one record per line. "
        "Control characters in names show escaped (\\x1b), as in --json; "
        "--tree groups names by their dotted prefixes, --filter keeps the names that match, --json gives "
        "everything whole. A node's copy of a local-tier save (Checkpointer(local_root=...)) also shows its job, "
        "which node it is, the ranks whose data files are here as the node's own and as replicas, and whether it is "
        'complete on this node alone (--json: "local"). ' + JSON_ENCODING_HELP,
        "examples:\n"
        "  shardckpt inspect /ckpts/step-00001000\n"
        "  shardckpt inspect /ckpts/step-00001000 --tree\n"
        "  shardckpt inspect /ckpts/step-00001000 --filter 'blocks\\.0\\.'\n"
        "  shardckpt inspect s3://bucket/run/step-00001000 --json | jq '.objects'",
    )
    command.add_argument("url", help="checkpoint URL or path")
    command.add_argument(
        "--filter",
        type=parse_regex,
        metavar="REGEX",
        help="only tensors and objects whose name matches (re.search)",
    )
    command.add_argument("--tree", action="store_true", help="group tensor names by their dotted prefixes")
    command.add_argument(
        "--all-objects",
        action="store_true",
        help="one row per object (by default objects named alike, e.g. one learning rate per parameter, "
        f"optimizer.param_groups.*.lr, share one row when at least {knob_text('INSPECT_GROUP_MIN')} do; --json lists "
        "all)",
    )


def run(args: argparse.Namespace, console: Console) -> int:
    summary = inspect_checkpoint(args.url, storage_options=storage_options(args.storage_option))
    if summary["status"] != "committed":
        return _show_incomplete(summary, args, console)
    if args.filter is not None:
        pattern = re.compile(args.filter)
        summary["tensors"] = [t for t in summary["tensors"] if pattern.search(t["name"])]
        summary["objects"] = [o for o in summary["objects"] if pattern.search(o["name"])]
    tensors, ranks = summary["tensors"], summary["ranks"]
    if args.json:
        for t in tensors:  # JSON object keys are strings
            t["pieces_per_rank"] = {str(rank): count for rank, count in t["pieces_per_rank"].items()}
        print_json(summary)
        return EXIT_OK
    console.print(line((summary["url"], "bold"), " ", ("committed", "green")))
    matching = f" matching {args.filter!r}" if args.filter is not None else ""
    console.print(
        line(
            f"step {summary['step']}, {plural(summary['world_size'], 'rank')}, "
            f"{plural(len(tensors), 'tensor')}{matching}, {human_bytes(summary['total_bytes'])}, "
            f"format {summary['format_version']}, attempt {summary['attempt']}, {when(summary['created'])}"
        )
    )
    if summary["compressed_files"]:  # format 1.2: stored vs logical bytes
        console.print(
            line(
                f"compressed: {human_bytes(summary['total_bytes'])} stored for {human_bytes(summary['logical_bytes'])} "
                f"({summary['compression_ratio']:.1%} of the raw size) in "
                f"{plural(summary['compressed_files'], 'data file')}"
            )
        )
    references = summary.get("references") or []
    if references:  # format 1.1: pieces stored by reference to older checkpoints' data files
        held = sum(r["bytes"] for r in references)
        sources = sorted({r["checkpoint"] for r in references})
        console.print(
            line(
                f"{human_bytes(held)} in {plural(sum(r['pieces'] for r in references), 'piece')} stored by reference "
                f"to {', '.join(sources)}"
            )
        )
    if "local" in summary:
        _print_local(console, summary["local"], summary["world_size"])
    missing = [parent["name"] for parent in summary.get("parents", ()) if not parent["present"]]
    if missing:
        console.print(
            styled(
                f"parent(s) {', '.join(missing)} missing from the root (or another attempt): this checkpoint cannot be "
                "loaded here; copy checkpoints with `shardckpt copy --with-parents` or `--materialize`",
                "red",
            )
        )
    columns = [
        Column("tensor"),
        Column("dtype", drop=5),
        Column("shape", drop=7),
        Column("size", right=True, drop=6),
        Column("pieces", right=True, drop=2),
        Column("ranks", right=True, drop=3),
        Column("layout", drop=1),
    ]
    if references:
        columns.append(Column("referenced", drop=4))

    def row(index: int) -> list[Cell]:
        t = tensors[index]
        shape = "[" + ", ".join(map(str, t["shape"])) + "]"
        cells: list[Cell] = [
            t["name"],
            t["dtype"],
            shape,
            human_bytes(t["bytes"]),
            str(t["pieces"]),
            str(len(t["pieces_per_rank"])),
            t["layout"],
        ]
        if references:
            cells.append(_referenced(t.get("referenced")))
        return cells

    def group(indices: list[int]) -> list[Cell]:
        size = human_bytes(sum(tensors[i]["bytes"] for i in indices))
        return [
            "",
            "",
            styled(plural(len(indices), "tensor"), "dim"),
            size,
            "",
            "",
            "",
            *([""] if references else []),
        ]

    names = [t["name"] for t in tensors]
    rows = tree_rows(names, row, group) if args.tree else [row(i) for i in range(len(tensors))]
    print_table(console, columns, rows, title="tensors")
    compressed = bool(summary["compressed_files"])
    rank_rows: list[list[Cell]] = [
        [r["data"], str(r["rank"]), human_bytes(r["bytes"]), str(r["pieces"])]
        + ([human_bytes(r["logical_bytes"]), f"{r['bytes'] / max(r['logical_bytes'], 1):.1%}"] if compressed else [])
        for r in ranks
    ]
    rank_columns = [Column("data file"), Column("rank", True), Column("size", True, 2), Column("pieces", True, 1)]
    if compressed:  # the stored size against what the file holds decompressed
        rank_columns += [Column("logical", True, 3), Column("stored", True, 4)]
    print_table(console, rank_columns, rank_rows, title="ranks")
    if summary["objects"]:
        object_rows = _object_rows(summary["objects"], 0 if args.all_objects else knobs.INSPECT_GROUP_MIN)
        object_columns = [Column("object"), Column("rank", drop=1), Column("value", crop=True)]
        print_table(console, object_columns, object_rows, title="objects")
    return EXIT_OK


def _object_rows(objects: list[dict[str, Any]], group_min: int) -> list[list[Cell]]:
    """One row per object, except that objects named alike (same first two and last dotted parts, e.g.
    optimizer.param_groups.<parameter>.lr) share one row `a.b.*.z` when at least `group_min` (> 0) of them do."""

    def pattern(o: dict[str, Any]) -> tuple[str, ...]:
        parts = o["name"].split(".")
        alike = group_min and len(parts) >= 4
        return (*parts[:2], "*", parts[-1], str(o["rank"])) if alike else (o["name"], str(o["rank"]))

    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for o in objects:
        groups.setdefault(pattern(o), []).append(o)
    rows: list[list[Cell]] = []
    shown: set[tuple[str, ...]] = set()
    for o in objects:
        key = pattern(o)
        members = groups[key]
        rank = "shared" if o["rank"] is None else str(o["rank"])
        if len(members) < max(group_min, 2):
            rows.append([o["name"], rank, _preview(o["value"])])
            continue
        if key in shown:
            continue
        shown.add(key)
        previews = {_preview(m["value"]) for m in members}
        value = (
            styled(f"{previews.pop()}  ({len(members)} objects)")
            if len(previews) == 1
            else styled(f"{len(members)} objects, {len(previews)} distinct values", "dim")
        )
        rows.append([".".join(key[:-1]), rank, value])
    return rows


def _referenced(referenced: dict[str, Any] | None) -> str:
    """A tensor's pieces stored by reference: how many of its bytes, from which checkpoints ("-": none)."""
    if not referenced or not referenced.get("pieces"):
        return "-"
    checkpoints = sorted({path.split("/", 1)[0] for path in referenced["from"]})
    return f"{human_bytes(referenced['bytes'])} in {', '.join(checkpoints)}"


def _preview(value: Any, limit: int = 60) -> str:
    """A value for a table cell: compact JSON, cut at `limit` (--json prints it whole)."""
    text = json.dumps(to_json(value), allow_nan=False, separators=(", ", ": "))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _show_incomplete(summary: dict[str, Any], args: argparse.Namespace, console: Console) -> int:
    attempts, data_files = summary["attempts"], summary["data_files"]
    if args.json:
        print_json(summary)
    else:
        console.print(
            line(
                (summary["url"], "bold"),
                " ",
                (f"incomplete (no {layout.COMMITTED} marker: a save failed or is still running)", "yellow"),
            )
        )
        for attempt, ranks in sorted(attempts.items()):
            console.print(line(f"attempt {attempt}: local manifests of ranks {sorted(ranks)}"))
        console.print(line(plural(data_files, "data file")))
    return EXIT_FAILED


def _print_local(console: Console, local: dict[str, Any], world_size: int) -> None:
    """A node's copy of a local-tier save: the job, which node, the ranks whose data files are here."""
    if "error" in local:
        console.print(styled(local["error"], "red"))
        return
    here = f"data files here: ranks {ranks_text(local['ranks_present'])} of {world_size}"
    whole = "complete on this node alone" if local["complete_here"] else "not complete here (the rest is on peers)"
    console.print(line("local tier copy of job ", (str(local["job"]), "bold"), f"; {here}, ", whole))
    console.print(line(local_node_text(local).replace("of the newest local save ", "")))
