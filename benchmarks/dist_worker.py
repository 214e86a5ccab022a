"""One rank of the distributed benchmark: FSDP-style Shard(0) state saved and loaded by shardckpt and by DCP.

Run by benchmarks/distributed.py through tests/launch.py; rank verdicts go to RESULT_DIR/rank-<r>.json.
"""

from __future__ import annotations

import datetime
import json
import os
import resource
import shutil
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import shardckpt

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script
from benchmarks.memory import peak_above
from benchmarks.pagecache import drop_caches


def read_bytes() -> int:
    """Bytes this process read through read syscalls (page cache or disk): what a load pulled from storage."""
    with open("/proc/self/io") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("rchar"))


def make_state(args: dict, world: int, rank: int, fill: bool) -> dict[str, DTensor]:
    """`tensors` fp32 tensors of `rows` x 1024 sharded by rows (rows divisible by 12: every W in 1..4 is even)."""
    mesh = init_device_mesh("cpu", (world,))
    rows, tensors = args["rows"], args["tensors"]
    local_rows = rows // world
    state = {}
    for index in range(tensors):
        if fill:
            generator = torch.Generator().manual_seed(index * 1000 + rank)
            local = torch.randn(local_rows, 1024, generator=generator)
        else:  # preallocated and touched, as a model's tensors are: first-touch page faults are no loader's cost
            local = torch.zeros(local_rows, 1024)
        state[f"t{index:03d}"] = DTensor.from_local(local, mesh, [Shard(0)], shape=(rows, 1024), stride=(1024, 1))
    return state


def timed_collective(run) -> float:
    dist.barrier()
    began = time.perf_counter()
    run()
    dist.barrier()
    return time.perf_counter() - began


def timed_with_peak(run) -> tuple[float, int | None]:
    """timed_collective(run), and by how much this rank's peak RSS during it exceeded its RSS before."""
    seconds: list[float] = []
    peak = peak_above(lambda: seconds.append(timed_collective(run)))
    return seconds[0], peak


def scenario_save(args: dict, rank: int, world: int) -> dict:
    """Each library's durable save `repeats` times, taking turns; medians. Every output but the last is deleted
    before the next save (so each writes into disk blocks the machine already backs); the last ones are loaded."""
    return timed_saves(make_state(args, world, rank, fill=True), args, rank)


def timed_saves(
    state: dict, args: dict, rank: int, saves: dict[str, Callable[[str], object]] | None = None
) -> dict[str, float]:
    """Median seconds of each library's durable save of `state`, `repeats` times taking turns. Every output but the
    last is deleted before the next save (so each writes into disk blocks the machine already backs); the last
    ones, at args[name] for each name of `saves` (default: shardckpt.save and dcp.save), are what the loads read."""
    saves = saves or {
        "shardckpt": lambda path: shardckpt.save(state, path),
        "dcp": lambda path: dcp.save(state, storage_writer=FileSystemWriter(path, thread_count=2, sync_files=True)),
    }
    samples: dict[str, list[float]] = {name: [] for name in saves}
    repeats = args.get("repeats", 1)
    for repeat in range(repeats):
        for name in sorted(saves, reverse=repeat % 2 == 1):
            path = args[name] if repeat == repeats - 1 else f"{args[name]}-scratch"
            samples[name].append(timed_collective(lambda: saves[name](path)))  # noqa: B023 (called at once)
            if rank == 0 and path != args[name]:
                shutil.rmtree(path)
                os.sync()
            dist.barrier()
    return {name: statistics.median(times) for name, times in samples.items()}


