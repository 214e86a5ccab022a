"""shardckpt as a torch.distributed.checkpoint StorageReader: dcp.load reads a committed shardckpt checkpoint.

(all) read_metadata: COMMITTED and the manifest, once, rebuilt as DCP's Metadata (chunks = stored pieces) ->
DCP plans the overlaps -> (all) read_data: every ReadItem a box, all planned, coalesced and verified together.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader as _DCPStorageReader
from torch.futures import Future

from shardckpt.catalog.chain import Opening, read_opening
from shardckpt.dcp.naming import Path, dcp_entries, value_at
from shardckpt.dcp.writer import DCP_PATHS, checkpoint_url
from shardckpt.errors import FormatError, ShardckptError
from shardckpt.format.manifest import GlobalManifest, TensorEntry
from shardckpt.planner import Box
from shardckpt.read.checkpoint import Checkpoint, ReadStats
from shardckpt.statedict.leaves import TENSOR_TAG, per_rank_value
from shardckpt.storage import open_storage
from shardckpt.torch_bytes import torch_dtype


class StorageReader(_DCPStorageReader):
    """`dcp.load(state, storage_reader=shardckpt.dcp.StorageReader(url))` fills `state` from a checkpoint at `url`.

    Written by shardckpt.save or by dcp.save through StorageWriter; any world size, DCP's resharding and casts.
    `stats` adds up what this rank's loads needed and fetched (bytes, requests).
    """

    def __init__(self, url: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.url = checkpoint_url(url)
        self.storage_options = dict(storage_options) if storage_options else None
        self.stats = ReadStats(0, 0, 0, 0.0)
        self._opening: Opening | None = None
        self._values: dict[str, tuple[str, Path]] = {}  # DCP entry -> (object, path in its value)
        self._per_rank: dict[str, tuple[str, Path]] = {}  # likewise, for objects each rank saved for itself
        self._rank: int | None = None  # this rank in the group dcp.load runs on: whose per-rank value it gets

    @property
    def checkpoint_id(self) -> str:
        return self.url

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.url = checkpoint_url(checkpoint_id)
        self._opening = None
        self._values, self._per_rank = {}, {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def read_metadata(self) -> Metadata:
        """(all) COMMITTED and the global manifest, read and checked once, as DCP's Metadata."""
        self._opening = opening = read_opening(open_storage(self.url, self.storage_options))
        manifest = opening.manifest
        tensors = manifest.tensor_index()
        self._values, self._per_rank = _value_entries(manifest, set(tensors), self.url)
        entries = _Entries(tensors, (*self._values, *self._per_rank))
        return Metadata(
            state_dict_metadata=entries,  # type: ignore[arg-type]  # a Mapping: DCP reads it only
            planner_data=_planner_data(manifest, entries, self.url),
            storage_meta=StorageMeta(checkpoint_id=self.url),
        )

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")  # DCP passes the rank in dcp.load's group to a reader that takes keywords
        self._rank = rank if isinstance(rank, int) else None

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """(all) Plain values as bytes made here from the stored values; every tensor box read in one plan."""
        storage = open_storage(self.url, self.storage_options)
        opening = self._opening if self._opening is not None else read_opening(storage)
        checkpoint = Checkpoint(storage, opening.marker, opening.manifest)
        objects = checkpoint.objects
        boxes: list[tuple[str, Box, torch.Tensor]] = []
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        targets: list[tuple[ReadItem, torch.Tensor]] = []
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                value = self._value_bytes(item.storage_index.fqn, objects, opening.manifest)
                if value is not None:
                    planner.load_bytes(item, value)
                continue
            name = item.storage_index.fqn
            box = _box(item)
            target = planner.resolve_tensor(item).detach()
            if tuple(target.shape) != box.shape:
                raise ShardckptError(
                    f"{self.url}: tensor {name!r}: the planner's destination has shape {list(target.shape)} for a "
                    f"read of shape {list(box.shape)}"
                )
            targets.append((item, target))
            if math.prod(box.shape) == 0:
                continue
            stored = torch_dtype(checkpoint.entry(name).dtype)
            destination = target
            if target.dtype != stored and not (target.dtype.is_floating_point and stored.is_floating_point):
                # DCP casts any dtype with copy_; the reader casts floating-point ones itself (cast=True).
                destination = torch.empty(box.shape, dtype=stored)
                staged.append((target, destination))
            boxes.append((name, box, destination))
        stats = checkpoint.prepare(boxes, cast=True).apply()
        for target, staging in staged:
            target.copy_(staging)
        for item, target in targets:
            planner.commit_tensor(item, target)
        previous = self.stats
        self.stats = ReadStats(
            previous.needed_bytes + stats.needed_bytes,
            previous.fetched_bytes + stats.fetched_bytes,
            previous.requests + stats.requests,
            previous.seconds + stats.seconds,
        )
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _value_bytes(self, entry: str, objects: dict[str, Any], manifest: GlobalManifest) -> io.BytesIO | None:
        """What DCP's planner unpickles for a plain entry: bytes this reader makes from the stored value. A per-rank
        value is this rank's own; None (the destination keeps its value, as shardckpt.load's PerRank default)
        where this rank saved none (the checkpoint was saved on fewer ranks)."""
        if entry in self._per_rank:
            name, path = self._per_rank[entry]
            mine = [o.value for o in manifest.objects if o.name == name and o.rank == self._rank]
            if not mine:
                return None
            where = f"{self.url}: object {name!r} of rank {self._rank}"
            value = per_rank_value(value_at(mine[0], path, where), where)
        elif entry in self._values:
            name, path = self._values[entry]
            value = value_at(objects[name], path, f"{self.url}: object {name!r}")
        else:
            raise ShardckptError(f"{self.url}: no plain value is stored for DCP entry {entry!r}")
        buffer = io.BytesIO()
        torch.save(value, buffer)
        buffer.seek(0)
        return buffer


