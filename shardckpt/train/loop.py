"""`python -m shardckpt.train` / `shardckpt train`: parse the options, start the process group, run one trainer.

The FSDP2 trainer (fsdp2.py) by default, the DeepSpeed one (deepspeed_loop.py) with --engine deepspeed.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import shardckpt
from shardckpt.train.common import init_distributed, parse_args
from shardckpt.train.fsdp2 import Trainer


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    use_cuda = torch.cuda.is_available() and not args.cpu
    if args.bf16 and args.engine != "deepspeed":
        raise SystemExit("--bf16 is for --engine deepspeed (the FSDP2 loop trains in fp32)")
    if args.engine == "deepspeed":
        from shardckpt.train.deepspeed_loop import DeepSpeedTrainer, init_deepspeed

        trainer_class: type[Trainer] = DeepSpeedTrainer
        rank, world, device = init_deepspeed(use_cuda)
    else:
        trainer_class = Trainer
        rank, world, device = init_distributed(use_cuda)
    if args.pid_dir:
        os.makedirs(args.pid_dir, exist_ok=True)
        with open(os.path.join(args.pid_dir, f"rank-{rank}.pid"), "w") as handle:
            handle.write(str(os.getpid()))
    code = 0
    try:
        trainer = trainer_class(args, rank, world, device)
        if args.resume:
            trainer.resume()
        else:
            trainer.check_fresh_root()
        trainer.run()
        dist.barrier()
    except shardckpt.ShardckptError as exc:
        # A collective failure is raised alike on every rank, each copy naming every rank's cause: said once.
        if rank == 0 or not isinstance(exc, shardckpt.DistributedError):
            print(f"[train] rank {rank}: {exc}", file=sys.stderr, flush=True)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without interpreter teardown: gloo with DTensor can abort at exit after a clean run (FIELD-NOTES).
    os._exit(code)
