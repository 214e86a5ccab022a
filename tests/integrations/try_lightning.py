"""Lightning through shardckpt for real (not part of `make test`: it needs Lightning, installed apart; README).

`torchrun --nproc-per-node 2 tests/integrations/try_lightning.py MODE ROOT`: MODE full trains 4 epochs untouched;
crash saves each epoch and SIGKILLs rank 1 in epoch 3; resume continues from shardckpt.latest(ROOT). Rank 0 of
full and resume writes the final weights to ROOT/final-MODE.safetensors: a resumed run must end equal to the full one.
"""

from __future__ import annotations

import os
import signal
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

import shardckpt
from shardckpt.integrations.lightning import ModelParallelStrategy


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.save_hyperparameters({"width": 16})
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def configure_model(self) -> None:
        fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)


class Kill(Callback):
    """SIGKILL rank 1 at the start of global step 5 (epoch 3), as a preempted node dies: no cleanup runs."""

    def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == 5 and trainer.global_rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    mode, root = sys.argv[1], sys.argv[2]
    data = torch.Generator().manual_seed(1)
    x = torch.randn(16, 8, generator=data)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)  # 2 steps per epoch on 2 ranks
    checkpoints = ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), every_n_epochs=1, save_on_train_epoch_end=True)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_epochs=4,
        callbacks=[checkpoints, *([Kill()] if mode == "crash" else [])],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Regressor()
    resume = shardckpt.latest(os.path.join(root, "ckpt")) if mode == "resume" else None
    if mode == "resume":
        if resume is None:
            raise SystemExit("nothing committed to resume from")
        print(f"rank {trainer.global_rank}: resuming from {resume} (step {shardckpt.open(resume).step})", flush=True)
    trainer.fit(model, loader, ckpt_path=resume)
    full = get_model_state_dict(model.net, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if trainer.global_rank == 0:
        save_file({k: v.contiguous() for k, v in full.items()}, os.path.join(root, f"final-{mode}.safetensors"))
        print(f"{mode}: global_step {trainer.global_step}, checkpoints {sorted(os.listdir(checkpoints.dirpath))}")


if __name__ == "__main__":
    main()
