"""`shardckpt copy`: copy a committed checkpoint to another place or storage (local, S3, ...), checked, committed last.

An incremental checkpoint needs its parents: --with-parents copies them along, --materialize writes a copy holding
every piece itself.
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console
from rich.progress import Progress

from shardckpt.cli.common import (
    EXIT_OK,
    human_bytes,
    new_command,
    parse_storage_option,
    print_json,
    storage_options,
    transfer_columns,
)
from shardckpt.cli.text import line
from shardckpt.errors import ShardckptUsageError

NAME = "copy"


def register(subparsers: Any) -> None:
    command = new_command(
        subparsers,
        NAME,
        "copy a checkpoint to another place or storage, checked, committed last",
        "Copy the committed checkpoint SRC to DST (DST ending in '/': into that directory, under SRC's name), from "
        "any storage to any other. Every file is read back and checked at DST (manifest checksums, safetensors "
        "headers, the CRC32C of every block) before COMMITTED is written, last: an interrupted copy is never "
        "committed, and running it again keeps the complete files and writes the rest. An incremental checkpoint "
        "stores pieces by reference in its parents (see `ls`): they must be committed in DST's root already, or "
        "pass --with-parents (copy them there too) or --materialize (a copy holding every piece itself; needs "
        "torch). Never overwrites anything.",
        "examples:\n"
        "  shardckpt copy /ckpts/step-00004000 /archive/                  # /archive/step-00004000\n"
        "  shardckpt copy /ckpts/step-00004000 s3://bucket/run/ --with-parents --storage-option "
        "endpoint_url=http://127.0.0.1:8333\n"
        "  shardckpt copy s3://bucket/run/step-00004000 ./final --materialize",
    )
    command.add_argument("source", metavar="SRC", help="the committed checkpoint to copy")
    command.add_argument("destination", metavar="DST", help="the new checkpoint's URL, or a directory ending in '/'")
    how = command.add_mutually_exclusive_group()
    how.add_argument(
        "--with-parents",
        action="store_true",
        help="also copy the checkpoints it stores pieces in by reference (into DST's root, under their names)",
    )
    how.add_argument(
        "--materialize",
        action="store_true",
        help="write a copy that holds every piece itself (reads and re-writes them; needs torch)",
    )
    command.add_argument(
        "--dst-storage-option",
        action="append",
        default=None,
        type=parse_storage_option,
        metavar="KEY=VALUE",
        help="fsspec storage option for DST only (default: those of --storage-option), e.g. another endpoint_url",
    )


def run(args: argparse.Namespace, console: Console) -> int:
    from shardckpt.ops.copy import copy_checkpoint, destination_url

    options = storage_options(args.storage_option)
    dst_options = options if args.dst_storage_option is None else storage_options(args.dst_storage_option)
    destination = destination_url(args.source, args.destination)
    if destination.rstrip("/") == args.source.rstrip("/"):
        raise ShardckptUsageError(f"copy {args.source} onto itself: give another destination")
    if args.materialize:
        from shardckpt.tools.materialize import materialize

        manifest = materialize(args.source, destination, storage_options=options, destination_options=dst_options)
        document = {
            "source": args.source,
            "destination": destination,
            "committed": [destination],
            "materialized": True,
            "bytes": manifest.total_bytes,
        }
        if args.json:
            print_json(document)
        else:
            console.print(
                line(
                    ("copied", "green"),
                    f" {args.source} -> {destination}: self-contained, "
                    f"{human_bytes(manifest.total_bytes)} of data written",
                ),
                soft_wrap=True,
            )
        return EXIT_OK
    show_progress = not args.json and not args.quiet and console.is_terminal
    with Progress(*transfer_columns(), console=console, transient=True, disable=not show_progress) as bar:
        task = bar.add_task("copying", total=None)
        report = copy_checkpoint(
            args.source,
            destination,
            with_parents=args.with_parents,
            storage_options=options,
            destination_options=dst_options,
            progress=(lambda n: bar.advance(task, n)) if show_progress else None,
        )
    if args.json:
        print_json(
            {
                "source": report.source,
                "destination": report.destination,
                "committed": report.committed,
                "already_there": report.already_there,
                "materialized": False,
                "files": report.files,
                "kept_files": report.kept_files,
                "bytes": report.bytes,
            }
        )
        return EXIT_OK
    for url in report.committed:
        console.print(line(("committed", "green"), f" {url}"), soft_wrap=True)
    for url in report.already_there:
        console.print(line(f"already there: {url}"), soft_wrap=True)
    console.print(
        f"copied {report.source} -> {report.destination}: {report.files} files, {human_bytes(report.bytes)}"
        + (f" ({report.kept_files} complete files of an earlier copy kept, checked)" if report.kept_files else ""),
        highlight=False,
        soft_wrap=True,
    )
    return EXIT_OK
