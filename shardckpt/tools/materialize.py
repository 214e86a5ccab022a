"""A self-contained copy of a checkpoint: every piece, those an incremental checkpoint stores by reference in its
parents included, read (and verified) and written into data files of the copy itself, then committed.

The copy keeps the world size, every piece's box and rank, the shared and per-rank values, the step and metadata.
"""

from __future__ import annotations

from typing import Any

import torch

from shardckpt.errors import AlreadyExistsError, ShardckptUsageError
from shardckpt.format import layout
from shardckpt.format.manifest import GlobalManifest, TensorEntry
from shardckpt.ops.copy import check_destination, inside
from shardckpt.read.checkpoint import Checkpoint, open_checkpoint
from shardckpt.storage import open_storage
from shardckpt.torch_bytes import torch_dtype
from shardckpt.write.commit import already_committed, commit
from shardckpt.write.writer import ShardWriter


def materialize(
    source: str,
    destination: str,
    *,
    storage_options: dict[str, Any] | None = None,
    destination_options: dict[str, Any] | None = None,
) -> GlobalManifest:
    """Write the checkpoint at `source` to `destination` (a new URL) holding all its pieces; its global manifest.

    Reads each piece from wherever it is stored (block checksums verified as any load does) and holds at most one
    piece at a time, or one whole tensor of the flat layout (ZeRO partitions); the copy's COMMITTED is its last write.
    """
    checkpoint = open_checkpoint(source, storage_options=storage_options)
    dst = open_storage(destination, storage_options if destination_options is None else destination_options)
    if inside(dst, checkpoint.storage):
        raise ShardckptUsageError(
            f"cannot copy {checkpoint.url} into itself ({dst.url}): choose a destination outside it"
        )
    if dst.exists(layout.COMMITTED):
        raise AlreadyExistsError(already_committed(dst.url))
    check_destination(dst)  # not a root of other checkpoints, nor a half-written one
    manifest = checkpoint.manifest
    world = manifest.world_size
    attempt = layout.new_attempt()
    writers = [
        ShardWriter(
            dst,
            rank=rank,
            world_size=world,
            attempt=attempt,
            block_size=manifest.block_size,
            step=manifest.step,
            piece_hashes=True if manifest.references else None,  # a series' member stays a usable parent
            compression=_codec(checkpoint, rank),
        )
        for rank in range(world)
    ]
    for entry in manifest.tensors:
        _copy_tensor(checkpoint, entry, writers)
    for name, value in checkpoint.objects.items():
        writers[0].add_object(name, value)
    for rank in range(world):
        for name, value in checkpoint.rank_objects(rank).items():
            writers[rank].add_object(name, value, per_rank=True)
    for writer in writers:
        writer.close()
    return commit(dst, world_size=world, attempt=attempt, step=manifest.step, metadata=manifest.metadata or None)


def _codec(checkpoint: Checkpoint, rank: int) -> str | None:
    """The codec of rank `rank`'s data file (None: raw), so that the copy of a compressed file stays compressed
    (SPEC 4.1), pieces it held by reference included, and the copy of a raw one stays raw."""
    if checkpoint.manifest.files[rank].logical_size is None:
        return None
    blocks = checkpoint.file_index(rank).blocks
    return None if blocks is None else blocks.table.codec


def _copy_tensor(checkpoint: Checkpoint, entry: TensorEntry, writers: list[ShardWriter]) -> None:
    """Each piece of `entry` to the writer of the rank that held it (a referenced piece: the rank whose manifest
    lists it), so the copy's pieces are the original's."""
    manifest = checkpoint.manifest
    whole: torch.Tensor | None = None
    if entry.pieces.count == 0:  # an empty tensor has no piece: declared by a rank all the same (SPEC 6.1)
        writers[0].add(entry.name, torch.empty(entry.shape, dtype=torch_dtype(entry.dtype)))
    for number in range(entry.pieces.count):
        file, _, start, length = entry.pieces.piece(number)
        files = manifest.files
        owner = files[file].rank if file < len(files) else manifest.references[file - len(files)].rank
        writer = writers[owner]
        if entry.layout == "flat":
            if whole is None:
                whole = checkpoint.read(entry.name).reshape(-1)
            writer.add(
                entry.name, whole[start[0] : start[0] + length[0]], global_shape=entry.shape, flat_offset=start[0]
            )
        else:
            piece = checkpoint.read(entry.name, offsets=list(start), shape=list(length))
            writer.add(entry.name, piece, global_shape=entry.shape, offsets=list(start))
