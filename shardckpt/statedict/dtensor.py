"""DTensor (FSDP2, tensor and expert parallel, 2-D meshes, FSDP2's _StridedShard) to the box this rank holds.

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
from torch.distributed.tensor.placement_types import (
    Partial,
    Placement,
    Replicate,
    Shard,
    _StridedShard,
    _StridedShardOffsetMode,
)

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
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """torch's computation, once per distinct (shape, mesh, placements, this rank's coordinate): a model has
    hundreds of tensors but few distinct shapes, and the computation is a noticeable part of a small load.
    None: the placements leave this rank elements that are not one box."""
    if coordinate is not None and any(isinstance(p, _StridedShard) for p in placements):
        return strided_box(global_shape, tuple(mesh.shape), tuple(coordinate), placements)  # type: ignore[arg-type]
    local_shape, offsets = compute_local_shape_and_global_offset(global_shape, mesh, placements)
    return tuple(int(d) for d in local_shape), tuple(int(o) for o in offsets)


def strided_box(
    global_shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    coordinate: tuple[int, ...],
    placements: tuple[Placement, ...],
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(local shape, offsets) of the box the rank at `coordinate` holds, or None when its elements are not one box.

    torch applies the placements left to right and, for a _StridedShard, keeps only the first global index of
    each dim: a strided split that no later Shard narrows to one run would be stored as a wrong box. Every
    index is kept here instead and each dim must end as one contiguous run. An empty dim's offset is the dim's
    length, as torch gives it."""
    indices: dict[int, list[int]] = {}
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, (Shard, _StridedShard)):
            raise ShardckptUsageError(f"placement {placement} is not supported (Shard and Replicate are)")
        dim = placement.dim
        previous = indices.get(dim, list(range(global_shape[dim])))
        if isinstance(placement, _StridedShard):
            _, picked = placement._local_shard_size_and_offset(
                len(previous), mesh_shape[mesh_dim], coordinate[mesh_dim], _StridedShardOffsetMode.ALL
            )
            assert isinstance(picked, list)
            indices[dim] = [previous[i] for i in picked]
        else:
            size, start = Shard.local_shard_size_and_offset(len(previous), mesh_shape[mesh_dim], coordinate[mesh_dim])
            indices[dim] = previous[int(start) : int(start) + int(size)]
    shape, offsets = list(global_shape), [0] * len(global_shape)
    for dim, held in indices.items():
        if held and held != list(range(held[0], held[0] + len(held))):
            return None
        shape[dim] = len(held)
        offsets[dim] = held[0] if held else global_shape[dim]
    return tuple(shape), tuple(offsets)


def local_box(name: str, tensor: DTensor) -> LocalBox:
    placements = tuple(tensor.placements)
    for placement in placements:
        if isinstance(placement, Partial):
            raise ShardckptUsageError(
                f"tensor {name!r} has a Partial placement (pending reduction); reduce or redistribute it first"
            )
        if type(placement) not in (Shard, Replicate, _StridedShard):
            raise ShardckptUsageError(
                f"tensor {name!r}: placement {placement} is not supported (Shard, Replicate and FSDP2's "
                "_StridedShard are); redistribute to plain Shard/Replicate placements first"
            )
    mesh = tensor.device_mesh
    global_shape = tuple(int(d) for d in tensor.shape)
    coordinate = mesh.get_coordinate()
    box = _local_shape_and_offset(global_shape, mesh, placements, None if coordinate is None else tuple(coordinate))
    if box is None:
        raise ShardckptUsageError(
            f"tensor {name!r}: placements {list(placements)} leave rank coordinate {list(coordinate or ())} "
            "elements that are not one contiguous box; redistribute to plain Shard/Replicate placements first"
        )
    local_shape, offsets = box
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
