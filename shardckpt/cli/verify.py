"""`shardckpt verify`: read everything and check every checksum and the coverage of a checkpoint.

Exit 0 when all is well, 1 naming each file and tensor that is not; a progress bar on a terminal.
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console
from rich.progress import Progress

from shardckpt.catalog.chain import require_exists
from shardckpt.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    human_bytes,
    new_command,
    print_json,
    storage_options,
    transfer_columns,
)
from shardckpt.cli.text import line
from shardckpt.errors import ShardckptError
from shardckpt.storage import Storage, open_storage

NAME = "verify"


def register(subparsers: Any) -> None:
    command = new_command(
        subparsers,
        NAME,
        "read everything and check every checksum and the coverage",
        "Check a checkpoint end to end: COMMITTED and the manifest checksum chain, exact coverage of every "
        "tensor, every safetensors header, and the CRC32C of every block of every data file. "
        "Exit 0 when all is well, 1 naming each file and tensor that is not.",
        "examples:\n  shardckpt verify /ckpts/step-00001000\n  shardckpt verify --json CKPT | jq .problems",
    )
    command.add_argument("url", help="checkpoint URL or path")


def run(args: argparse.Namespace, console: Console) -> int:
    from shardckpt.ops.verify import verify

    storage = open_storage(args.url, storage_options(args.storage_option))
    require_exists(storage)  # nothing there is an error (a typo), not a failed check
    show_progress = not args.json and not args.quiet and console.is_terminal
    if show_progress:
        with Progress(*transfer_columns(), console=console, transient=True) as bar:
            task = bar.add_task("verifying", total=_total_bytes(storage))
            report = verify(storage, progress=lambda n: bar.advance(task, n))
    else:
        report = verify(storage)
    if args.json:
        print_json(
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
    else:
        for problem in report.problems:
            console.print(line(("BAD", "red"), f" {problem}"), soft_wrap=True)
        if report.ok:
            console.print(
                line(
                    ("OK", "green"),
                    f" {report.url}: {report.tensors} tensors, {report.files} files, "
                    f"{human_bytes(report.bytes_checked)} in {report.blocks_checked} blocks verified",
                )
            )
        else:
            console.print(line(("FAILED", "red"), f" {report.url}: {len(report.problems)} problem(s)"))
    return EXIT_OK if report.ok else EXIT_FAILED


def _total_bytes(storage: Storage) -> int | None:
    from shardckpt.catalog.chain import read_commit_marker

    try:
        marker = read_commit_marker(storage)
    except ShardckptError:
        return None
    return marker.total_bytes if marker else None
