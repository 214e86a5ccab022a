"""Training-loop workers for the DeepSpeed tests, run under torchrun: `ds_worker.py MODE OUT -- TRAIN ARGS`.

native: train with DeepSpeed, then save the same state with shardckpt (OUT/shardckpt) and DeepSpeed (OUT/native).
resave: resume (any engine, any checkpoint) and at once save what the live engine holds to OUT with shardckpt.
load-stats: load the checkpoint at --ckpt into a DeepSpeed engine; each rank's bytes needed and fetched to OUT.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch.distributed as dist

import shardckpt
from shardckpt.train.loop import Trainer, init_distributed, parse_args


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
        from shardckpt.zero3 import load_deepspeed

        stats = load_deepspeed(trainer.engine, args.ckpt, max_gap=0)  # no gap read through: only what it needs
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"rank-{rank}.json"), "w") as handle:
            json.dump(
                {"needed": stats.needed_bytes, "fetched": stats.fetched_bytes, "requests": stats.requests}, handle
            )
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown: gloo can abort at exit after a clean run (FIELD-NOTES)


if __name__ == "__main__":
    raise SystemExit(main())
