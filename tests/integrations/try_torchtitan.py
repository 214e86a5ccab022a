"""torchtitan's CheckpointManager through shardckpt for real (not part of `make test`: it needs torchtitan, installed
apart; README). The manager is built from its Config as torchtitan's Trainer builds it, on a tiny FSDP2 model with
torchtitan's own OptimizersContainer and LRSchedulersContainer (the Trainer's model and data need Hub assets).

`torchrun --nproc-per-node 2 tests/integrations/try_torchtitan.py MODE ROOT`: 8 steps, a checkpoint every 2
(async_mode="async", keep_latest_k=2). MODE full runs untouched; crash runs with SHARDCKPT_CRASH_AT=before_commit@3
(rank 0 dies between the global manifest and COMMITTED of step 6); resume loads the newest committed step and
finishes. Rank 0 of full and resume writes the final weights to ROOT/final-MODE.safetensors: they must be equal.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig

from shardckpt.integrations.torchtitan import CheckpointManager

STEPS = 8


class TrainState(Stateful):
    """As torchtitan's Trainer: the step and the losses so far, restored by load."""

    def __init__(self) -> None:
        self.step, self.losses = 0, []

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "losses": list(self.losses)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.losses = state["step"], list(state["losses"])


class Loader(Stateful):
    """A dataloader whose position is a bytes blob, as torchtitan's stateful dataloader stores it."""

    def __init__(self, rank: int) -> None:
        self.rank, self.position = rank, 0

    def batch(self) -> torch.Tensor:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * self.position + self.rank))
        self.position += 1
        return x

    def state_dict(self) -> dict[str, Any]:
        return {f"rank{self.rank}": self.position.to_bytes(8, "little")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int.from_bytes(state[f"rank{self.rank}"], "little")


def main() -> None:
    mode, root = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    adamw = ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 0.05, "weight_decay": 0.1})
    optimizers = OptimizersContainer.Config(param_groups=[adamw], implementation="for-loop").build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=STEPS)
    state, loader = TrainState(), Loader(rank)
    config = CheckpointManager.Config(enable=True, folder="ckpt", interval=2, keep_latest_k=2, async_mode="async")
    checkpointer = config.build(
        dataloader=loader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": state},
        sd_adapter=None,
        base_folder=root,
    )
    print(f"rank {rank}: {type(checkpointer).__module__}.{type(checkpointer).__qualname__}", flush=True)
    if checkpointer.load(step=-1):
        print(f"rank {rank}: resumed at step {state.step}, loader position {loader.position}", flush=True)
    while state.step < STEPS:
        state.step += 1
        x = loader.batch()
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        loss.backward()
        optimizers.step()
        optimizers.zero_grad()
        schedulers.step()
        # The global mean, as a trainer logs it: a shared value must be the same on every rank (shardckpt refuses
        # a save where it differs; DCP would keep one rank's silently).
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        state.losses.append(float(mean) / dist.get_world_size())
        checkpointer.save(state.step, last_step=state.step == STEPS)
    checkpointer.maybe_wait_for_saving()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        save_file({k: v.contiguous() for k, v in full.items()}, os.path.join(root, f"final-{mode}.safetensors"))
        print(f"{mode}: steps {state.step}, folder {sorted(os.listdir(os.path.join(root, 'ckpt')))}", flush=True)
    checkpointer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
