"""DTensor (FSDP2 fully_shard, tensor parallel, 2-D meshes) to the box this rank holds and whether it writes it.

Of the ranks that hold the same box (Replicate on some mesh dimension), exactly one writes it, chosen per
tensor so that replicated writes spread over the replicas.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import crc32c
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from shardckpt.errors import ShardckptUsageError


@dataclass(frozen=True)
class LocalBox:
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    local: torch.Tensor
    writes: bool


def is_dtensor(value: object) -> bool:
    return isinstance(value, DTensor)


@functools.lru_cache(maxsize=4096)
def _local_shape_and_offset(
    global_shape: tuple[int, ...], mesh: DeviceMesh, placements: tuple[Placement, ...], coordinate: object
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """torch's computation, once per distinct (shape, mesh, placements, this rank's coordinate): a model has
    hundreds of tensors but few distinct shapes, and the computation is a noticeable part of a small load."""
    local_shape, offsets = compute_local_shape_and_global_offset(global_shape, mesh, placements)
    return tuple(int(d) for d in local_shape), tuple(int(o) for o in offsets)


def local_box(name: str, tensor: DTensor) -> LocalBox:
    placements = tuple(tensor.placements)
    for placement in placements:
        if isinstance(placement, Partial):
            raise ShardckptUsageError(
                f"tensor {name!r} has a Partial placement (pending reduction); reduce or redistribute it first"
            )
        if not isinstance(placement, (Shard, Replicate)) or type(placement) not in (Shard, Replicate):
            raise ShardckptUsageError(
                f"tensor {name!r}: placement {placement} is not supported (Shard and Replicate are); "
                "redistribute to plain Shard/Replicate placements first"
            )
    mesh = tensor.device_mesh
    global_shape = tuple(int(d) for d in tensor.shape)
    coordinate = mesh.get_coordinate()
    local_shape, offsets = _local_shape_and_offset(
        global_shape, mesh, placements, None if coordinate is None else tuple(coordinate)
    )
    local = tensor.to_local()
    if tuple(local.shape) != tuple(local_shape):
        raise ShardckptUsageError(
            f"tensor {name!r}: local shard has shape {list(local.shape)}, its placements imply {list(local_shape)}"
        )
    if coordinate is None:  # this rank is not in the tensor's mesh
        return LocalBox(global_shape, tuple(offsets), local, writes=False)
    replicated = [d for d, p in enumerate(placements) if isinstance(p, Replicate)]
    replicas, index = 1, 0
    for dim in replicated:
        index = index * mesh.size(dim) + coordinate[dim]
        replicas *= mesh.size(dim)
    # Deterministic on every rank: the same replica of the same tensor is chosen everywhere.
    chosen = crc32c.crc32c(name.encode()) % replicas
    return LocalBox(global_shape, tuple(int(o) for o in offsets), local, writes=index == chosen)
