"""`python -m benchmarks.ds_engine`: a DeepSpeed ZeRO-3 engine (the bundled GPT) saved and loaded through shardckpt
and through DeepSpeed's own save_checkpoint / load_checkpoint, and resharded 2 -> 3 ranks vs ds_to_universal.

Same engine state for both in one run; medians of --repeats; loads warm, and cold when the page cache can be dropped.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.__main__ import write_report
from benchmarks.distributed import values
from tests.helpers.launch import run_ranks

WORKER = Path(__file__).resolve().parent / "ds_worker.py"
EXTENSIONS = str(Path(sys.prefix) / "torch_extensions")  # DeepSpeed's JIT-built comm extension, built once


def state_bytes(d_model: int, layers: int, vocab: int, seq_len: int = 32) -> int:
    """fp32 weights + exp_avg + exp_avg_sq of the bundled GPT at this size."""
    block = 12 * d_model * d_model + 13 * d_model  # qkv, proj, up, down with biases, two LayerNorms
    params = layers * block + 2 * vocab * d_model + seq_len * d_model + 2 * d_model
    return 3 * 4 * params


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warm", action="store_true", help="never drop the page cache (warm loads only)")
    parser.add_argument("--dir", help="scratch directory on the disk to measure")
    parser.add_argument("--json", default="benchmarks/ds_engine.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", EXTENSIONS)
    size = state_bytes(args.d_model, args.layers, args.vocab)
    scratch = tempfile.mkdtemp(prefix="shardckpt-ds-bench-", dir=args.dir)
    try:
        common = {
            "dir": scratch,
            "d_model": args.d_model,
            "layers": args.layers,
            "vocab": args.vocab,
            "repeats": args.repeats,
            "cold": not args.warm,
        }
        saved = values(run_ranks("save", 2, common, timeout=1800, worker=WORKER))[0]
        began = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal"]
            + ["--input_folder", os.path.join(scratch, "native", "global_step0")]
            + ["--output_folder", os.path.join(scratch, "universal", "global_step0")],
            check=True,
            capture_output=True,
        )
        convert = time.perf_counter() - began
        resharded = values(run_ranks("reshard", 3, common, timeout=1800, worker=WORKER))[0]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report = {"state_bytes": size, "save_world": 2, "load_world": 3, "same_world": saved, "resharded": resharded}
    report["ds_to_universal_seconds"] = convert
    print_table(report)
    write_report(args.json, report)
    return 0


def print_table(report: dict) -> None:
    gib = report["state_bytes"] / (1 << 30)
    rate = lambda seconds: f"{gib / seconds:.2f} GiB/s ({seconds:.2f} s)"  # noqa: E731
    same, other = report["same_world"], report["resharded"]
    convert = report["ds_to_universal_seconds"]
    print(f"DeepSpeed ZeRO-3 engine, {report['state_bytes'] / 2**20:.0f} MiB of fp32 weights + Adam moments")
    print("(shardckpt's save is fsynced and committed; DeepSpeed's save_checkpoint does not fsync its files)")
    print(f"{'row':<44} {'shardckpt':>22} {'DeepSpeed':>22} {'ratio':>7}")
    rows = [("durable save, 2 ranks", same["save"]["shardckpt"], same["save"]["deepspeed"])]
    for temperature in ("warm", "cold"):
        if f"load_{temperature}" in same:
            times = same[f"load_{temperature}"]
            rows.append((f"load 2 -> 2, {temperature}", times["shardckpt"], times["deepspeed"]))
        if f"load_{temperature}" in other:
            times = other[f"load_{temperature}"]
            rows.append(
                (f"load 2 -> 3, {temperature} (+ds_to_universal)", times["shardckpt"], times["universal"] + convert)
            )
    for name, ours, theirs in rows:
        print(f"{name:<44} {rate(ours):>22} {rate(theirs):>22} {theirs / ours:>6.2f}x")
    print(f"ds_to_universal conversion alone: {convert:.2f} s (counted in the 2 -> 3 DeepSpeed column)")


if __name__ == "__main__":
    raise SystemExit(main())
