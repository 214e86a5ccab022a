"""`shardckpt import-deepspeed`: a DeepSpeed ZeRO-3 checkpoint (engine.save_checkpoint) as a committed shardckpt one.

The command line over shardckpt.interop.import_deepspeed; see `shardckpt import-deepspeed --help`.
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console

from shardckpt.cli.common import new_command, print_json, progress_bar, storage_options
from shardckpt.cli.text import print_report

NAME = "import-deepspeed"


def register(subparsers: Any) -> None:
    command = new_command(
        subparsers,
        NAME,
        "convert a DeepSpeed ZeRO-3 checkpoint into a shardckpt checkpoint",
        "Convert a checkpoint written by DeepSpeed's engine.save_checkpoint with ZeRO stage 3 (DIR/latest names "
        "a tag; DIR/<tag>/zero_pp_rank_<r>_mp_rank_00_{optim,model}_states.pt per data-parallel rank) into a new "
        "committed shardckpt checkpoint at URL; each DeepSpeed rank becomes one rank that writes its own flat "
        "slices of the fp32 master weights and Adam moments (padding dropped). DIR may be the save directory "
        "(its `latest` file, or --tag, picks the tag) or the tag directory itself. The pickles are read with a "
        "restricted unpickler that admits only the globals DeepSpeed writes (anything else is refused before it "
        "runs); tensor bytes are copied straight out of the files, never through torch.load, and DeepSpeed need "
        "not be installed. Names follow the bundled training loop: model.<fqn>, optim.state.<fqn>.<key>, the "
        "objects optim.param_groups, scheduler and deepspeed (counters, loss scaler), and client_state keys "
        "that are plain data (others are skipped and listed).",
        "examples:\n"
        "  shardckpt import-deepspeed /ckpts/ds /ckpts/shardckpt/step-00001000          # uses /ckpts/ds/latest\n"
        "  shardckpt import-deepspeed /ckpts/ds/global_step1000 /ckpts/shardckpt/step-00001000\n"
        "  shardckpt import-deepspeed /ckpts/ds s3://bucket/run/step-00000500 --tag global_step500 "
        "--storage-option endpoint_url=http://...\n"
        "  shardckpt import-deepspeed /ckpts/ds ./imported --json | jq .skipped\n"
        "  shardckpt verify /ckpts/shardckpt/step-00001000      # then check it end to end",
    )
    command.add_argument(
        "ds_dir", metavar="DIR", help="DeepSpeed save directory (holds `latest`) or tag directory, or fsspec URL"
    )
    command.add_argument("url", metavar="URL", help="where to write the new checkpoint (must not be committed)")
    command.add_argument("--tag", help="checkpoint tag (subdirectory of DIR) to import instead of `latest`")
    command.add_argument("--step", type=int, help="training step to record (default: DeepSpeed's global_steps)")


def run(args: argparse.Namespace, console: Console) -> int:
    from shardckpt.interop.import_deepspeed import import_deepspeed

    options = storage_options(args.storage_option)
    with progress_bar(console, "importing", not (args.json or args.quiet)) as progress:
        report = import_deepspeed(
            args.ds_dir,
            args.url,
            tag=args.tag,
            step=args.step,
            storage_options=options,
            source_options=options,
            progress=progress,
        )
    if args.json:
        print_json(report.summary())
        return 0
    print_report(console, report.lines())
    return 0
