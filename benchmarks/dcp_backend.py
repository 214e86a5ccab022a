"""`python -m benchmarks.dcp_backend`: dcp.save / dcp.load through shardckpt.dcp against DCP's FileSystemWriter/Reader
on the reference state (4 gloo ranks, Shard(0)), loads 4 -> 4 and 4 -> 3 resharded, cold; medians, bytes read.

The same file is the rank worker (`python benchmarks/dcp_backend.py SCENARIO ARGS_JSON`, launched by run_ranks).
"""

from __future__ import annotations

import functools
import os
import shutil
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a rank's script
import shardckpt.dcp
from benchmarks.__main__ import write_report
from benchmarks.dist_worker import make_state, read_bytes, run_scenario, timed_collective, timed_saves
from benchmarks.distributed import sharded_job, values
from benchmarks.pagecache import drop_caches
from tests.helpers.launch import run_ranks

WORKER = Path(__file__).resolve()
GIB = 1 << 30
LIBRARIES = ("shardckpt", "dcp")


def _save(name: str, state: dict, path: str) -> None:
    """One dcp.save of `state`: through shardckpt's writer or through DCP's own (fsynced, as shardckpt's is)."""
    if name == "shardckpt":
        dcp.save(state, storage_writer=shardckpt.dcp.StorageWriter(path))
    else:
        dcp.save(state, storage_writer=FileSystemWriter(path, thread_count=2, sync_files=True))


def _load(name: str, state: dict, path: str) -> None:
    reader = shardckpt.dcp.StorageReader(path) if name == "shardckpt" else FileSystemReader(path)
    dcp.load(state, storage_reader=reader)


def scenario_save(args: dict, rank: int, world: int) -> dict:
    """Each backend's dcp.save `repeats` times, taking turns (outputs but the last deleted); then, when asked, the
    same-layout load in this same job (no second launch for 4 -> 4)."""
    state = make_state(args, world, rank, fill=True)
    times = timed_saves(state, args, rank, {name: functools.partial(_save, name, state) for name in LIBRARIES})
    result = {f"save_{name}": seconds for name, seconds in times.items()}
    if args.get("load_here"):
        del state
        result["load"] = scenario_load(args, rank, world)
    return result


def _fingerprint(state: dict) -> list[float]:
    """Per tensor, the float64 sum of this rank's shard: both backends must load the same numbers."""
    return [float(tensor.to_local().double().sum()) for tensor in state.values()]


def scenario_load(args: dict, rank: int, world: int) -> dict:
    """Each backend's dcp.load into zeroed, preallocated shards, `repeats` times alternating, cold then warm (or
    warm only); medians, bytes this rank read per temperature, and whether both backends loaded the same values."""
    state = make_state(args, world, rank, fill=False)
    result: dict = {"needed": sum(t.to_local().numel() * 4 for t in state.values()), "cold_possible": False}
    fingerprints: dict[str, list[float]] = {}
    for temperature in ("warm",) if args["warm"] else ("cold", "warm"):
        samples: dict[str, list[float]] = {name: [] for name in LIBRARIES}
        for repeat in range(args["repeats"]):
            for name in sorted(LIBRARIES, reverse=repeat % 2 == 1):
                for tensor in state.values():
                    tensor.to_local().zero_()  # a load that skipped a tensor cannot pass the comparison
                if temperature == "cold":
                    if rank == 0:
                        result["cold_possible"] = drop_caches()
                    dist.barrier()
                before = read_bytes()
                samples[name].append(timed_collective(lambda: _load(name, state, args[name])))  # noqa: B023
                result[f"{name}_{temperature}_read"] = read_bytes() - before
                fingerprints[name] = _fingerprint(state)
        for name, times in samples.items():
            result[f"{name}_{temperature}"] = statistics.median(times)
    result["agree"] = fingerprints["shardckpt"] == fingerprints["dcp"]
    return result


