"""torch_checkpointing's read-side seams for shardckpt checkpoints: a `DistributedMetadataFormat` that recognises a
committed shardckpt checkpoint and a `Resharder` that fills each item through `shardckpt.load`, on any world size.

Every byte is checked as in any shardckpt load (COMMITTED, manifest checksums, block CRCs); nothing is unpickled.
An item is the first component of a stored name: `shardckpt.save({"model": sd, "optim": osd}, url)` holds the items
"model" and "optim". For checkpoints in torch_checkpointing's own format the resharder hands each call to its
fallback (DefaultResharder), so one `ItemSpec` serves both formats.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

import torch
from torch_checkpointing.default_resharder import DefaultResharder
from torch_checkpointing.distributed_metadata import (
    DistributedItemMetadata,
    DistributedMetadata,
    GlobalObjectMetadata,
    ShardingMetadata,
)
from torch_checkpointing.dtensor_metadata import DTensorShardingMetadata
from torch_checkpointing.metadata_serialization import DistributedMetadataFormat
from torch_checkpointing.resharding import Resharder
from torch_checkpointing.storage.base_storage import Storage
from torch_checkpointing.types import NestedPath

from shardckpt.distributed.protocol import load as shardckpt_load
from shardckpt.errors import ShardckptUsageError
from shardckpt.format import layout
from shardckpt.read.checkpoint import open_checkpoint
from shardckpt.storage.base import Storage as Backend

from .storage import ShardckptStorage

# The nested path under which the two marks below travel in torch_checkpointing's metadata dictionaries.
MARK: NestedPath = ("__shardckpt__",)


class _Mark(ShardingMetadata, type_name="shardckpt.Mark"):
    """A mark with no data: what it says is its type."""

    def to_dict(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> _Mark:
        return cls()

    @property
    def equivalent_ranks(self) -> tuple[int, ...] | None:
        return None

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(type(self).__name__)


class ShardckptSource(_Mark, type_name="shardckpt.Source"):
    """Marks an item's source metadata as a shardckpt checkpoint's (its boxes live in shardckpt's own manifests)."""


class ShardckptTarget(_Mark, type_name="shardckpt.Target"):
    """Marks a target as loadable through shardckpt. torch_checkpointing skips (with a warning only) any item whose
    target metadata is empty, as it is for a dict of plain values: this entry keeps every item in the load."""


def location(checkpoint_dir: Path, storage: Storage) -> str | Backend:
    """What shardckpt opens for `checkpoint_dir` read through `storage`: the same backend (and its options) when
    it is shardckpt's, else the path or URL the storage maps it to (torch_checkpointing's local backend: the path)."""
    if isinstance(storage, ShardckptStorage):
        return storage.backend_at(checkpoint_dir)
    return storage.remap_path(checkpoint_dir)


def is_shardckpt(checkpoint_dir: str | os.PathLike[str], storage: Storage) -> bool:
    """Whether `checkpoint_dir` holds a committed shardckpt checkpoint (its COMMITTED marker)."""
    return storage.exists(Path(checkpoint_dir) / layout.COMMITTED)


class ShardckptFormat(DistributedMetadataFormat):
    """`CheckpointManager.load(..., metadata_format=ShardckptFormat)`: read a shardckpt checkpoint.

    The metadata comes from shardckpt's own COMMITTED marker and global manifest, checked as every shardckpt load
    checks them (a damaged one is a ShardckptError, never a fall-through to another format)."""

    @classmethod
    def maybe_load(cls, checkpoint_dir: Path, storage: Storage) -> DistributedMetadata | None:
        if not is_shardckpt(checkpoint_dir, storage):
            return None
        checkpoint = open_checkpoint(location(checkpoint_dir, storage))
        names = [*checkpoint.tensors, *checkpoint.objects]
        world_size = checkpoint.manifest.world_size
        every_rank = tuple(range(world_size))
        source = [GlobalObjectMetadata(sharding_metadata=ShardckptSource(), ranks=every_rank)]
        items = sorted({name.split(".", 1)[0] for name in names})
        return DistributedMetadata(
            metadata={
                item: DistributedItemMetadata(
                    nested_path_to_metadata={MARK: source}, rank_to_layout_info=dict.fromkeys(every_rank)
                )
                for item in items
            },
            world_size=world_size,
        )


def _from_shardckpt(source_metadata: DistributedItemMetadata | None) -> bool:
    if source_metadata is None:
        return False
    return any(
        isinstance(g.sharding_metadata, ShardckptSource) for g in source_metadata.nested_path_to_metadata.get(MARK, ())
    )


class ShardckptResharder(Resharder):
    """Loads an item of a shardckpt checkpoint into its live target on any world size and sharding (DTensors,
    FSDP2, plain tensors, nested dicts of plain values), through `shardckpt.load` over the default process group.

    For a checkpoint in torch_checkpointing's own format every call goes to `fallback` (DefaultResharder()).
    strict: every entry of the target must be in the checkpoint (shardckpt.load's strict). cast: see shardckpt.load.
    """

    def __init__(
        self, *, fallback: Resharder | None = None, process_group: Any = None, strict: bool = True, cast: bool = False
    ) -> None:
        self.fallback = fallback if fallback is not None else DefaultResharder()
        self.process_group, self.strict, self.cast = process_group, strict, cast

    def extract_sharding_metadata(self, item_key: str, item_value: Any) -> dict[NestedPath, ShardingMetadata]:
        found = dict(self.fallback.extract_sharding_metadata(item_key, item_value))
        found[MARK] = ShardckptTarget()
        return found

    def should_reshard(
        self,
        source_metadata: DistributedItemMetadata | None,
        target_metadata: dict[NestedPath, ShardingMetadata] | None,
    ) -> bool:
        if _from_shardckpt(source_metadata):
            return True  # its files are shardckpt's: only this resharder can read them, on any layout
        return self.fallback.should_reshard(source_metadata, _without_mark(target_metadata))

    def load(
        self,
        source_path: Path,
        item_key: str,
        target_metadata: dict[NestedPath, ShardingMetadata],
        source_metadata: DistributedItemMetadata,
        target: Any,
        storage: Storage,
    ) -> list[NestedPath]:
        if not _from_shardckpt(source_metadata):
            _check_shapes(item_key, target_metadata, source_metadata, source_path)
            unhandled = self.fallback.load(
                source_path, item_key, _without_mark(target_metadata) or {}, source_metadata, target, storage
            )
            return [path for path in unhandled if path != MARK]
        if not isinstance(target, (Mapping, torch.Tensor)):
            raise ShardckptUsageError(
                f"item {item_key!r} is a plain {type(target).__name__}: torch_checkpointing gives a resharder no "
                "way to replace it; keep plain values inside a dict item (e.g. {'train': {'step': 5}})"
            )
        holder = {item_key: target}
        shardckpt_load(
            holder,
            location(source_path, storage),
            process_group=self.process_group,
            strict=self.strict,
            cast=self.cast,
        )
        loaded = holder[item_key]
        if loaded is not target:
            # A plain-valued item is stored (and so restored) whole: refill the caller's dict, which is the object
            # torch_checkpointing hands back, instead of replacing it in a dictionary nobody sees.
            if not isinstance(target, MutableMapping) or not isinstance(loaded, Mapping):
                raise ShardckptUsageError(
                    f"item {item_key!r}: the checkpoint holds a {type(loaded).__name__}, the target is a "
                    f"{type(target).__name__}"
                )
            target.clear()
            target.update(loaded)
        return []


def _check_shapes(
    item_key: str,
    target_metadata: dict[NestedPath, ShardingMetadata] | None,
    source_metadata: DistributedItemMetadata | None,
    source_path: Path,
) -> None:
    """Refuse a target tensor whose global shape is not the stored one, before anything is read: the fallback
    (DefaultResharder) fills the intersection of the two boxes, so a smaller target would get a corner, a larger one
    a corner with its old values around it, another rank count of dimensions nothing, all without an error."""
    if target_metadata is None or source_metadata is None:
        return
    for path, target in target_metadata.items():
        if path == MARK or not isinstance(target, DTensorShardingMetadata):
            continue
        for stored in source_metadata.nested_path_to_metadata.get(path, ()):
            found = stored.sharding_metadata
            if isinstance(found, DTensorShardingMetadata) and tuple(found.global_shape) != tuple(target.global_shape):
                raise ShardckptUsageError(
                    f"item {item_key!r}, tensor {'.'.join(map(str, path))!r} of {source_path}: the target has global "
                    f"shape {list(target.global_shape)}, the checkpoint holds shape {list(found.global_shape)}; a "
                    "load fills whole tensors"
                )


def _without_mark(
    metadata: dict[NestedPath, ShardingMetadata] | None,
) -> dict[NestedPath, ShardingMetadata] | None:
    if metadata is None:
        return None
    return {path: value for path, value in metadata.items() if path != MARK}
