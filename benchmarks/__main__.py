"""`python -m benchmarks`: durable save and load throughput of shardckpt versus baselines on the same state.

Every figure is the median of several runs, reported with its ratio to the best baseline of the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

import shardckpt
from benchmarks.pagecache import drop_caches
from shardckpt.format.layout import new_attempt

GIB = 1 << 30


def make_state(total_bytes: int, tensors: int = 64) -> dict[str, torch.Tensor]:
    """`tensors` fp32 tensors of equal size, like the weights/exp_avg/exp_avg_sq of a model."""
    rows = max(1, total_bytes // tensors // 4 // 1024)
    generator = torch.Generator().manual_seed(0)
    return {f"t{i:03d}": torch.randn(rows, 1024, generator=generator) for i in range(tensors)}


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def timed(run: Callable[[], None], setup: Callable[[], None] | None, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        began = time.perf_counter()
        run()
        samples.append(time.perf_counter() - began)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", message=".*torch.distributed.*")  # DCP warns when used without a group
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mib", type=int, default=512, help="state size (default 512 MiB)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per row; the median is reported")
    parser.add_argument("--dir", help="scratch directory on the disk to measure (default: a temp dir)")
    parser.add_argument("--json", default="benchmarks/results.json", help="where to write the results")
    parser.add_argument("--warm", action="store_true", help="never drop the page cache (loads measured warm)")
    args = parser.parse_args(argv)
    scratch = tempfile.mkdtemp(prefix="shardckpt-bench-", dir=args.dir)
    state = make_state(args.size_mib << 20)
    size = nbytes(state)
    counter = iter(range(1 << 30))

    def fresh(name: str) -> str:
        return os.path.join(scratch, f"{name}-{next(counter)}")

    rows: dict[str, dict[str, object]] = {}

    def record(name: str, seconds: float, kind: str) -> None:
        rows[name] = {"seconds": seconds, "gib_per_s": size / seconds / GIB, "kind": kind}

    # ---- durable saves
    blob = b"".join(t.numpy().tobytes() for t in list(state.values())[:1]) * len(state)

    def raw_write() -> None:
        path = fresh("raw")
        with open(path, "wb") as handle:
            handle.write(blob)
            handle.flush()
            os.fsync(handle.fileno())

    record("raw write + fsync (1 stream)", timed(raw_write, None, args.repeats), "save")

    def torch_save() -> None:
        path = fresh("torch")
        torch.save(state, path)
        fsync_path(path)

    record("torch.save + fsync", timed(torch_save, None, args.repeats), "save")

    def st_save() -> None:
        path = fresh("st")
        save_file(state, path)
        fsync_path(path)

    record("safetensors save_file + fsync", timed(st_save, None, args.repeats), "save")

    def dcp_save() -> None:
        dcp.save(state, storage_writer=FileSystemWriter(fresh("dcp"), thread_count=2, sync_files=True))

    record("torch DCP save (thread_count=2, fsync)", timed(dcp_save, None, args.repeats), "save")
    record(
        "shardckpt.save (durable, committed)",
        timed(lambda: shardckpt.save(state, fresh("sc")), None, args.repeats),
        "save",
    )

    # ---- loads (cold when the page cache can be dropped)
    torch_path, st_path, sc_path = fresh("torch-load"), fresh("st-load"), fresh("sc-load")
    dcp_path = fresh("dcp-load")
    dcp.save(state, storage_writer=FileSystemWriter(dcp_path, thread_count=2, sync_files=True))
    torch.save(state, torch_path)
    save_file(state, st_path)
    shardckpt.save(state, sc_path)
    cold = not args.warm and drop_caches()
    setup = drop_caches if cold else None
    temperature = "cold" if cold else "warm"
    destination = {k: torch.empty_like(v) for k, v in state.items()}

    def st_load() -> None:
        loaded = load_file(st_path)
        for tensor in loaded.values():
            tensor.sum()  # touch every page of the lazily mapped file

    record(
        f"torch.load ({temperature})",
        timed(lambda: torch.load(torch_path, weights_only=True), setup, args.repeats),
        "load",
    )
    record(f"safetensors load_file + touch ({temperature})", timed(st_load, setup, args.repeats), "load")
    record(
        f"torch DCP load into preallocated ({temperature})",
        timed(lambda: dcp.load(destination, storage_reader=FileSystemReader(dcp_path)), setup, args.repeats),
        "load",
    )
    record(
        f"shardckpt.load into preallocated ({temperature})",
        timed(lambda: shardckpt.load(destination, sc_path), setup, args.repeats),
        "load",
    )

    # ---- resharded read: saved as 4 ranks, read as 3
    resharded = fresh("reshard")
    attempt = new_attempt()
    for rank in range(4):
        writer = shardckpt.ShardWriter(resharded, rank=rank, world_size=4, attempt=attempt)
        for name, tensor in state.items():
            lo, hi = rank * tensor.shape[0] // 4, (rank + 1) * tensor.shape[0] // 4
            writer.add(name, tensor[lo:hi], global_shape=tensor.shape, offsets=(lo, 0))
        writer.close()
    shardckpt.commit(resharded, world_size=4, attempt=attempt)
    fetched: list[int] = []

    def read_as_three() -> None:
        checkpoint = shardckpt.open(resharded)
        fetched.clear()
        for rank in range(3):
            items = []
            for name, tensor in state.items():
                lo, hi = rank * tensor.shape[0] // 3, (rank + 1) * tensor.shape[0] // 3
                box = shardckpt.Box((lo, 0), (hi - lo, tensor.shape[1]))
                items.append((name, box, torch.empty(box.shape)))
            stats = checkpoint.read_into(items)
            fetched.append(stats.fetched_bytes)

    record(f"shardckpt resharded load 4 -> 3 ranks ({temperature})", timed(read_as_three, setup, args.repeats), "load")
    read_ratio = sum(fetched) / size

    saves = {k: v for k, v in rows.items() if v["kind"] == "save"}
    loads = {k: v for k, v in rows.items() if v["kind"] == "load"}
    best_save = max(v["gib_per_s"] for k, v in saves.items() if not k.startswith("shardckpt"))
    best_load = max(v["gib_per_s"] for k, v in loads.items() if not k.startswith("shardckpt"))
    print(
        f"state: {len(state)} fp32 tensors, {size / GIB:.2f} GiB; {args.repeats} runs per row (median); "
        f"{platform.machine()}, {os.cpu_count()} cores; loads are {temperature}"
    )
    print(f"{'row':55} {'GiB/s':>7} {'ratio to best baseline':>24}")
    for name, row in rows.items():
        best = best_save if row["kind"] == "save" else best_load
        row["ratio_to_best_baseline"] = row["gib_per_s"] / best
        print(f"{name:55} {row['gib_per_s']:7.2f} {row['ratio_to_best_baseline']:24.2f}")
    print(f"resharded 4 -> 3: bytes read / bytes needed = {read_ratio:.3f}")
    result = {
        "state_bytes": size,
        "repeats": args.repeats,
        "loads": temperature,
        "machine": {
            "arch": platform.machine(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "rows": rows,
        "resharded_read_ratio": read_ratio,
    }
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
