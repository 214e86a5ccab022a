"""`shardckpt import-dcp`: a PyTorch DCP checkpoint (torch.distributed.checkpoint) as a committed shardckpt one.

The command line over shardckpt.interop.import_dcp; see `shardckpt import-dcp --help`.
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console

from shardckpt.cli.common import new_command, print_json, progress_bar, storage_options
from shardckpt.cli.text import print_report

NAME = "import-dcp"


def register(subparsers: Any) -> None:
    command = new_command(
        subparsers,
        NAME,
        "convert a PyTorch DCP checkpoint into a shardckpt checkpoint",
        "Convert a checkpoint written by torch.distributed.checkpoint.save (FileSystemWriter: a .metadata file "
        "and __<rank>_<n>.distcp files) into a new committed shardckpt checkpoint at URL; each .distcp file "
        "becomes one rank. The .metadata pickle is read with a restricted unpickler that admits only DCP's own "
        "metadata classes (anything else is refused before it runs); tensor bytes are copied straight out of "
        "the records, never through torch.load. Plain values (optimizer hyperparameters, counters) become "
        "objects; a value that is not plain data (a set, a class instance) fails the import before anything is "
        "written, naming it, unless --allow-skip leaves such values out (listed). Tensor names stay DCP's keys, so "
        "shardckpt.load({'model': ..., 'optim': ...}) restores what dcp.save({'model': ..., 'optim': ...}) saved.",
        "examples:\n"
        "  shardckpt import-dcp /ckpts/dcp/step-1000 /ckpts/shardckpt/step-00001000 --step 1000\n"
        "  shardckpt import-dcp ./dcp s3://bucket/run/step-00001000 --storage-option endpoint_url=http://...\n"
        "  shardckpt verify /ckpts/shardckpt/step-00001000      # then check it end to end",
    )
    command.add_argument(
        "dcp_dir", metavar="DCP_DIR", help="directory or fsspec URL of the DCP checkpoint (holds .metadata)"
    )
    command.add_argument("url", metavar="URL", help="where to write the new checkpoint (must not be committed)")
    command.add_argument("--step", type=int, help="training step to record in the new checkpoint")
    command.add_argument(
        "--allow-skip",
        action="store_true",
        help="import even when some values cannot be stored as plain values: leave them out and list them "
        "(without it such an import fails, exit 1, and writes nothing)",
    )


def run(args: argparse.Namespace, console: Console) -> int:
    from shardckpt.interop.import_dcp import import_dcp

    options = storage_options(args.storage_option)
    with progress_bar(console, "importing", not (args.json or args.quiet)) as progress:
        report = import_dcp(
            args.dcp_dir,
            args.url,
            step=args.step,
            storage_options=options,
            source_options=options,
            progress=progress,
            allow_skip=args.allow_skip,
        )
    if args.json:
        summary = {
            "source": report.source,
            "url": report.url,
            "world_size": report.world_size,
            "tensors": report.tensors,
            "objects": report.objects,
            "tensor_bytes": report.tensor_bytes,
            "skipped": [{"name": name, "reason": reason} for name, reason in report.skipped],
            "seconds": round(report.seconds, 3),
        }
        print_json(summary)
        return 0
    print_report(console, report.lines())
    return 0
