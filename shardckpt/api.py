"""What training loops call: save, load, latest (and open/commit re-exported by the package).

A single process saves as rank 0 of 1; the distributed layer adds process groups on top of the same steps.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from shardckpt.coordinator import commit
from shardckpt.errors import AlreadyExistsError, ShardckptError, ShardckptUsageError
from shardckpt.format import layout
from shardckpt.format.limits import DEFAULT_BLOCK_SIZE
from shardckpt.format.manifest import CommitMarker, GlobalManifest
from shardckpt.planner import Box
from shardckpt.restorer import DEFAULT_MAX_IN_FLIGHT, Checkpoint, ReadStats, open_checkpoint, read_commit_marker
from shardckpt.state import flatten
from shardckpt.storage import Storage, open_storage
from shardckpt.writer import ShardWriter


def _check_single_process(process_group: Any) -> None:
    if process_group is None:
        return
    size = process_group.size() if hasattr(process_group, "size") else None
    if size != 1:
        raise ShardckptUsageError(
            f"this release saves and loads in one process; a process group of {size} ranks is not supported yet"
        )


def save(
    state_dict: Mapping[str, Any],
    url: str | Storage,
    *,
    process_group: Any = None,
    storage_options: dict[str, Any] | None = None,
    step: int | None = None,
    metadata: dict[str, Any] | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> GlobalManifest:
    """Save tensors and plain values of `state_dict` as a committed checkpoint at `url` (a new location)."""
    _check_single_process(process_group)
    storage = open_storage(url, storage_options)
    if storage.exists(layout.COMMITTED):
        raise AlreadyExistsError(f"{storage.url} already holds a committed checkpoint; save to a new URL")
    attempt = layout.new_attempt()
    writer = ShardWriter(storage, rank=0, world_size=1, attempt=attempt, block_size=block_size, step=step)
    for leaf in flatten(state_dict):
        if leaf.is_tensor:
            writer.add(leaf.name, leaf.value)
        else:
            writer.add_object(leaf.name, leaf.value)
    writer.close()
    return commit(storage, world_size=1, attempt=attempt, step=step, metadata=metadata)


def load(
    state_dict: Mapping[str, Any],
    url: str | Storage,
    *,
    process_group: Any = None,
    storage_options: dict[str, Any] | None = None,
    strict: bool = True,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
) -> ReadStats:
    """Fill the tensors of `state_dict` in place from the checkpoint at `url` and restore its plain values.

    strict: every entry of `state_dict` must be in the checkpoint. If a read fails its checksum, tensors
    filled by earlier reads of the same call already hold checkpoint data; others are untouched.
    """
    _check_single_process(process_group)
    checkpoint = open_checkpoint(url, storage_options=storage_options, max_in_flight=max_in_flight)
    objects = {**checkpoint.rank_objects(0), **checkpoint.objects}
    stored = checkpoint.manifest.tensor_index()
    leaves = flatten(state_dict)
    missing = [leaf.name for leaf in leaves if leaf.name not in (stored if leaf.is_tensor else objects)]
    if missing and strict:
        raise ShardckptUsageError(
            f"{checkpoint.url} lacks {len(missing)} entries of the state dict: {missing[:10]}"
            + (" ..." if len(missing) > 10 else "")
        )
    items = [
        (leaf.name, Box.full(tuple(leaf.value.shape)), leaf.value)
        for leaf in leaves
        if leaf.is_tensor and leaf.name in stored
    ]
    for name, box, _ in items:
        if box.shape != stored[name].shape:
            raise ShardckptUsageError(
                f"tensor {name!r}: the state dict holds shape {list(box.shape)}, the checkpoint "
                f"{list(stored[name].shape)}"
            )
    stats = checkpoint.read_into(items)
    for leaf in leaves:
        if not leaf.is_tensor and leaf.name in objects:
            leaf.assign(objects[leaf.name])
    return stats


def latest(root_url: str | Storage, *, storage_options: dict[str, Any] | None = None) -> str | None:
    """URL of the newest committed checkpoint directly under `root_url` (by step, then time), or None."""
    root = open_storage(root_url, storage_options)
    best: tuple[tuple[int, int, float], str] | None = None
    for name in root.list():
        child = root.child(name)
        try:
            marker: CommitMarker | None = read_commit_marker(child)
        except ShardckptError as exc:
            warnings.warn(f"skipping {child.url}: {exc}", stacklevel=2)
            continue
        if marker is None:
            continue
        key = (marker.step is not None, marker.step or 0, marker.created)
        if best is None or key > best[0]:
            best = (key, child.url)
    return None if best is None else best[1]


__all__ = ["Checkpoint", "latest", "load", "save"]
