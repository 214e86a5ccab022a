"""`python -m benchmarks.torchtitan_save`: a torchtitan synchronous save through shardckpt.integrations.torchtitan
against torchtitan's own (DCP's FileSystemWriter, fsynced), each followed by the collection torchtitan runs after it.

A training job's Python heap is what a collection walks: the state sits beside `--heap` small objects. The rows:
DCP + gc.collect(1) (torchtitan's own), shardckpt + the integration's collection (gc.collect(1), as torchtitan), and
shardckpt + a full gc.collect() (what the integration ran before issue 24), medians and ratios to DCP's of this run.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from benchmarks.__main__ import make_state, write_report
from shardckpt.integrations import torchtitan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--heap", type=int, default=1_500_000, help="small Python objects beside the state")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # DCP warns that it runs without a process group
    heap = [{"i": i, "s": str(i)} for i in range(args.heap)]
    state = make_state(args.size_mib << 20)

    def titan_dcp(path: str) -> None:
        dcp.save(state, storage_writer=FileSystemWriter(path, sync_files=True))
        gc.collect(1)

    def titan_shardckpt(path: str) -> None:
        torchtitan.save(state, path)
        torchtitan.collect_garbage()

    def full_collection(path: str) -> None:
        torchtitan.save(state, path)
        gc.collect()

    rows: dict[str, Callable[[str], None]] = {
        "dcp + gc.collect(1)": titan_dcp,
        "shardckpt + gc.collect(1)": titan_shardckpt,
        "shardckpt + gc.collect()": full_collection,
    }
    samples: dict[str, list[float]] = {name: [] for name in rows}
    root = tempfile.mkdtemp(prefix="titan-save-")
    try:
        for repeat in range(args.repeats):
            order = list(rows.items()) if repeat % 2 else list(reversed(rows.items()))  # take turns
            for number, (name, save) in enumerate(order):
                path = f"{root}/{repeat}-{number}/step-{repeat}"
                began = time.perf_counter()
                save(path)
                samples[name].append(time.perf_counter() - began)
                shutil.rmtree(f"{root}/{repeat}-{number}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    baseline = medians["dcp + gc.collect(1)"]
    print(f"torchtitan sync save, {args.size_mib} MiB, {args.heap} heap objects, median of {args.repeats}")
    for name, seconds in medians.items():
        print(f"  {name:28s} {seconds:7.3f} s   {seconds / baseline:5.2f}x DCP")
    write_report(args.json, {"size_mib": args.size_mib, "heap": len(heap), "median_seconds": medians})


if __name__ == "__main__":
    main()