def _rows(loads: list[dict], save_world: int, world: int, size: int) -> list[dict]:
    """The report's rows of one load world: seconds, GiB/s, DCP's time over ours, bytes read per byte needed."""
    if not all(rank["agree"] for rank in loads):
        raise SystemExit(f"load {save_world} -> {world}: shardckpt's reader and DCP's loaded different values")
    needed = sum(rank["needed"] for rank in loads)
    rows = []
    for temperature in ("cold", "warm"):
        if f"shardckpt_{temperature}" not in loads[0]:
            continue
        ours, theirs = loads[0][f"shardckpt_{temperature}"], loads[0][f"dcp_{temperature}"]
        dropped = temperature == "warm" or loads[0]["cold_possible"]
        rows.append(
            {
                "load": f"{save_world} -> {world}",
                "temperature": temperature if dropped else "warm (no cache drop)",
                "shardckpt_seconds": ours,
                "dcp_seconds": theirs,
                "shardckpt_gib_s": size / ours / GIB,
                "dcp_gib_s": size / theirs / GIB,
                "speedup_vs_dcp": theirs / ours,
                "shardckpt_read_ratio": sum(rank[f"shardckpt_{temperature}_read"] for rank in loads) / needed,
                "dcp_read_ratio": sum(rank[f"dcp_{temperature}_read"] for rank in loads) / needed,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    args, rows, common, scratch = sharded_job(
        argv, __doc__, "benchmarks/dcp_backend.json", [4, 3], "shardckpt-dcpbench-"
    )
    size = rows * 1024 * 4 * args.tensors
    same = args.save_world in args.worlds
    saved = values(run_ranks("save", args.save_world, {**common, "load_here": same}, timeout=1800, worker=WORKER))
    ours, theirs = saved[0]["save_shardckpt"], saved[0]["save_dcp"]
    report: dict = {
        "state_bytes": size,
        "save_world": args.save_world,
        "save": {
            "shardckpt_gib_s": size / ours / GIB,
            "dcp_gib_s": size / theirs / GIB,
            "speedup_vs_dcp": theirs / ours,
        },
        "rows": [],
    }
    print(
        f"state: {args.tensors} fp32 tensors, {size / GIB:.2f} GiB, Shard(0) over {args.save_world} gloo ranks, "
        f"{os.cpu_count()} cores; dcp.save / dcp.load through shardckpt.dcp vs FileSystemWriter / FileSystemReader"
    )
    print(
        f"dcp.save on {args.save_world} ranks: shardckpt.dcp {report['save']['shardckpt_gib_s']:.2f} GiB/s, "
        f"FileSystemWriter {report['save']['dcp_gib_s']:.2f} GiB/s, speedup {theirs / ours:.2f}x"
    )
    print(
        f"{'dcp.load':10} {'temp':5} {'shardckpt GiB/s':>16} {'DCP GiB/s':>10} {'speedup':>8} "
        f"{'read/needed sc':>15} {'read/needed DCP':>16}"
    )
    runs: list[tuple[int, Callable[[], list[dict]]]] = []
    for world in args.worlds:
        if world == args.save_world:
            runs.append((world, lambda: [rank["load"] for rank in saved]))
        else:
            runs.append((world, lambda w=world: values(run_ranks("load", w, common, timeout=1800, worker=WORKER))))
    for world, loads in runs:
        for row in _rows(loads(), args.save_world, world, size):
            report["rows"].append(row)
            print(
                f"{row['load']:10} {row['temperature'][:5]:5} {row['shardckpt_gib_s']:16.2f} {row['dcp_gib_s']:10.2f} "
                f"{row['speedup_vs_dcp']:7.2f}x {row['shardckpt_read_ratio']:15.3f} {row['dcp_read_ratio']:16.3f}",
                flush=True,
            )
    write_report(args.json, report)
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and not sys.argv[1].startswith("-"):
        run_scenario(globals(), init_group=True)
    else:
        raise SystemExit(main())
