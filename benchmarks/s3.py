"""`python -m benchmarks.s3`: shardckpt save and load throughput on S3 against raw s3fs put/get of the same bytes.

Starts its own SeaweedFS on 127.0.0.1 (or uses --endpoint), runs both in one process, reports medians and ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import s3fs
import torch

import shardckpt
from benchmarks import seaweed
from benchmarks.__main__ import GIB, machine, make_state, nbytes, timed

BUCKET = "shardckpt-bench"


@contextmanager
def server_options(endpoint: str | None) -> Iterator[dict[str, object]]:
    """storage_options for --endpoint, or for a SeaweedFS started (and stopped) here."""
    if endpoint:
        yield {"endpoint_url": endpoint, **seaweed.CREDENTIALS, "client_kwargs": {"region_name": "us-east-1"}}
        return
    with seaweed.running(BUCKET) as server:
        yield server.storage_options()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mib", type=int, default=256, help="state size (default 256 MiB)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per row; the median is reported")
    parser.add_argument("--endpoint", help="an S3 endpoint to use instead of starting SeaweedFS")
    parser.add_argument("--bucket", default=BUCKET, help=f"bucket (must exist with --endpoint; default {BUCKET})")
    parser.add_argument("--json", default="benchmarks/results-s3.json", help="where to write the results")
    args = parser.parse_args(argv)
    state = make_state(args.size_mib << 20)
    size = nbytes(state)
    blob = b"".join(tensor.numpy().tobytes() for tensor in state.values())  # the same bytes, as one object
    destination = {name: torch.empty_like(tensor) for name, tensor in state.items()}

    with server_options(args.endpoint) as options:
        fs = s3fs.S3FileSystem(**options)  # what an s3fs user would write
        run = f"{args.bucket}/run-{uuid.uuid4().hex[:8]}"
        counter = iter(range(1 << 30))

        def fresh() -> str:
            return f"{run}/{next(counter)}"

        raw_path, sc_path = fresh(), f"s3://{fresh()}"
        stats: dict[str, Callable[[], object]] = {
            "s3fs pipe_file (raw put)": lambda: fs.pipe_file(fresh(), blob),
            "shardckpt.save (committed)": lambda: shardckpt.save(state, f"s3://{fresh()}", storage_options=options),
            "s3fs cat_file (raw get)": lambda: _check(fs.cat_file(raw_path), size),
            "shardckpt.load into preallocated": lambda: shardckpt.load(destination, sc_path, storage_options=options),
        }
        fs.pipe_file(raw_path, blob)  # the objects the loads read, written once (this also warms both paths)
        shardckpt.save(state, sc_path, storage_options=options)
        samples: dict[str, list[float]] = {name: [] for name in stats}
        for _ in range(args.repeats):  # interleaved, so a noisy neighbour weighs on every row alike
            for name, operation in stats.items():
                samples[name].append(timed(operation, None, 1))
        fs.rm(run, recursive=True)
        rows: dict[str, dict[str, object]] = {}
        for name, seconds in samples.items():
            rows[name] = {"seconds": statistics.median(seconds), "gib_per_s": size / statistics.median(seconds) / GIB}

    save_ratio = _ratio(rows, "shardckpt.save (committed)", "s3fs pipe_file (raw put)")
    load_ratio = _ratio(rows, "shardckpt.load into preallocated", "s3fs cat_file (raw get)")
    where = args.endpoint or "SeaweedFS on 127.0.0.1 (same machine)"
    print(f"S3: {where}; {len(state)} fp32 tensors, {size / (1 << 20):.0f} MiB; median of {args.repeats} runs")
    print(f"| {'operation':34} | {'GiB/s':>6} | {'ratio to raw s3fs':>17} |")
    print(f"|{'-' * 36}|{'-' * 8}|{'-' * 19}|")
    for name, row in rows.items():
        ratio = {"shardckpt.save (committed)": save_ratio, "shardckpt.load into preallocated": load_ratio}.get(name)
        shown = f"{ratio:.2f}" if ratio is not None else "1.00 (baseline)"
        print(f"| {name:34} | {row['gib_per_s']:6.3f} | {shown:>17} |")
    result = {
        "state_bytes": size,
        "repeats": args.repeats,
        "endpoint": where,
        "machine": machine(),
        "rows": rows,
        "save_ratio_to_s3fs": save_ratio,
        "load_ratio_to_s3fs": load_ratio,
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    return 0


def _check(data: bytes, size: int) -> None:
    if len(data) != size:
        raise RuntimeError(f"raw get returned {len(data)} bytes, expected {size}")


def _ratio(rows: dict[str, dict[str, object]], ours: str, baseline: str) -> float:
    mine, theirs = rows[ours]["gib_per_s"], rows[baseline]["gib_per_s"]
    assert isinstance(mine, float) and isinstance(theirs, float)
    return mine / theirs


if __name__ == "__main__":
    raise SystemExit(main())
