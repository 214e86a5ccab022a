"""The training loop on DeepSpeed ZeRO-3 instead of FSDP2: same model, data, AdamW, schedule and checkpoint names.

`python -m shardckpt.train --engine deepspeed` under torchrun; its checkpoints resume on any world size, and in
the FSDP2 loop, and the other way round (see shardckpt/statedict/deepspeed.py).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from shardckpt.statedict.deepspeed import OPTIONAL_ON_LOAD, DeepSpeedZero3
from shardckpt.statedict.leaves import PerRank
from shardckpt.train.common import (
    ADAMW_BETAS,
    ADAMW_WEIGHT_DECAY,
    WarmupCosine,
    init_distributed,
    rng_state,
    schedule_steps,
)
from shardckpt.train.fsdp2 import Trainer
from shardckpt.train.model import GPT, next_token_loss


def init_deepspeed(use_cuda: bool) -> tuple[int, int, torch.device]:
    import deepspeed

    return init_distributed(use_cuda, deepspeed.init_distributed)


def deepspeed_config(global_batch: int, world: int, lr: float, *, bf16: bool = False) -> dict[str, Any]:
    """ZeRO-3 with torch's AdamW (the FSDP2 loop's optimizer), one micro-batch per rank and step; fp32 or bf16."""
    return {
        "bf16": {"enabled": bf16},
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": global_batch // world,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3},
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": lr,
                "betas": list(ADAMW_BETAS),
                "eps": 1e-8,
                "weight_decay": ADAMW_WEIGHT_DECAY,
                "torch_adam": True,
                "adam_w_mode": True,
            },
        },
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


class DeepSpeedTrainer(Trainer):
    """Trainer whose model, optimizer and schedule live in a DeepSpeed ZeRO-3 engine."""

    def build(self, model: GPT) -> None:
        import deepspeed

        args = self.args
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=model,
            model_parameters=model.parameters(),
            config=deepspeed_config(args.global_batch, self.world, args.lr, bf16=args.bf16),
            lr_scheduler=lambda base: LambdaLR(base, WarmupCosine(args.warmup, schedule_steps(args))),
        )
        self.engine, self.model, self.optimizer, self.scheduler = engine, engine, optimizer, scheduler
        self.adapter = DeepSpeedZero3(engine)

    def state(self) -> dict[str, Any]:
        return {
            **self.adapter.state_dict(),
            "trainer": {"step": self.step, "data_position": self.step * self.args.global_batch},
            "rng": PerRank(rng_state(self.device)),
        }

    def resume(self) -> int | None:
        began = time.perf_counter()
        state = {
            **self.adapter.load_state(),
            "trainer": {"step": 0, "data_position": 0},
            "rng": PerRank(None),
        }
        step = self.checkpointer.restore_latest(state, optional=OPTIONAL_ON_LOAD)
        if step is None:
            return None
        self.adapter.finish_load(state)
        self.step = state["trainer"]["step"]
        return self._resumed(state, step, began)

    def train_step(self) -> float:
        loss = next_token_loss(self.engine, self.batch())
        self.engine.backward(loss)
        self.engine.step()  # optimizer step, then the schedule, then zero_grad
        return self.finish_step(loss)
