"""One rank of the torch_checkpointing tests: `python tests/helpers/tc_worker.py SCENARIO ARGS_JSON` (torchrun env).

FSDP2 + AdamW (the DCP backend tests' model) saved and loaded by torch_checkpointing's CheckpointManager, through
shardckpt's storage and through its own local backend, and shardckpt checkpoints loaded by it on another world size.
Each rank returns the SHA-256 of every full tensor, so tests compare states across world sizes bit for bit.
"""

from __future__ import annotations

import hashlib
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # run as a script

import shardckpt
from tests.helpers.dcp_backend_worker import build, full_state, trained_state
from tests.helpers.launch import serve_rank


def manager(args: dict[str, Any], *, own_storage: bool = False) -> Any:
    from torch_checkpointing import ItemSpec
    from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig

    from shardckpt.integrations.torch_checkpointing import (
        CheckpointManager,
        ShardckptResharder,
        ShardckptStorageConfig,
    )

    save = AsyncCheckpointSaverConfig() if args.get("async") else SyncCheckpointSaverConfig()
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    # Its own local backend with O_DIRECT (its default) fails on this machine's file system: buffered, as a user would.
    storage = (
        LocalFileSystemStorageConfig(use_direct_io=False)
        if own_storage
        else ShardckptStorageConfig(root=args["root"], storage_options=args.get("options"))
    )
    config = CheckpointManager.Config(
        default=ItemSpec(resharder=ShardckptResharder()), save=save, storage_config=storage
    )
    return CheckpointManager(config)


def digests(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str]:
    return {name: hashlib.sha256(t.numpy().tobytes()).hexdigest() for name, t in full_state(model, optimizer).items()}


def fresh_targets() -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    """Another model and optimizer (other values everywhere), and the payload torch_checkpointing loads into."""
    model, optimizer = build(1, 0.5)
    model(torch.zeros(2, 3, dtype=torch.long)).sum().backward()  # AdamW state exists only after a step
    optimizer.step()
    optimizer.zero_grad()
    msd, osd = get_state_dict(model, optimizer)
    return model, optimizer, {"model": msd, "optim": osd, "extra": {"epoch": 0, "tag": ""}}


def scenario_save(args: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """Train one step, save with CheckpointManager (through shardckpt storage, or its own local backend), and
    with shardckpt.save; the full tensors' digests."""
    state, model, optimizer = trained_state()
    payload = {"model": state["model"], "optim": state["optim"], "extra": {"epoch": 3, "tag": "tc"}}
    with_shardckpt = manager(args)
    future = with_shardckpt.save(args["id"], payload)
    if future is not None:
        future.result(timeout=120)
    with_shardckpt.close()
    if args.get("own_root"):
        own = manager(args, own_storage=True)
        own.save(os.path.join(args["own_root"], args["id"]), payload)
        own.close()
    if args.get("shardckpt_url"):
        shardckpt.save(payload, args["shardckpt_url"], step=3)
    return {"digests": digests(model, optimizer)}


def load_one(args: dict[str, Any]) -> dict[str, Any]:
    """Load a checkpoint with CheckpointManager (the id through shardckpt storage, or a path through its own)."""
    model, optimizer, payload = fresh_targets()
    if args.get("tensors_only"):
        # torch_checkpointing's own format keeps a plain item in one file per saving rank (extra_<rank>.pt): a job
        # larger than the one that saved finds no file for its last ranks, whatever the storage underneath.
        del payload["extra"]
    loader = manager(args, own_storage=bool(args.get("own")))
    loader.load(args["id"], into=payload)
    loader.close()
    set_state_dict(model, optimizer, model_state_dict=payload["model"], optim_state_dict=payload["optim"])
    dist.barrier()
    return {"digests": digests(model, optimizer), "extra": payload.get("extra")}


def scenario_load(args: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """Each of args["loads"] (name -> load_one's arguments) in turn, in one launch."""
    return {name: load_one(load_args) for name, load_args in args["loads"].items()}


if __name__ == "__main__":
    serve_rank(globals(), default_timeout=120.0)
