"""`python -m benchmarks.many`: per-tensor cost with many small tensors (a mixture-of-experts state), one process.

N tensors of 8x32 fp32 saved durably and loaded (warm) by shardckpt, safetensors (save_file + fsync / load_file)
and torch DCP, in the same process and taking turns; medians of a few runs, ratios, and time per tensor at N/8 and N
(and --scale) to show whether the cost is linear in the count.
"""

from __future__ import annotations

import argparse
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
from benchmarks.__main__ import fsync_path, machine, remove, write_report

SHAPE = (8, 32)
LIBRARIES = ("shardckpt", "safetensors", "dcp")


def make_state(count: int) -> dict[str, torch.Tensor]:
    """`count` 8x32 fp32 tensors named like a MoE model's per-expert weights (layer, expert, matrix)."""
    generator = torch.Generator().manual_seed(count)
    data = torch.randn(count, *SHAPE, generator=generator)
    return {f"layers.{i // 768}.mlp.experts.{i // 3 % 256}.w{i % 3 + 1}.weight": data[i].clone() for i in range(count)}


def measure(count: int, repeats: int, scratch: str, libraries: tuple[str, ...], check: bool) -> dict[str, object]:
    """Median save and load seconds of each library for `count` tensors; the libraries take turns each round."""
    state = make_state(count)
    destination = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
    counter = iter(range(1 << 30))

    def fresh(name: str) -> str:
        return os.path.join(scratch, f"{name}-{count}-{next(counter)}")

    def st_save(path: str) -> None:
        save_file(state, path)
        fsync_path(path)

    def st_load(path: str) -> None:
        loaded = load_file(path)
        for name, tensor in destination.items():
            tensor.copy_(loaded[name])  # into the model's tensors, as the others do

    def dcp_save(path: str) -> None:
        dcp.save(state, storage_writer=FileSystemWriter(path, thread_count=1, sync_files=True))

    def dcp_load(path: str) -> None:
        dcp.load(destination, storage_reader=FileSystemReader(path))

    def sc_load(path: str) -> None:
        shardckpt.load(destination, path)

    operations: dict[str, tuple[Callable[[str], object], Callable[[str], None]]] = {
        "shardckpt": (lambda path: shardckpt.save(state, path), sc_load),
        "safetensors": (st_save, st_load),
        "dcp": (dcp_save, dcp_load),
    }
    saves: dict[str, list[float]] = {name: [] for name in libraries}
    loads: dict[str, list[float]] = {name: [] for name in libraries}
    for repeat in range(repeats):
        order = list(libraries[repeat % len(libraries) :] + libraries[: repeat % len(libraries)])
        for name in order:
            save, load = operations[name]
            path = fresh(name)
            began = time.perf_counter()
            save(path)
            saves[name].append(time.perf_counter() - began)
            for tensor in destination.values():
                tensor.zero_()
            began = time.perf_counter()
            load(path)
            loads[name].append(time.perf_counter() - began)
            if check and any(not torch.equal(destination[key], value) for key, value in state.items()):
                raise AssertionError(f"{name}: the loaded tensors differ from the saved ones ({count} tensors)")
            remove(path)
    row: dict[str, object] = {"tensors": count, "repeats": repeats}
    for name in libraries:
        row[f"{name}_save_s"] = statistics.median(saves[name])
        row[f"{name}_load_s"] = statistics.median(loads[name])
    for kind in ("save", "load"):
        ours = float(row[f"shardckpt_{kind}_s"])  # type: ignore[arg-type]
        for name in libraries[1:]:
            row[f"{kind}_ratio_to_{name}"] = ours / float(row[f"{name}_{kind}_s"])  # type: ignore[arg-type]
        row[f"{kind}_us_per_tensor"] = ours / count * 1e6
    return row


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", message=".*torch.distributed.*")  # DCP warns when used without a group
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tensors", type=int, default=50_000, help="tensors of the main row (default 50,000)")
    parser.add_argument("--scale", type=int, nargs="*", default=[], help="further counts, shardckpt vs safetensors")
    parser.add_argument("--repeats", type=int, default=3, help="runs per row; the median is reported")
    parser.add_argument("--no-dcp", action="store_true", help="leave DCP out (it takes minutes at 50,000 tensors)")
    parser.add_argument("--check", action="store_true", help="fail unless every load returns the saved tensors")
    parser.add_argument("--dir", help="scratch directory on the disk to measure (default: a temp dir)")
    parser.add_argument("--json", default="benchmarks/many.json", help="where to write the results")
    args = parser.parse_args(argv)
    libraries = LIBRARIES[:2] if args.no_dcp else LIBRARIES
    scratch = tempfile.mkdtemp(prefix="shardckpt-many-", dir=args.dir)
    small = max(1, args.tensors // 8)
    rows = [measure(small, args.repeats, scratch, libraries, args.check)]
    rows.append(measure(args.tensors, args.repeats, scratch, libraries, args.check))
    for count in args.scale:  # DCP left out of scale rows: minutes per run, and the main row compares already
        rows.append(measure(count, args.repeats, scratch, LIBRARIES[:2], args.check))
    shutil.rmtree(scratch, ignore_errors=True)
    print(
        f"{SHAPE[0]}x{SHAPE[1]} fp32 tensors, one process, {args.repeats} runs per row (median), loads warm; "
        f"{platform.machine()}, {os.cpu_count()} cores"
    )
    header = f"{'tensors':>8} {'library':12} {'save s':>8} {'load s':>8}"
    print(f"{header} {'save us/tensor':>15} {'load us/tensor':>15}")
    for row in rows:
        for name in LIBRARIES:
            if f"{name}_save_s" not in row:
                continue
            save, load = float(row[f"{name}_save_s"]), float(row[f"{name}_load_s"])  # type: ignore[arg-type]
            count = int(row["tensors"])  # type: ignore[call-overload]
            print(f"{count:8d} {name:12} {save:8.3f} {load:8.3f} {save / count * 1e6:15.1f} {load / count * 1e6:15.1f}")
        ratios = ", ".join(
            f"{kind} / {name} = {float(row[f'{kind}_ratio_to_{name}']):.2f}"  # type: ignore[arg-type]
            for kind in ("save", "load")
            for name in LIBRARIES[1:]
            if f"{kind}_ratio_to_{name}" in row
        )
        print(f"{'':8} shardckpt: {ratios}")
    # Linearity: time per tensor at N against N/8; a quadratic pass shows as a growing ratio.
    growth = {
        kind: float(rows[1][f"{kind}_us_per_tensor"]) / float(rows[0][f"{kind}_us_per_tensor"])  # type: ignore[arg-type]
        for kind in ("save", "load")
    }
    print(
        f"time per tensor at {args.tensors} / at {small}: save {growth['save']:.2f}, load {growth['load']:.2f} "
        "(1.0 is linear)"
    )
    report = {
        "shape": list(SHAPE),
        "dtype": "float32",
        "repeats": args.repeats,
        "loads": "warm",
        "machine": machine(),
        "rows": rows,
        "per_tensor_growth": growth,
    }
    write_report(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
