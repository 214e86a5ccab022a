"""From a flattened state dict to what this rank writes on save and fills on load.

DTensors contribute their local box; plain tensors are replicated (written once, spread over ranks);
FlatPartitions contribute flat pieces; PerRank values are kept per rank; other plain values are shared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from shardckpt.errors import FormatError, ShardckptUsageError
from shardckpt.format.strict import check_shape
from shardckpt.format.values import check_plain
from shardckpt.planner.box import Box
from shardckpt.statedict.dtensor import is_dtensor, local_box
from shardckpt.statedict.flat import FlatPartition
from shardckpt.statedict.flatten import Leaf
from shardckpt.torch_bytes import (
    FORMAT_TO_TORCH,
    TORCH_TO_FORMAT,
    check_dense,
    check_destination,
    format_dtype,
    host_bytes,
)

# What a load gives a rank that did not exist when the checkpoint was saved (a resume on more ranks).
MISSING_CHOICES = ("keep", "error", "wrap")


@dataclass
class PerRank:
    """A value that each rank saves for itself (its RNG state, its data-loader worker position).

    Plain values, and tensors anywhere inside them (torch.get_rng_state()), stored as per-rank objects; a load
    sets `value` to this rank's (tensors come back on the CPU). Rank r of a load gets what rank r saved; for a rank
    the checkpoint has none of (saved on fewer ranks), `missing` of the PerRank passed to load chooses:
    "keep" (default): `value` stays what the caller put there (e.g. a fresh, rank-seeded RNG state);
    "error": the load raises ShardckptUsageError, before anything is written;
    "wrap": rank r gets saved rank r % W's value (W: ranks at save), so some ranks repeat another's stream.
    Values of saved ranks that the loading job lacks (saved on more ranks) are not restored anywhere.
    """

    value: Any
    missing: str = "keep"
    shardckpt_leaf = True

    def __post_init__(self) -> None:
        if self.missing not in MISSING_CHOICES:
            raise ShardckptUsageError(f"PerRank(missing={self.missing!r}): choose one of {list(MISSING_CHOICES)}")


# A tensor inside a PerRank value is stored as the plain map {TENSOR_TAG: [dtype, shape, bytes]} (SPEC section 7
# values have no tensor type); a load turns such a map back into a tensor.
TENSOR_TAG = "__shardckpt_tensor__"


def per_rank_plain(value: Any) -> Any:
    """`value` with each tensor inside it replaced by its tagged plain map."""
    if isinstance(value, torch.Tensor):
        data = host_bytes(value).tobytes()
        return {TENSOR_TAG: [format_dtype(value.dtype), list(value.shape), data]}
    if isinstance(value, dict):
        return {key: per_rank_plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [per_rank_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(per_rank_plain(item) for item in value)
    return value


def per_rank_value(stored: Any, where: str) -> Any:
    """A stored per-rank value with its tagged maps turned back into tensors (FormatError for a malformed one)."""
    if isinstance(stored, dict) and set(stored) == {TENSOR_TAG}:
        return _tensor_of(stored[TENSOR_TAG], where)
    if isinstance(stored, dict):
        return {key: per_rank_value(item, where) for key, item in stored.items()}
    if isinstance(stored, list):
        return [per_rank_value(item, where) for item in stored]
    if isinstance(stored, tuple):
        return tuple(per_rank_value(item, where) for item in stored)
    return stored


def _tensor_of(fields: Any, where: str) -> torch.Tensor:
    if not (isinstance(fields, list) and len(fields) == 3 and isinstance(fields[0], str)):
        raise FormatError(f"{where}: a {TENSOR_TAG} entry must be [dtype, shape, bytes]")
    name, shape, data = fields
    if name not in FORMAT_TO_TORCH:
        raise FormatError(f"{where}: unknown tensor dtype {name!r}")
    if not isinstance(shape, list):
        raise FormatError(f"{where}: tensor shape {shape!r} is not a list of non-negative integers")
    check_shape(shape, f"{where}: tensor")  # the bounds of a tensor's shape (SPEC 6), before torch allocates it
    dtype = FORMAT_TO_TORCH[name]
    if not isinstance(data, bytes) or len(data) != math.prod(shape) * torch.empty((), dtype=dtype).element_size():
        raise FormatError(f"{where}: {type(data).__name__} of the wrong size for a {name} tensor of shape {shape}")
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


@dataclass
class StagedShard:
    """A DTensor's local box copied to host memory for a background save (see staging.py)."""

    local: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    writes: bool
    shardckpt_leaf = True


@dataclass
class SaveItems:
    pieces: list[tuple[str, torch.Tensor, dict[str, Any]]] = field(default_factory=list)  # (name, tensor, add kwargs)
    objects: list[tuple[str, Any, bool]] = field(default_factory=list)  # (name, value, per_rank)


