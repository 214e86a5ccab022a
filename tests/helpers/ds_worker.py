"""Training-loop workers for the DeepSpeed tests, run like torchrun runs them: `ds_worker.py MODE OUT -- TRAIN ARGS`.

native: train with DeepSpeed, then save the same state with shardckpt (OUT/shardckpt) and DeepSpeed (OUT/native).
resave: resume (any engine, any checkpoint) and at once save what the live engine holds to OUT with shardckpt.
load-stats: load the checkpoint at --ckpt into a DeepSpeed engine; each rank's bytes needed and fetched to OUT.
check-full: load the checkpoint at --ckpt into a DeepSpeed engine; compare it with DeepSpeed's full parameters.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch.distributed as dist

import shardckpt
from shardckpt.train.common import init_distributed, parse_args
from shardckpt.train.fsdp2 import Trainer


def check_full(engine, url: str, result: str) -> None:
    """After load_deepspeed: DeepSpeed's full fp32 masters and moments, and the gathered module parameters (in the
    engine's own dtype), against what the checkpoint holds; the names of those that differ."""
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    shardckpt.load_deepspeed(engine, url)
    checkpoint, wrong = shardckpt.open(url), []
    for name, param in engine.module.named_parameters():
        stored = checkpoint.read(f"model.{name}")
        if not torch.equal(safe_get_full_fp32_param(param), stored):
            wrong.append(f"fp32 {name}")
        for key in ("exp_avg", "exp_avg_sq"):
            if not torch.equal(safe_get_full_optimizer_state(param, key), checkpoint.read(f"optim.state.{name}.{key}")):
                wrong.append(f"{key} {name}")
        with deepspeed.zero.GatheredParameters([param]):
            if not torch.equal(param.data, stored.to(param.dtype)):
                wrong.append(f"module {name}")
        dtype = str(param.dtype)
    os.makedirs(os.path.dirname(result), exist_ok=True)
    with open(result, "w") as handle:
        json.dump({"wrong": wrong, "dtype": dtype, "step": engine.global_steps}, handle)


def main() -> int:
    mode, out, separator, *train_args = sys.argv[1:]
    assert separator == "--", sys.argv
    args = parse_args(train_args)
    if args.engine == "deepspeed":
        from shardckpt.train.deepspeed_loop import DeepSpeedTrainer, init_deepspeed

        rank, world, device = init_deepspeed(False)
        trainer: Trainer = DeepSpeedTrainer(args, rank, world, device)
    else:
        rank, world, device = init_distributed(False)
        trainer = Trainer(args, rank, world, device)
    if mode == "native":
        while trainer.step < args.steps:
            trainer.train_step()
        began = time.perf_counter()
        shardckpt.save(trainer.state(), os.path.join(out, "shardckpt"), step=trainer.step)
        middle = time.perf_counter()
        trainer.engine.save_checkpoint(os.path.join(out, "native"), tag=f"global_step{trainer.step}")
        if rank == 0:
            print(f"saved: shardckpt {middle - began:.3f} s, native {time.perf_counter() - middle:.3f} s", flush=True)
    elif mode == "resave":
        if trainer.resume() is None:
            raise SystemExit(f"nothing to resume under {args.ckpt}")
        shardckpt.save(trainer.state(), out, step=trainer.step)
    elif mode == "load-stats":  # load_deepspeed straight from a checkpoint URL; what this rank read
        from shardckpt.api import load_deepspeed

        stats = load_deepspeed(trainer.engine, args.ckpt, max_gap=0)  # no gap read through: only what it needs
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"rank-{rank}.json"), "w") as handle:
            json.dump(
                {"needed": stats.needed_bytes, "fetched": stats.fetched_bytes, "requests": stats.requests}, handle
            )
    elif mode == "check-full":  # load_deepspeed, then compare with DeepSpeed's own view of every parameter
        check_full(trainer.engine, args.ckpt, os.path.join(out, f"rank-{rank}.json"))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown: gloo can abort at exit after a clean run (FIELD-NOTES)


if __name__ == "__main__":
    raise SystemExit(main())
