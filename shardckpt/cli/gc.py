"""`shardckpt gc`: delete old committed checkpoints and leftovers of failed saves under a root (SPEC.md 14).

Never the newest committed checkpoint, a file of a committed attempt, names the format does not give, an uncommitted
checkpoint or leftover within the grace period, or anything outside ROOT; --dry-run shows what would go.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, Progress

from shardckpt import knobs
from shardckpt.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    description_column,
    human_bytes,
    knob_text,
    new_command,
    print_json,
    storage_options,
)
from shardckpt.cli.text import line
from shardckpt.storage import open_storage

if TYPE_CHECKING:
    from shardckpt.ops.gc import Action, GcPlan

NAME = "gc"


def register(subparsers: Any) -> None:
    command = new_command(
        subparsers,
        NAME,
        "delete old checkpoints and leftovers of failed saves under a root",
        "Delete, under ROOT: committed checkpoints beyond the newest --keep-last (COMMITTED first, so a crash "
        "leaves nothing half-deleted that looks committed), checkpoints that were never committed, and files of "
        "failed attempts inside committed checkpoints. Never deletes the newest committed checkpoint, a file of a "
        "committed attempt, files the format does not name, or anything outside ROOT. The grace period protects "
        "what a running save may still be writing: an uncommitted checkpoint or a leftover modified within "
        "--grace seconds stays. Under a root of full checkpoints, --keep-last N deletes every committed "
        "checkpoint older than the newest N, however recent. Under a root of incremental checkpoints (format "
        "1.1) it also keeps what the kept ones reference, and a checkpoint whose next newer one was committed "
        "within --grace seconds (a save that started then may have chosen it as its parent): gc names each "
        "checkpoint it kept back and why. Exit 0 when all went well, 1 if a deletion failed.",
        "examples:\n  shardckpt gc /ckpts --keep-last 3 --dry-run   # what would go\n"
        "  shardckpt gc /ckpts --keep-last 3",
    )
    command.add_argument("root", help="directory or URL that holds checkpoints")
    command.add_argument("--keep-last", type=_positive_int, help="committed checkpoints to keep (default: all)")
    command.add_argument(
        "--grace",
        type=_seconds,
        help="keep uncommitted checkpoints and leftovers modified within this many seconds (default "
        f"{knob_text('GC_GRACE')}), and, under incremental checkpoints, the parent a save starting now may choose",
    )
    command.add_argument("--dry-run", action="store_true", help="only print what would be deleted")


def run(args: argparse.Namespace, console: Console) -> int:
    from shardckpt.ops.gc import collect, plan_gc

    root = open_storage(args.root, storage_options(args.storage_option))
    grace = knobs.GC_GRACE if args.grace is None else args.grace  # a malformed SHARDCKPT_GC_GRACE fails here
    plan = plan_gc(root, keep_last=args.keep_last, grace=grace)
    if not args.dry_run and not args.json and not args.quiet and console.is_terminal:
        with Progress(description_column(), BarColumn(), console=console, transient=True) as bar:
            task = bar.add_task("collecting", total=plan.objects)
            collect(plan, lambda action, doomed: bar.advance(task))
    elif not args.dry_run:
        collect(plan, None if args.json or args.quiet else lambda action, doomed: _gc_progress(console, action))
    if args.json:
        print_json(_gc_summary(plan, args.dry_run))
        return EXIT_OK if plan.ok else EXIT_FAILED
    verb = "would delete" if args.dry_run else "deleted"
    for action in plan.actions:
        status = line(verb)
        if action.error:
            status = line(("FAILED", "red"), f" after {action.deleted} object(s): {action.error}")
        if action.note:
            status = line(f"{action.note}; did not delete")
        console.print(
            line(
                f"{action.checkpoint}: ",
                status,
                f" {len(action.objects)} {_things(action)}, {human_bytes(action.bytes)}",
                f" ({action.kind}: {action.reason})",
            ),
            soft_wrap=True,
        )
    for skipped in plan.skipped:
        console.print(line(f"{skipped.checkpoint}: kept ({skipped.reason})"), soft_wrap=True)
    console.print(
        line(
            f"{verb} {plan.objects} object(s), {human_bytes(plan.bytes)}; {len(plan.kept)} committed checkpoint(s) kept"
        )
    )
    return EXIT_OK if plan.ok else EXIT_FAILED


def _gc_progress(console: Console, action: Action) -> None:
    if action.deleted == len(action.objects):
        done = "aborted" if action.kind == "uploads" else "deleted"
        console.print(line(f"gc: {action.checkpoint}: {done} {action.deleted} {_things(action)} ({action.kind})"))


def _things(action: Action) -> str:
    return "unfinished upload(s)" if action.kind == "uploads" else "object(s)"


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