class _Entries(Mapping[str, "TensorStorageMetadata | BytesStorageMetadata"]):
    """DCP's state_dict_metadata: every name at once (DCP's planner takes the set of all), each tensor's chunks (one
    per stored piece: 14 M objects, ~2 min of CPU, for a per-expert DeepSeek-V3 saved on 4,096 ranks) made when
    the planner first asks for that tensor, so a rank builds those of the tensors it loads."""

    def __init__(self, tensors: Mapping[str, TensorEntry], values: Sequence[str]) -> None:
        self._tensors, self._values = tensors, dict.fromkeys(values)
        self._made: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}

    def __getitem__(self, name: str) -> TensorStorageMetadata | BytesStorageMetadata:
        found = self._made.get(name)
        if found is None:
            entry = self._tensors.get(name)
            if entry is not None:
                found = _tensor_metadata(entry.name, entry.dtype, entry.shape, entry.layout, entry.pieces)
            elif name in self._values:
                found = BytesStorageMetadata()
            else:
                raise KeyError(name)
            self._made[name] = found
        return found

    def __contains__(self, name: object) -> bool:
        return name in self._tensors or name in self._values

    def __iter__(self) -> Iterator[str]:
        yield from self._tensors
        yield from self._values

    def __len__(self) -> int:
        return len(self._tensors) + len(self._values)


def _tensor_metadata(name: str, dtype: str, shape: tuple[int, ...], layout: str, pieces: Any) -> TensorStorageMetadata:
    """A tensor as DCP describes it: its stored box pieces as chunks; a tensor stored flat as one chunk."""
    if layout == "box":
        chunks = [
            ChunkStorageMetadata(offsets=torch.Size(start), sizes=torch.Size(length))
            for start, length in zip(pieces.start.tolist(), pieces.length.tolist())
        ]
    else:  # flat ranges are not boxes: DCP asks for boxes of the whole, the planner finds the ranges
        chunks = [ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=torch.Size(shape))]
    return TensorStorageMetadata(TensorProperties(dtype=torch_dtype(dtype)), torch.Size(shape), chunks)


