"""One rank of a real DeepSpeed ZeRO-3 run (launched by torchrun): train a tiny model, save_checkpoint, write truth.

Truth is what DeepSpeed itself reconstructs: live full fp32 params and Adam moments, plus zero_to_fp32's offline one.
Then the import is loaded into a fresh engine with the live adapter (integrations.deepspeed) and compared again.

Usage: torchrun --nproc_per_node=2 tests/ds_native_worker.py OUT_DIR. Writes OUT_DIR/ds (the DeepSpeed save
dir), OUT_DIR/expected.safetensors (`model.<fqn>`, `optim.state.<fqn>.{exp_avg,exp_avg_sq}`, `offline.<fqn>`),
OUT_DIR/expected.json (steps, param groups, scheduler), OUT_DIR/done-<rank> when the rank finished, then
OUT_DIR/imported (shardckpt import-deepspeed of OUT_DIR/ds) and OUT_DIR/reload-<rank>.json (what did not match).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import deepspeed
import deepspeed.ops
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from safetensors.torch import save_file
from torch import nn

import shardckpt
from shardckpt.interop.import_deepspeed import import_deepspeed
from shardckpt.train.model import GPT, GPTConfig, next_token_loss

STEPS = 3
MOMENTS = ("exp_avg", "exp_avg_sq")
CONFIG = GPTConfig(vocab=64, seq_len=16, d_model=32, n_layer=2, n_head=4)


class Net(nn.Module):
    """GPT plus the awkward cases: odd and tiny parameters, a frozen one, a tied one, a persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT(CONFIG)
        self.odd = nn.Parameter(torch.randn(5))  # 5 elements on 2 ranks: rank 1 holds 2 plus 1 padding
        self.tiny = nn.Parameter(torch.randn(1))  # smaller than the world: rank 1 holds only padding
        self.frozen = nn.Parameter(torch.randn(3, 3), requires_grad=False)  # not in any optimizer group
        self.register_buffer("counter", torch.arange(4, dtype=torch.int64))
        self.mirror = nn.Module()
        self.mirror.weight = self.odd  # a tied parameter: saved once, named again in `shared_params`

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        extra = (self.odd.sum() + self.tiny.sum() + self.frozen.sum()) * 1e-2
        loss: torch.Tensor = next_token_loss(self.gpt, tokens) + extra
        return loss


def build(seed: int) -> tuple[Any, list[list[str]]]:
    """A ZeRO-3 engine over a fresh Net, and the FQNs of its two optimizer param groups."""
    torch.manual_seed(seed)
    net = Net()
    trainable = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    group_names = [[n for n, p in trainable if p.dim() >= 2], [n for n, p in trainable if p.dim() < 2]]
    groups = [
        {"params": [p for n, p in trainable if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for n, p in trainable if p.dim() < 2], "weight_decay": 0.0},
    ]
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1000,
        # A small sub_group_size splits each param group into several flat sub-groups, as large models do.
        "zero_optimization": {"stage": 3, "sub_group_size": 3000},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True, "adam_w_mode": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
    }
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=groups, config=config)
    return engine, group_names


def main(out: Path) -> None:
    # The shm extension would be JIT-compiled (~30 s); gloo alone trains identically.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed("gloo")
    rank = dist.get_rank()
    engine, group_names = build(0)
    generator = torch.Generator().manual_seed(1 + rank)
    for _ in range(STEPS):
        loss = engine(torch.randint(0, CONFIG.vocab, (2, CONFIG.seq_len), generator=generator))
        engine.backward(loss)
        engine.step()
    # Plain values become objects; a tensor and an argparse.Namespace (as Megatron-DeepSpeed saves) are skipped.
    client_state = {
        "epoch": 1,
        "data": {"position": 24, "files": ["a", "b"]},
        "rng": torch.arange(3),
        "args": argparse.Namespace(lr=0.01, name="tiny"),
    }
    engine.save_checkpoint(str(out / "ds"), client_state=client_state)

    expected: dict[str, torch.Tensor] = {}
    for name, param in engine.module.named_parameters():  # collectives: every rank takes part
        if param.requires_grad:
            expected[f"model.{name}"] = safe_get_full_fp32_param(param).clone()
            for key in MOMENTS:
                expected[f"optim.state.{name}.{key}"] = safe_get_full_optimizer_state(param, key).clone()
    dist.barrier()
    if rank == 0:
        offline = get_fp32_state_dict_from_zero_checkpoint(str(out / "ds"))
        expected.update({f"offline.{name}": tensor.contiguous().clone() for name, tensor in offline.items()})
        save_file(expected, str(out / "expected.safetensors"))  # clones: tied tensors may not share memory
        optimizer = engine.optimizer.optimizer
        steps = sorted({float(state["step"]) for state in optimizer.state.values()})
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        facts = {
            "steps": steps,
            "global_steps": engine.global_steps,
            "param_groups": json.loads(json.dumps(hyper, default=str)),
            "group_names": group_names,
            "scheduler": engine.lr_scheduler.state_dict(),
            "loss_scale": float(engine.optimizer.loss_scaler.cur_scale),
        }
        (out / "expected.json").write_text(json.dumps(facts))
    dist.barrier()
    (out / f"done-{rank}").write_text("ok")
    reload_imported(out, {k: v for k, v in expected.items() if not k.startswith("offline.")})


def reload_imported(out: Path, expected: dict[str, torch.Tensor]) -> None:
    """Import the checkpoint with shardckpt, load it into a fresh engine with the live adapter, compare."""
    rank = dist.get_rank()
    if rank == 0:
        import_deepspeed(str(out / "ds"), str(out / "imported"))
    dist.barrier()
    engine, _ = build(7)  # other initial weights: everything compared below must come from the checkpoint
    shardckpt.load_deepspeed(engine, str(out / "imported"))  # the live adapter's public entry point
    mismatches = []
    for name, param in engine.module.named_parameters():
        if param.requires_grad:
            got = {f"model.{name}": safe_get_full_fp32_param(param)}
            got.update({f"optim.state.{name}.{k}": safe_get_full_optimizer_state(param, k) for k in MOMENTS})
            mismatches += [key for key, value in got.items() if not torch.equal(value, expected[key])]
    facts = {"mismatches": mismatches, "global_steps": engine.global_steps}
    (out / f"reload-{rank}.json").write_text(json.dumps(facts))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
