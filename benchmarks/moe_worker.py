"""One rank of `python -m benchmarks.moe`: a per-expert MoE under FSDP2 with AdamW state, saved and loaded (4 -> 3)
by shardckpt and by torch DCP in turns. Run through tests/helpers/launch.py; verdicts go to RESULT_DIR/rank-<r>.json.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import shutil
import statistics
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script
import shardckpt
from benchmarks.dist_worker import read_bytes, run_scenario, timed_collective
from tests.helpers.moe_model import per_expert_model, train_step


def moe_state(args: dict, seed: int, rank: int, world: int) -> dict:
    """The model and AdamW state dicts (DTensor shards, FQN keys) after one step on this rank's tokens."""
    model, optimizer = per_expert_model(seed, world, **args["model"])
    train_step(model, optimizer, args["model"]["dim"], rank)
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def local_tensors(state: dict) -> list[torch.Tensor]:
    out = [v.to_local() if isinstance(v, DTensor) else v for v in state["model"].values()]
    for entries in state["optim"]["state"].values():
        out.extend(v.to_local() if isinstance(v, DTensor) else v for v in entries.values())
    return out


def profiled(args: dict, rank: int, name: str, run) -> None:
    """With --profile DIR: `run` once more on every rank (it is collective), rank 0 under cProfile; its top
    functions by cumulative time go to DIR/<name>.txt."""
    if not args.get("profile"):
        return
    profile = cProfile.Profile() if rank == 0 else None
    if profile is not None:
        profile.enable()
    run()
    if profile is not None:
        profile.disable()
        with open(os.path.join(args["profile"], f"{name}.txt"), "w") as handle:
            pstats.Stats(profile, stream=handle).sort_stats("cumulative").print_stats(40)
            pstats.Stats(profile, stream=handle).sort_stats("tottime").print_stats(25)
    dist.barrier()


def scenario_save(args: dict, rank: int, world: int) -> dict:
    """Each library's durable save `repeats` times, taking turns; medians. Outputs but the last are deleted."""
    state = moe_state(args, 0, rank, world)
    saves = {
        "shardckpt": lambda path: shardckpt.save(state, path, block_size=args["block_size"]),
        "dcp": lambda path: dcp.save(state, storage_writer=FileSystemWriter(path, thread_count=2, sync_files=True)),
    }
    samples: dict[str, list[float]] = {name: [] for name in saves}
    for repeat in range(args["repeats"]):
        for name in sorted(saves, reverse=repeat % 2 == 1):
            last = repeat == args["repeats"] - 1
            path = args[name] if last else f"{args[name]}-scratch"
            samples[name].append(timed_collective(lambda: saves[name](path)))  # noqa: B023 (called at once)
            if rank == 0 and not last:
                shutil.rmtree(path)
            dist.barrier()
    scratch = f"{args['shardckpt']}-profiled"
    profiled(args, rank, "save", lambda: shardckpt.save(state, scratch, block_size=args["block_size"]))
    tensors = local_tensors(state)
    return {
        **{name: statistics.median(times) for name, times in samples.items()},
        "stored": len(shardckpt.open(args["shardckpt"]).manifest.tensors),
        "bytes": sum(t.numel() * t.element_size() for t in tensors),
    }


def scenario_load(args: dict, rank: int, world: int) -> dict:
    """Each library's (warm) load into a fresh model on `world` ranks, `repeats` times in turns; medians, bytes read
    (shardckpt's own count and the process's read syscalls) and whether both libraries loaded the same values."""
    state = moe_state(args, 1, rank, world)  # other values: all must come from the checkpoint
    runs = {
        "shardckpt": lambda: shardckpt.load(state, args["shardckpt"], max_gap=args["max_gap"]),
        "dcp": lambda: dcp.load(state, storage_reader=FileSystemReader(args["dcp"])),
    }
    result: dict = {"needed": sum(t.numel() * t.element_size() for t in local_tensors(state))}
    samples: dict[str, list[float]] = {name: [] for name in runs}
    loaded: dict[str, list[torch.Tensor]] = {}
    for repeat in range(args["repeats"]):
        for name in sorted(runs, reverse=repeat % 2 == 1):
            for tensor in local_tensors(state):
                tensor.zero_()  # a load that skipped a tensor cannot agree with the other library
            before = read_bytes()
            outcome: list = []
            samples[name].append(timed_collective(lambda: outcome.append(runs[name]())))  # noqa: B023
            result[f"{name}_read"] = read_bytes() - before
            if name == "shardckpt":
                result["shardckpt_needed"] = outcome[0].needed_bytes
                result["shardckpt_fetched"] = outcome[0].fetched_bytes
            loaded[name] = [t.clone() for t in local_tensors(state)]
    result.update({name: statistics.median(times) for name, times in samples.items()})
    profiled(args, rank, "load", runs["shardckpt"])
    result["agree"] = all(torch.equal(a, b) for a, b in zip(loaded["shardckpt"], loaded["dcp"], strict=True))
    return result


if __name__ == "__main__":
    run_scenario(globals(), init_group=True)