def _value_entries(
    manifest: GlobalManifest, tensors: set[str], url: str
) -> tuple[dict[str, tuple[str, Path]], dict[str, tuple[str, Path]]]:
    """DCP's names of the parts of every plain value (SPEC 7 "Names"): shared ones, and per-rank ones (each rank's
    value under the same names; a tensor in one is a tagged map, one entry). A name used twice is a FormatError."""
    shared: dict[str, tuple[str, Path]] = {}
    per_rank: dict[str, tuple[str, Path]] = {}
    for entry in manifest.objects:
        found = per_rank if entry.rank is not None else shared
        for name, path in dcp_entries(entry.name, entry.value, _tagged_tensor if entry.rank is not None else None):
            taken = name in tensors or name in (per_rank if found is shared else shared)
            if taken or found.get(name, (entry.name, path)) != (entry.name, path):
                raise FormatError(f"{url}: DCP entry {name!r} of object {entry.name!r} names another entry too")
            found[name] = (entry.name, path)
    return shared, per_rank


def _planner_data(manifest: GlobalManifest, entries: Mapping[str, Any], url: str) -> dict[str, tuple[str | int, ...]]:
    """DCP's flatten mapping (entry -> key path), which its empty-state-dict planner nests a full load by: as
    dcp.save through StorageWriter recorded it; entries it does not name are their own one-key path."""
    recorded = manifest.metadata.get(DCP_PATHS, {})
    if not isinstance(recorded, dict):
        raise FormatError(f"{url}: manifest metadata {DCP_PATHS!r} is not a map of entry -> key path")
    paths: dict[str, tuple[str | int, ...]] = {name: (name,) for name in entries}
    for name, path in recorded.items():
        if name not in entries:
            continue  # a value that was not stored (an empty map DCP drops)
        valid = isinstance(path, list) and path and all(isinstance(step, (str, int)) for step in path)
        if not valid:
            raise FormatError(f"{url}: manifest metadata {DCP_PATHS!r}: entry {name!r} has no key path")
        paths[name] = tuple(path)
    # DCP nests by these paths (set_element): one that is another's prefix, or two alike, would fail inside torch.
    ordered = sorted(paths.items(), key=lambda item: [(isinstance(step, int), str(step)) for step in item[1]])
    for (first, a), (second, b) in zip(ordered, ordered[1:]):
        if b[: len(a)] == a:
            raise FormatError(f"{url}: manifest metadata {DCP_PATHS!r}: entries {first!r} and {second!r} nest at once")
    return paths


def _tagged_tensor(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {TENSOR_TAG}


def _box(item: ReadItem) -> Box:
    """The stored box a ReadItem asks for: its chunk's offsets plus the offsets within the chunk."""
    chunk = item.storage_index.offset
    if chunk is None:
        raise ShardckptError(f"DCP read item for {item.storage_index.fqn!r} names no chunk")
    offsets = tuple(int(c) + int(o) for c, o in zip(chunk, item.storage_offsets))
    return Box(offsets, tuple(int(n) for n in item.lengths))


def full_state_dict(url: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything a checkpoint holds as one nested state dict of full tensors, in this process (no process group):
    what format_utils.dcp_to_torch_save loads from a DCP directory, for a shardckpt checkpoint. DCP picks its own
    reader for a bare checkpoint_id, so dcp.load of a shardckpt URL takes storage_reader=StorageReader(url)."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    reader = StorageReader(url, storage_options=storage_options)
    reader.read_metadata()  # its errors as they are: DCP turns one in read_metadata into an AssertionError
    try:
        _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)  # type: ignore[no-untyped-call]
    except CheckpointException as exc:  # a BaseException wrapping each rank's cause: raise ours as itself
        ours = [cause for cause, _ in exc.failures.values() if isinstance(cause, ShardckptError)]
        if ours:
            raise ours[0] from None
        raise
    return state
