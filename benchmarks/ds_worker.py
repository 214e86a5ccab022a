"""One rank of the DeepSpeed benchmark: a ZeRO-3 engine saved and loaded by shardckpt and by DeepSpeed itself.

Run by benchmarks/ds_engine.py through tests/launch.py (no module here may be named deepspeed.py: this
directory is on sys.path); rank verdicts go to RESULT_DIR/rank-<r>.json.
"""

from __future__ import annotations

import os
import statistics
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script
from benchmarks.dist_worker import run_scenario, timed_collective
from benchmarks.pagecache import drop_caches
from shardckpt.api import load_deepspeed, save_deepspeed
from shardckpt.train.common import parse_args
from shardckpt.train.deepspeed_loop import DeepSpeedTrainer, deepspeed_config, init_deepspeed
from shardckpt.train.model import GPT


def trainer(args: dict) -> DeepSpeedTrainer:
    """The bundled loop's DeepSpeed engine at the benchmark's size, after one step (so Adam has its moments)."""
    rank, world, device = init_deepspeed(False)
    train = parse_args(
        ["--ckpt", os.path.join(args["dir"], "unused"), "--global-batch", "12", "--steps", "1"]
        + ["--d-model", str(args["d_model"]), "--layers", str(args["layers"]), "--vocab", str(args["vocab"])]
    )
    result = DeepSpeedTrainer(train, rank, world, device)
    result.train_step()
    return result


def medians(runs: dict, repeats: int, cold: bool, rank: int) -> dict[str, float]:
    """Each run `repeats` times, alternating, page cache dropped before each when `cold`; median seconds."""
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for index in range(repeats):
        for name, run in runs.items():
            if cold:
                if rank == 0:
                    drop_caches()
                dist.barrier()
            samples[name].append(timed_collective(lambda run=run, index=index: run(index)))
    return {name: statistics.median(times) for name, times in samples.items()}


def scenario_save(args: dict, rank: int, world: int) -> dict:
    """Saves by both (fresh locations each time), then same-world loads of what each wrote, warm and cold."""
    engine = trainer(args).engine
    where = args["dir"]

    def native_save(index: int) -> None:
        engine.save_checkpoint(os.path.join(where, "native"), tag=f"global_step{index}")

    saves = medians(
        {
            "shardckpt": lambda i: save_deepspeed(engine, os.path.join(where, f"shardckpt-{i}")),
            "deepspeed": native_save,
        },
        args["repeats"],
        False,
        rank,
    )
    runs = {
        "shardckpt": lambda i: load_deepspeed(engine, os.path.join(where, "shardckpt-0")),
        "deepspeed": lambda i: engine.load_checkpoint(os.path.join(where, "native"), tag="global_step0"),
    }
    result = {"save": saves, "load_warm": medians(runs, args["repeats"], False, rank)}
    if args["cold"] and drop_caches():
        result["load_cold"] = medians(runs, args["repeats"], True, rank)
    return result


def scenario_reshard(args: dict, rank: int, world: int) -> dict:
    """On another world size: shardckpt straight from the saved checkpoint; DeepSpeed from ds_to_universal's."""
    import deepspeed

    engine = trainer(args).engine
    config = {**deepspeed_config(12, world, 1e-3), "checkpoint": {"load_universal": True}}
    model = GPT(engine.module.config)
    universal, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    runs = {
        "shardckpt": lambda i: load_deepspeed(engine, os.path.join(args["dir"], "shardckpt-0")),
        "universal": lambda i: universal.load_checkpoint(os.path.join(args["dir"], "universal"), tag="global_step0"),
    }
    result = {"load_warm": medians(runs, args["repeats"], False, rank)}
    if args["cold"] and drop_caches():
        result["load_cold"] = medians(runs, args["repeats"], True, rank)
    return result


if __name__ == "__main__":
    run_scenario(globals(), init_group=False)  # DeepSpeed sets up its own process group in trainer()