def save_items(leaves: list[Leaf], rank: int, world_size: int) -> SaveItems:
    """What `rank` writes: its DTensor boxes, its share of the replicated tensors, its flat pieces, objects."""
    items = SaveItems()
    replicated: list[tuple[str, torch.Tensor]] = []
    for leaf in leaves:
        value = leaf.value
        if is_dtensor(value):
            box = local_box(leaf.name, value)
            if box.writes:
                items.pieces.append((leaf.name, box.local, {"global_shape": box.global_shape, "offsets": box.offsets}))
        elif isinstance(value, StagedShard):
            if value.writes:
                items.pieces.append(
                    (leaf.name, value.local, {"global_shape": value.global_shape, "offsets": value.offsets})
                )
        elif isinstance(value, torch.Tensor):
            replicated.append((leaf.name, value))
        elif isinstance(value, FlatPartition):
            for name, shape, first, piece in value.slices():
                items.pieces.append((name, piece, {"global_shape": shape, "flat_offset": first}))
        elif isinstance(value, PerRank):
            items.objects.append((leaf.name, per_rank_plain(value.value), True))
        else:
            items.objects.append((leaf.name, value, False))
    # Greedy balance, largest first, identical on every rank (same names and sizes everywhere).
    load = [0] * world_size
    for name, tensor in sorted(replicated, key=lambda item: (-item[1].numel() * item[1].element_size(), item[0])):
        writer = min(range(world_size), key=lambda r: (load[r], r))
        load[writer] += max(tensor.numel() * tensor.element_size(), 1)
        if writer == rank:
            items.pieces.append((name, tensor, {}))
    return items


def check_savable(leaves: list[Leaf], step: object = None) -> None:
    """Refuse, naming the entry, what a save could not store, before any byte is written: a step that is not an
    integer, tensors without dense data (sparse, nested, meta) or of a dtype the format lacks, values that are
    not plain data (PerRank values: tensors allowed)."""
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or not -(1 << 63) <= step < 1 << 63):
        raise ShardckptUsageError(f"step must be an integer (64-bit) or None, got {type(step).__name__} {step!r}")
    for leaf in leaves:
        value = leaf.value
        if is_dtensor(value):
            check_tensor(leaf.name, value.to_local(), "DTensor whose local shard is ")
        elif isinstance(value, StagedShard):
            check_tensor(leaf.name, value.local)
        elif isinstance(value, torch.Tensor):
            check_tensor(leaf.name, value)
        elif isinstance(value, FlatPartition):
            check_tensor(leaf.name, value.buffer, "flat partition whose buffer is ")
        elif isinstance(value, PerRank):
            _check_per_rank(leaf.name, value.value)
        else:
            check_plain(value, f"object {leaf.name!r}")


def check_tensor(name: str, tensor: torch.Tensor, kind: str = "") -> None:
    """ShardckptUsageError naming `name` unless `tensor` has dense, readable elements of a storable dtype."""
    check_dense(name, tensor, kind)
    if tensor.dtype not in TORCH_TO_FORMAT:
        raise ShardckptUsageError(
            f"tensor {name!r}: dtype {tensor.dtype} cannot be stored (supported: "
            f"{sorted(str(d).removeprefix('torch.') for d in TORCH_TO_FORMAT)})"
        )


def _check_per_rank(name: str, value: Any) -> None:
    """Tensors inside a PerRank value are checked as tensors; everything else must be plain data."""
    tensors: list[torch.Tensor] = []

    def without_tensors(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            tensors.append(item)
            return None
        if isinstance(item, dict):
            return {key: without_tensors(part) for key, part in item.items()}
        if isinstance(item, (list, tuple)):
            return [without_tensors(part) for part in item]
        return item

    plain = without_tensors(value)
    for tensor in tensors:
        check_tensor(name, tensor, "per-rank ")
    check_plain(plain, f"per-rank object {name!r}")


def destination_shapes(leaves: list[Leaf]) -> list[tuple[str, tuple[int, ...], str]]:
    """(tensor name, global shape, kind) of every tensor destination: a load fills whole tensors only, so each
    global shape must be the stored one (a sub-box is Checkpoint.read's job)."""
    shapes: list[tuple[str, tuple[int, ...], str]] = []
    for leaf in leaves:
        value = leaf.value
        if is_dtensor(value):
            shapes.append((leaf.name, tuple(int(d) for d in value.shape), "DTensor"))
        elif isinstance(value, torch.Tensor):
            check_destination(leaf.name, value)  # a nested tensor has no shape to compare
            shapes.append((leaf.name, tuple(value.shape), "tensor"))
        elif isinstance(value, FlatPartition):
            shapes.extend((name, tuple(shape), "flat partition") for name, shape in value.params)
    return shapes


def load_items(leaves: list[Leaf]) -> list[tuple[str, Box, torch.Tensor]]:
    """(tensor name, box, destination) for every tensor this rank holds: its shards, whole tensors, flat slices."""
    items: list[tuple[str, Box, torch.Tensor]] = []
    for leaf in leaves:
        value = leaf.value
        if is_dtensor(value):
            box = local_box(leaf.name, value)
            items.append((leaf.name, Box(box.offsets, tuple(box.local.shape)), box.local))
        elif isinstance(value, torch.Tensor):
            check_destination(leaf.name, value)  # a nested tensor has no shape to compare
            items.append((leaf.name, Box.full(tuple(value.shape)), value))
        elif isinstance(value, FlatPartition):
            items.extend(value.boxes())
    return items
