"""One rank of the shared-read tests: `python tests/helpers/share_worker.py SCENARIO ARGS_JSON` (torchrun env).

An FSDP2 model on a 2-D (replicate, shard) mesh as torchtitan builds HSDP, or plain replicated tensors as DDP keeps
them; each rank counts the data-file bytes it reads from storage while loading, and returns the SHA-256 of every
full tensor so tests compare states bit for bit across meshes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # run as a script

import shardckpt
from shardckpt.errors import StorageError
from shardckpt.storage.local import LocalStorage
from tests.helpers.dcp_backend_worker import counting_data_reads
from tests.helpers.launch import serve_rank


def build(seed: int, mesh_shape: list[int]) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(512, 64), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 40), nn.LayerNorm(40))
    mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=("replicate", "shard"))
    for layer in (model[0], model[1], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def digests(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str]:
    msd, osd = get_state_dict(model, optimizer)
    flat = {f"model.{k}": v for k, v in msd.items()}
    flat.update({f"optim.{fqn}.{k}": v for fqn, state in osd["state"].items() for k, v in state.items()})
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().contiguous() for k, v in flat.items()}
    return {k: hashlib.sha256(v.numpy().tobytes()).hexdigest() for k, v in full.items()}


@contextlib.contextmanager
def unreadable_data() -> Iterator[None]:
    """This process cannot read data files (an I/O error), as on a node whose mount went bad."""
    original = LocalStorage.pread_into

    def pread_into(self: LocalStorage, fd: int, path: str, start: int, out: memoryview) -> None:
        raise StorageError(f"injected I/O error reading {path}")

    LocalStorage.pread_into = pread_into  # type: ignore[method-assign]
    try:
        yield
    finally:
        LocalStorage.pread_into = original  # type: ignore[method-assign]


def nodes(args: dict[str, Any], rank: int) -> None:
    """Simulate nodes of args["per_node"] ranks each (SHARDCKPT_NODE), as a multi-node launch would name them."""
    if args.get("per_node"):
        os.environ["SHARDCKPT_NODE"] = f"node-{rank // args['per_node']}"


def scenario_hsdp_save(args: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    model, optimizer = build(0, args["mesh"])
    generator = torch.Generator().manual_seed(7)
    model(torch.randint(0, 512, (8, 4), generator=generator)).pow(2).mean().backward()
    optimizer.step()
    msd, osd = get_state_dict(model, optimizer)
    shardckpt.save({"model": msd, "optim": osd}, args["url"], step=1)
    return {"digests": digests(model, optimizer)}


def scenario_hsdp_load(args: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    nodes(args, rank)
    model, optimizer = build(1, args["mesh"])
    model(torch.zeros(2, 3, dtype=torch.long)).sum().backward()  # AdamW state exists only after a step
    optimizer.step()
    optimizer.zero_grad()
    msd, osd = get_state_dict(model, optimizer)
    with counting_data_reads() as read:
        shardckpt.load({"model": msd, "optim": osd}, args["url"], share_reads=args.get("share"))
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
    dist.barrier()
    return {"digests": digests(model, optimizer), "read": read[0]}


def replicated(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(96, 80, generator=generator) for i in range(6)}


def scenario_ddp_save(args: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    shardckpt.save({"model": replicated(3)}, args["url"], step=1, compression=args.get("compression"))
    return {}


def scenario_ddp_load(args: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    nodes(args, rank)
    state = {"model": {k: torch.zeros_like(v) for k, v in replicated(3).items()}}
    failing = contextlib.nullcontext() if args.get("fail_rank") != rank else unreadable_data()
    with counting_data_reads() as read, failing:
        share = args["share_by_rank"][rank] if "share_by_rank" in args else args.get("share")
        shardckpt.load(state, args["url"], share_reads=share)
    same = all(torch.equal(state["model"][k], v) for k, v in replicated(3).items())
    return {"equal": same, "read": read[0]}


if __name__ == "__main__":
    serve_rank(globals(), default_timeout=120.0)