def scenario_load(args: dict, rank: int, world: int) -> dict:
    """Each library's load, cold then warm, `repeats` times alternating; medians, bytes read and peak RSS."""
    state = make_state(args, world, rank, fill=False)
    needed = sum(t.to_local().numel() * 4 for t in state.values())
    result: dict = {"needed": needed, "cold_possible": False}
    runs = (
        ("shardckpt", lambda: shardckpt.load(state, args["shardckpt"])),
        ("dcp", lambda: dcp.load(state, storage_reader=FileSystemReader(args["dcp"]))),
    )
    for temperature in ("warm",) if args.get("warm") else ("cold", "warm"):
        samples: dict[str, list[float]] = {name: [] for name, _ in runs}
        for _ in range(args.get("repeats", 1)):
            for name, run in runs:
                if temperature == "cold":
                    if rank == 0:
                        result["cold_possible"] = drop_caches()
                    dist.barrier()
                before = read_bytes()
                seconds, peak = timed_with_peak(run)
                samples[name].append(seconds)
                result[f"{name}_{temperature}_read"] = read_bytes() - before
                if peak is not None:
                    key = f"{name}_peak_above"
                    result[key] = max(result.get(key, 0), peak)
        for name, times in samples.items():
            result[f"{name}_{temperature}"] = statistics.median(times)
    result["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return result


def loop_trainer(args: dict, rank: int, world: int):
    """The bundled FSDP2 training loop's Trainer at the benchmark's model size, after one step (AdamW state)."""
    from shardckpt.train.common import parse_args
    from shardckpt.train.fsdp2 import Trainer

    options = ["--ckpt", os.path.join(args["result_dir"], "unused"), "--global-batch", str(args["batch"])]
    for key in ("vocab", "seq_len", "d_model", "layers", "heads"):
        options += [f"--{key.replace('_', '-')}", str(args[key])]
    trainer = Trainer(parse_args(options), rank, world, torch.device("cpu"))
    trainer.train_step()
    return trainer


def loop_state(trainer) -> dict:
    """What both libraries save and load: the loop's model and optimizer state dicts (DTensor shards)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(trainer.model, trainer.optimizer)
    return {"model": model_state, "optim": optim_state}


def local_tensors(state: dict) -> list[torch.Tensor]:
    out = []
    for value in state.values():
        if isinstance(value, dict):
            out.extend(local_tensors(value))
        elif isinstance(value, torch.Tensor):
            out.append(value.to_local() if isinstance(value, DTensor) else value)
    return out


def scenario_loop_save(args: dict, rank: int, world: int) -> dict:
    """The training loop's state saved by each library, `repeats` times in turns (outputs but the last deleted)."""
    state = loop_state(loop_trainer(args, rank, world))
    medians = timed_saves(state, args, rank)
    tensors = local_tensors(state)
    total = torch.tensor([sum(t.numel() * t.element_size() for t in tensors), len(tensors)], dtype=torch.int64)
    dist.all_reduce(total)
    return {
        **medians,
        "bytes": int(total[0]),
        "tensors": int(total[1]) // world,
    }


def scenario_loop_load(args: dict, rank: int, world: int) -> dict:
    """A fresh loop on `world` ranks loads the saved state with each library, cold then warm; both must agree."""
    state = loop_state(loop_trainer(args, rank, world))
    runs = (
        ("shardckpt", lambda: shardckpt.load(state, args["shardckpt"])),
        ("dcp", lambda: dcp.load(state, storage_reader=FileSystemReader(args["dcp"]))),
    )
    result: dict = {"cold_possible": False}
    loaded: dict[str, list[torch.Tensor]] = {}
    for temperature in ("warm",) if args.get("warm") else ("cold", "warm"):
        samples: dict[str, list[float]] = {name: [] for name, _ in runs}
        for _ in range(args.get("repeats", 1)):
            for name, run in runs:
                for tensor in local_tensors(state):
                    tensor.zero_()  # every load starts from zeros: a load that skipped a tensor cannot pass
                if temperature == "cold":
                    if rank == 0:
                        result["cold_possible"] = drop_caches()
                    dist.barrier()
                samples[name].append(timed_collective(run))
                loaded[name] = [t.clone() for t in local_tensors(state)]
        for name, times in samples.items():
            result[f"{name}_{temperature}"] = statistics.median(times)
    result["agree"] = all(torch.equal(a, b) for a, b in zip(loaded["shardckpt"], loaded["dcp"], strict=True))
    return result


def run_scenario(scenarios: dict, init_group: bool) -> None:
    """`worker.py SCENARIO ARGS_JSON`: run scenario_<SCENARIO>(args, rank, world) from `scenarios` (a module's
    globals), write its verdict to RESULT_DIR/rank-<r>.json and leave without interpreter teardown."""
    warnings.filterwarnings("ignore")
    scenario, args = sys.argv[1], json.loads(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if init_group:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    try:
        result = {"ok": True, "value": scenarios[f"scenario_{scenario}"](args, rank, world)}
    except Exception as exc:
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    with open(os.path.join(args["result_dir"], f"rank-{rank}.json"), "w") as handle:
        json.dump(result, handle)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    run_scenario(globals(), init_group=True)
