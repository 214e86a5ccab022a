"""`shardckpt export`: a checkpoint's model weights as Hugging Face sharded safetensors, under a memory bound.

The command line over shardckpt.tools.export; see `shardckpt export --help`.
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console

from shardckpt.cli.common import (
    add_memory_limit,
    human_bytes,
    new_command,
    parse_regex,
    parse_size,
    print_json,
    progress_bar,
    storage_options,
)
from shardckpt.cli.tables import Cell, Column, print_table
from shardckpt.cli.text import line
from shardckpt.tools.hf_names import DEFAULT_INCLUDE, DTYPES, INDEX_FILE

NAME = "export"


def register(subparsers: Any) -> None:
    command = new_command(
        subparsers,
        NAME,
        "write model weights as Hugging Face safetensors shards + index",
        "Export the model weights of a committed checkpoint as consolidated, unsharded tensors in the layout "
        "Hugging Face tools read: model-0000k-of-0000n.safetensors files and model.safetensors.index.json in "
        "OUT (a new or empty directory). Tensors stream through in row-major chunks, so the tensor data in "
        "memory stays under --memory-limit whatever the size of the model. By default only names under "
        "'model.' are exported (no optimizer state); --include/--exclude choose others.",
        "examples:\n"
        "  shardckpt export /ckpts/step-00001000 ./hf --to hf-safetensors\n"
        "  shardckpt export s3://bucket/run/step-00001000 ./hf --dtype bf16 --strip-prefix model. \\\n"
        "      --max-shard-size 2GB --memory-limit 512MiB\n"
        "  shardckpt export CKPT ./hf --include '^model\\.' --exclude 'rotary|\\.inv_freq$'\n"
        "  shardckpt export torchtitan/checkpoint/step-1000 ./hf --heads 32 --dtype bf16   # llama, HF names\n"
        "\n"
        "Load the result with safetensors.torch.load_file on each shard, or transformers' from_pretrained\n"
        "(add the model's config.json to OUT). Sizes: 5GB = 5*10^9 bytes, 5GiB = 5*2^30 bytes.",
    )
    command.add_argument("url", metavar="URL", help="checkpoint URL or path")
    command.add_argument("out", metavar="OUT", help="output directory (new or empty; local path or URL)")
    command.add_argument(
        "--to", choices=["hf-safetensors"], default="hf-safetensors", help="output layout (default: %(default)s)"
    )
    command.add_argument(
        "--dtype", choices=sorted(DTYPES), help="convert floating-point tensors to this type (default: keep)"
    )
    command.add_argument(
        "--include",
        type=parse_regex,
        metavar="REGEX",
        help=f"export tensors whose name matches (re.search; default: {DEFAULT_INCLUDE})",
    )
    command.add_argument("--exclude", type=parse_regex, metavar="REGEX", help="skip tensors whose name matches")
    command.add_argument(
        "--strip-prefix", default="", metavar="PREFIX", help="remove PREFIX from exported names, e.g. 'model.'"
    )
    command.add_argument(
        "--max-shard-size", type=parse_size, default="5GB", metavar="SIZE", help="bytes per file (default: 5GB)"
    )
    command.add_argument(
        "--heads",
        type=int,
        metavar="N",
        help="a torchtitan llama checkpoint (found by its tok_embeddings/layers.N.attention keys) is exported under "
        "HF's LlamaForCausalLM names, wq/wk permuted per head as torchtitan's adapter does: its n_heads",
    )
    command.add_argument(
        "--kv-heads", type=int, metavar="N", help="with --heads: the model's n_kv_heads (default: from wk's shape)"
    )
    command.add_argument(
        "--force",
        action="store_true",
        help="replace a previous export in OUT: delete its index and the files the index names first (never "
        "other files, never a checkpoint)",
    )
    add_memory_limit(command)


def run(args: argparse.Namespace, console: Console) -> int:
    from shardckpt.tools.export import export_hf_safetensors

    with progress_bar(console, "exporting", not (args.json or args.quiet)) as progress:
        report = export_hf_safetensors(
            args.url,
            args.out,
            dtype=args.dtype,
            include=args.include,
            exclude=args.exclude,
            strip_prefix=args.strip_prefix,
            max_shard_size=args.max_shard_size,
            memory_limit=args.memory_limit,
            storage_options=storage_options(args.storage_option),
            out_options=storage_options(args.storage_option),
            progress=progress,
            force=args.force,
            heads=args.heads,
            kv_heads=args.kv_heads,
        )
    files: list[dict[str, Any]] = [
        {"file": shard.file, "tensors": len(shard.tensors), "bytes": shard.nbytes} for shard in report.shards
    ]
    if args.json:
        summary = {
            "url": report.url,
            "out": report.out,
            "index": INDEX_FILE,
            "files": files,
            "tensors": report.tensors,
            "total_size": report.total_size,
            "dtype": args.dtype,
            "seconds": round(report.seconds, 3),
        }
        print_json(summary)
        return 0
    rows: list[list[Cell]] = [[row["file"], str(row["tensors"]), human_bytes(row["bytes"])] for row in files]
    columns = [Column("file"), Column("tensors", right=True, drop=1), Column("size", right=True, drop=2)]
    print_table(console, columns, rows, title=report.out)
    console.print(
        line(
            ("exported", "green"),
            f" {report.tensors} tensors ({human_bytes(report.total_size)}) from {report.url} "
            f"in {report.seconds:.1f} s; index: {INDEX_FILE}",
        )
    )
    return 0
