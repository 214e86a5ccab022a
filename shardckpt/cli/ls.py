"""`shardckpt ls`: the checkpoints under a root with their status, step, ranks, size and commit time.

Committed, incomplete (a save failed or is running) and broken checkpoints; --json for scripts.
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console
from rich.text import Text

from shardckpt.cli.common import EXIT_OK, human_bytes, new_command, print_json, storage_options, when
from shardckpt.cli.tables import Cell, Column, print_table
from shardckpt.cli.text import line, printable, styled
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
        "that does not exist is an error (exit 3, as for every command); one without checkpoints says what it is "
        "instead. ROOT may be a node's local tier (Checkpointer(local_root=...)): then a second table shows, for each "
        "local checkpoint, its job, whether it is complete on this node alone, the ranks whose data files are here "
        "as the node's own and as replicas kept for peers, and which node of the save this directory is (--json: "
        '"local_tier": true and a "local" object per checkpoint).',
        "examples:\n  shardckpt ls /ckpts\n  shardckpt ls /dev/shm/myjob      # a node's local tier\n"
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
        name: Cell = r["name"]
        if "alias_of" in r:  # as ls -l shows a link: the target beside the name, where it folds like one
            name = Text(printable(r["name"], name=True) + " -> " + printable(r["alias_of"], name=True))
        table_rows.append(
            [
                name,
                styled(r["status"], colors[r["status"]]),
                "-" if r.get("step") is None else str(r["step"]),
                str(r.get("world_size", "-")),
                human_bytes(r["bytes"]) if "bytes" in r else "-",
                when(r.get("created", 0.0)),
                _parents(r),
            ]
        )
    if rows:
        columns = [
            Column("checkpoint"),
            Column("status"),
            Column("step", right=True, drop=4),
            Column("ranks", right=True, drop=1),
            Column("data", right=True, drop=3),
            Column("committed at", drop=2),
            Column("parents", drop=5),
        ]
        if not any("parents" in r for r in rows):  # a root of self-contained checkpoints: no column to show
            columns, table_rows = columns[:-1], [cells[:-1] for cells in table_rows]
        print_table(console, columns, table_rows, title=listing["root"])
    if listing.get("local_tier"):
        _print_local_tier(console, [r for r in rows if "local" in r])
    if "note" in listing:
        console.print(line(listing["note"]))
    return EXIT_OK


def _print_local_tier(console: Console, rows: list[dict[str, Any]]) -> None:
    """A node's local tier: per local checkpoint its job, the ranks whose data files are here as the node's own and
    as replicas kept for peers, and whether the checkpoint is complete on this node alone."""
    console.print(line(local_node_text(rows[-1]["local"] if rows else {})))
    table_rows: list[list[Cell]] = []
    for r in rows:
        local = r["local"]
        if "error" in local:
            table_rows.append([r["name"], "", styled(local["error"], "red"), "", "", "", ""])
            continue
        complete = styled("yes", "green") if local["complete_here"] else styled("no", "yellow")
        own, replicas = local["own_ranks"], local["replica_ranks"]
        table_rows.append(
            [
                r["name"],
                styled(local["job"] if local["job"] is not None else "-"),
                complete,
                ranks_text(local["ranks_present"]),
                "?" if own is None else ranks_text(own),
                "?" if replicas is None else ranks_text(replicas),
                "?" if local["node"] is None else str(local["node"]),
            ]
        )
    columns = [
        Column("local checkpoint"),
        Column("job", drop=1),
        Column("complete here"),
        Column("ranks here", drop=4),
        Column("own", drop=3),
        Column("replicas", drop=2),
        Column("node", right=True, drop=5),
    ]
    print_table(console, columns, table_rows)


def local_node_text(local: dict[str, Any]) -> str:
    """Which node's local tier this is, from a local copy's description (ops.local_tier.describe_copy)."""
    if local.get("node") is None:
        return f"local tier of a node; which node is not known: {local.get('why_no_node', local.get('error'))}"
    how = "this directory is its recorded home" if local.get("node_from") == "recorded" else "by the files it keeps"
    return (
        f"local tier of node {local['node']} of the newest local save ({how}): own ranks "
        f"{ranks_text(local['own_ranks'])}, replicas of ranks {ranks_text(local['replica_ranks'])}"
    )


def ranks_text(ranks: list[int]) -> str:
    """Ranks as runs: [0, 1, 2, 5] -> '0-2, 5'; '-' for none."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs) or "-"


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
        shown = printable(name, name=True)
        cell.append(f"missing {shown}" if name in missing else shown, style="red" if name in missing else "")
    return cell
