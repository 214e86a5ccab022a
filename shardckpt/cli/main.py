"""The `shardckpt` command: inspect, verify, ls and gc checkpoints, with tables for people and --json for scripts.

Exit codes: 0 ok, 1 a check failed (or the checkpoint is broken or incomplete), 2 usage error.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn
from rich.table import Table

from shardckpt import commands
from shardckpt.cli.common import HelpFormatter, human_bytes, parse_storage_option, storage_options
from shardckpt.errors import ShardckptError, ShardckptUsageError
from shardckpt.format import layout
from shardckpt.ops.gc import DEFAULT_GRACE, Action, GcPlan, collect, plan_gc
from shardckpt.read.checkpoint import open_checkpoint, read_commit_marker
from shardckpt.storage import Storage, open_storage
from shardckpt.ops.verify import verify

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _when(seconds: float) -> str:
    if not seconds:
        return "-"
    return dt.datetime.fromtimestamp(seconds, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


# ------------------------------------------------------------------------------------------------ inspect


def cmd_inspect(args: argparse.Namespace, console: Console) -> int:
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
        f"  ·  {_when(manifest.created)}"
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


# ------------------------------------------------------------------------------------------------- verify


def cmd_verify(args: argparse.Namespace, console: Console) -> int:
    storage = open_storage(args.url, storage_options(args.storage_option))
    show_progress = not args.json and not args.quiet and console.is_terminal
    if show_progress:
        with Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            console=console,
            transient=True,
        ) as bar:
            task = bar.add_task("verifying", total=_total_bytes(storage))
            report = verify(storage, progress=lambda n: bar.advance(task, n))
    else:
        report = verify(storage)
    if args.json:
        print(
            json.dumps(
                {
                    "url": report.url,
                    "ok": report.ok,
                    "committed": report.committed,
                    "tensors": report.tensors,
                    "files": report.files,
                    "bytes_checked": report.bytes_checked,
                    "blocks_checked": report.blocks_checked,
                    "problems": [{"path": p.path, "tensor": p.tensor, "message": p.message} for p in report.problems],
                }
            )
        )
    else:
        for problem in report.problems:
            console.print(f"[red]BAD[/red] {problem}", soft_wrap=True, highlight=False)
        if report.ok:
            console.print(
                f"[green]OK[/green] {report.url}: {report.tensors} tensors, {report.files} files, "
                f"{human_bytes(report.bytes_checked)} in {report.blocks_checked} blocks verified",
                highlight=False,
            )
        else:
            console.print(f"[red]FAILED[/red] {report.url}: {len(report.problems)} problem(s)", highlight=False)
    return EXIT_OK if report.ok else EXIT_FAILED


def _total_bytes(storage: Storage) -> int | None:
    try:
        marker = read_commit_marker(storage)
    except ShardckptError:
        return None
    return marker.total_bytes if marker else None


# ----------------------------------------------------------------------------------------------------- ls


def cmd_ls(args: argparse.Namespace, console: Console) -> int:
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
            _when(r.get("created", 0.0)),
        )
    console.print(table)
    if not rows:
        console.print("no checkpoints")
    return EXIT_OK


# ----------------------------------------------------------------------------------------------------- gc


def cmd_gc(args: argparse.Namespace, console: Console) -> int:
    root = open_storage(args.root, storage_options(args.storage_option))
    plan = plan_gc(root, keep_last=args.keep_last, grace=args.grace)
    if not args.dry_run and not args.json and not args.quiet and console.is_terminal:
        with Progress("[progress.description]{task.description}", BarColumn(), console=console, transient=True) as bar:
            task = bar.add_task("collecting", total=plan.objects)
            collect(plan, lambda action, doomed: bar.advance(task))
    elif not args.dry_run:
        collect(plan, None if args.json or args.quiet else lambda action, doomed: _gc_progress(console, action))
    if args.json:
        print(json.dumps(_gc_summary(plan, args.dry_run)))
        return EXIT_OK if plan.ok else EXIT_FAILED
    verb = "would delete" if args.dry_run else "deleted"
    for action in plan.actions:
        status = f"[red]FAILED[/red] after {action.deleted} object(s): {action.error}" if action.error else verb
        status = f"{action.note}; did not delete" if action.note else status
        console.print(
            f"{action.checkpoint}: {status} {len(action.objects)} object(s), {human_bytes(action.bytes)} "
            f"({action.kind}: {action.reason})",
            highlight=False,
            soft_wrap=True,
        )
    for skipped in plan.skipped:
        console.print(f"{skipped.checkpoint}: kept ({skipped.reason})", highlight=False, soft_wrap=True)
    console.print(
        f"{verb} {plan.objects} object(s), {human_bytes(plan.bytes)}; {len(plan.kept)} committed checkpoint(s) kept",
        highlight=False,
    )
    return EXIT_OK if plan.ok else EXIT_FAILED


def _gc_progress(console: Console, action: Action) -> None:
    if action.deleted == len(action.objects):
        console.print(f"gc: {action.checkpoint}: deleted {action.deleted} object(s) ({action.kind})", highlight=False)


def _gc_summary(plan: GcPlan, dry_run: bool) -> dict[str, Any]:
    return {
        "root": plan.storage.url,
        "dry_run": dry_run,
        "ok": plan.ok,
        "keep_last": plan.keep_last,
        "grace": plan.grace,
        "objects": plan.objects,
        "bytes": plan.bytes,
        "actions": [
            {
                "checkpoint": a.checkpoint,
                "kind": a.kind,
                "reason": a.reason,
                "paths": [d.path for d in a.objects],
                "bytes": a.bytes,
                "deleted": a.deleted,
                "error": a.error,
                "note": a.note,
            }
            for a in plan.actions
        ],
        "skipped": [{"checkpoint": s.checkpoint, "reason": s.reason} for s in plan.skipped],
        "kept": plan.kept,
    }


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (the newest checkpoint is never deleted), got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


# --------------------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardckpt",
        description="Inspect, verify, compare, export and clean up shardckpt checkpoints (local paths, s3://, "
        "memory:// and other fsspec URLs). `shardckpt COMMAND --help` explains each command with examples.",
        epilog="examples:\n"
        "  shardckpt ls /ckpts                       # what is there, committed or not\n"
        "  shardckpt inspect /ckpts/step-00001000     # tensors, ranks, objects\n"
        "  shardckpt verify /ckpts/step-00001000      # read everything, check every checksum\n"
        "  shardckpt export /ckpts/step-00001000 ./hf --dtype bf16 --strip-prefix model.\n"
        "\n"
        "Exit codes: 0 ok, 1 check failed or checkpoint broken/incomplete (diff: they differ), 2 usage error.",
        formatter_class=HelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help_text: str, description: str, epilog: str = "") -> argparse.ArgumentParser:
        command = sub.add_parser(
            name, help=help_text, description=description, epilog=epilog or None, formatter_class=HelpFormatter
        )
        command.add_argument(
            "--storage-option",
            action="append",
            default=[],
            type=parse_storage_option,
            metavar="KEY=VALUE",
            help="fsspec storage option, e.g. endpoint_url=http://127.0.0.1:8333 (repeatable)",
        )
        command.add_argument("--json", action="store_true", help="print one JSON object for scripts")
        return command

    inspect = add(
        "inspect",
        "show a checkpoint's tensors, ranks, objects and status",
        "Show what a checkpoint holds: status, step, every tensor (dtype, shape, size, pieces, ranks), "
        "the data file of each rank and the plain objects. Reads only the manifests.",
        "examples:\n  shardckpt inspect /ckpts/step-00001000\n  shardckpt inspect s3://bucket/run/step-00001000 --json",
    )
    inspect.add_argument("url", help="checkpoint URL or path")
    check = add(
        "verify",
        "read everything and check every checksum and the coverage",
        "Check a checkpoint end to end: COMMITTED and the manifest checksum chain, exact coverage of every "
        "tensor, every safetensors header, and the CRC32C of every block of every data file. "
        "Exit 0 when all is well, 1 naming each file and tensor that is not.",
        "examples:\n  shardckpt verify /ckpts/step-00001000\n  shardckpt verify --json CKPT | jq .problems",
    )
    check.add_argument("url", help="checkpoint URL or path")
    check.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    listing = add(
        "ls",
        "list the checkpoints under a root with their status",
        "List the checkpoints directly under ROOT: committed or incomplete, step, ranks, size, commit time.",
        "examples:\n  shardckpt ls /ckpts\n  shardckpt ls s3://bucket/run --storage-option endpoint_url=http://127.0.0.1:8333",
    )
    listing.add_argument("root", help="directory or URL that holds checkpoints")
    collecting = add(
        "gc",
        "delete old checkpoints and leftovers of failed saves under a root",
        "Delete, under ROOT: committed checkpoints beyond the newest --keep-last (COMMITTED first, so a crash "
        "leaves nothing half-deleted that looks committed), checkpoints that were never committed, and files of "
        "failed attempts inside committed checkpoints. Never deletes the newest committed checkpoint, a file of a "
        "committed attempt, files the format does not name, anything modified within --grace seconds (a save may "
        "be writing it), or anything outside ROOT. Exit 0 when all went well, 1 if a deletion failed.",
        "examples:\n  shardckpt gc /ckpts --keep-last 3 --dry-run   # what would go\n"
        "  shardckpt gc /ckpts --keep-last 3",
    )
    collecting.add_argument("root", help="directory or URL that holds checkpoints")
    collecting.add_argument("--keep-last", type=_positive_int, help="committed checkpoints to keep (default: all)")
    collecting.add_argument(
        "--grace",
        type=_seconds,
        default=DEFAULT_GRACE,
        help=f"leave anything modified within this many seconds (default {DEFAULT_GRACE:g})",
    )
    collecting.add_argument("--dry-run", action="store_true", help="only print what would be deleted")
    collecting.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    for module in commands.MODULES:  # export, import-dcp, import-deepspeed, diff, du
        module.register(sub)
    train = sub.add_parser(
        "train",
        help="run the bundled ZeRO-3 training loop (FSDP2, or --engine deepspeed; torchrun for several ranks)",
        description="Same as python -m shardckpt.train; see `shardckpt train --help`.",
        add_help=False,
    )
    train.add_argument("args", nargs=argparse.REMAINDER, help="training loop arguments")
    return parser


COMMANDS: dict[str, Callable[[argparse.Namespace, Console], int]] = {
    "inspect": cmd_inspect,
    "verify": cmd_verify,
    "ls": cmd_ls,
    "gc": cmd_gc,
    **{module.NAME: module.run for module in commands.MODULES},
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "train":
        from shardckpt.train.loop import main as train_main

        return train_main(args.args)
    # Piped output keeps full tensor names instead of folding them to a guessed 80 columns.
    console = Console(width=None if sys.stdout.isatty() else 200)
    try:
        return COMMANDS[args.command](args, console)
    except ShardckptUsageError as exc:  # asked for something impossible (no tensor matches, limit too small)
        print(f"shardckpt: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ShardckptError as exc:
        print(f"shardckpt: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("shardckpt: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
