"""The parent of an incremental save (SPEC 6.2, 6.3, 9): its pieces with their recorded hashes, found by identity,
and the re-check of every referenced checkpoint that a save makes just before it commits.

A piece is referenced only when the parent records a hash equal to the new bytes' hash for the same tensor name,
dtype, shape, layout and box, with the algorithm this save computes (a parent hashed otherwise references nothing);
the reference names the file that physically holds the bytes, never the parent's own reference to it (no chains).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from shardckpt.catalog.chain import read_commit_marker, read_index_entries, read_opening
from shardckpt.catalog.identity import home, same_place
from shardckpt.errors import FormatError, IntegrityError, NotCommittedError, ShardckptUsageError
from shardckpt.format import limits
from shardckpt.format.compressed import BlockMap
from shardckpt.format.local_manifest import LocalManifest, decode_local_manifest
from shardckpt.format.manifest import FileEntry, GlobalManifest, crc32c_of
from shardckpt.format.references import (
    HASH_ALG,
    HASH_BYTES,
    ReferencedFile,
    ReferencePath,
    check_checkpoint_name,
    compressed_rows,
)
from shardckpt.storage import Storage, open_storage

# What makes two pieces the same piece: name, dtype, global shape, layout, start, length.
PieceKey = tuple[str, str, tuple[int, ...], str, tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class Holder:
    """Where a parent's piece physically lies, with the holder's block checksums and recorded hash."""

    file: ReferencedFile
    offset: int
    nbytes: int
    block_size: int
    crc32c: np.ndarray  # the piece's blocks of `block_size`, as the holder (or the parent's reference) records them
    digest: bytes
    # Format 1.2, a compressed holder (SPEC 6.2): the file byte of the piece's first stored block, every block's
    # stored size and logical CRC32C; `crc32c` then holds the STORED bytes' checksums.
    stored_offset: int | None = None
    stored: np.ndarray | None = None
    logical_crc32c: np.ndarray | None = None


@dataclass(frozen=True)
class ParentPieces:
    """The committed parent `name` (attempt `attempt`) of a save: the pieces one rank may reference, by identity."""

    name: str
    attempt: str
    holders: dict[PieceKey, Holder]
    root: Storage | None = None  # where the holder files lie (their paths are relative to it); None: not checked


def split_url(url: str) -> tuple[str, str]:
    """(root URL, checkpoint name) of a checkpoint URL: its parent directory and its last path component."""
    stripped = url.rstrip("/")
    if "/" not in stripped:
        raise ShardckptUsageError(f"{url!r} has no parent directory: an incremental save needs ROOT/NAME urls")
    root, name = stripped.rsplit("/", 1)
    return root, name


def parent_of(url: str, parent: str, storage_options: dict[str, object] | None = None) -> tuple[Storage, str]:
    """The root storage and the parent's checkpoint name, after checking the parent is a sibling of `url`.

    Both are taken where they really lie (catalog.identity.home): a parent spelled through a link to a checkpoint of
    the root is recorded under the name the root lists it by, so that an alias that moves, or a collector that
    keeps only what references name, never strands the new checkpoint; a parent that lies in another root is
    refused (that root's collector would delete what this checkpoint needs)."""
    split_url(str(url)), split_url(str(parent))  # ROOT/NAME urls, or a usage error naming the url
    root, own_name = home(open_storage(str(url), storage_options))
    parent_root, name = home(open_storage(str(parent), storage_options))
    if not same_place(parent_root, root):
        raise ShardckptUsageError(
            f"parent {parent} is {parent_root.url}/{name}, not in the root of {url} ({root.url}): references never "
            f"leave their root (the other root's collector would delete what this checkpoint needs); copy the "
            f"parent into {root.url} and name that copy, or save without a parent (a full save)"
        )
    try:
        check_checkpoint_name(name)
    except FormatError as exc:
        raise ShardckptUsageError(f"parent {parent}: {exc}") from None
    if name == own_name:
        raise ShardckptUsageError(f"parent {parent} is the checkpoint being saved")
    return root, name


Boxes = Mapping[str, Collection[tuple[tuple[int, ...], tuple[int, ...]]]]  # (start, length) by tensor


def open_parent(root: Storage, name: str, tensors: Collection[str], boxes: Boxes | None = None) -> ParentPieces:
    """Open the committed checkpoint `name` of `root` (COMMITTED, global manifest, checked) and read the local
    manifests of the ranks that hold pieces of `tensors` (each checked against the global manifest). Of a manifest
    with a piece index only the head and the blocks of `tensors` are read.

    boxes: the (start, length) of every piece the save will write, by tensor (piece_boxes): only the parent's pieces
    of exactly those boxes can be referenced, so only the local manifests of the ranks that hold them are read (on
    the mesh that saved the parent, one: the rank's own) rather than those of every rank holding a piece of a
    tensor (under FSDP, all)."""
    storage = root.child(name)
    opening = read_opening(storage, head_only=True)
    wanted = set(tensors)
    # A piece index (SPEC 11.1): the entries of these tensors only, from the blocks that hold them.
    manifest = read_index_entries(storage, opening.marker, opening.manifest, wanted)
    attempt = opening.marker.attempt
    ranks = holder_ranks(manifest, wanted, boxes)
    keys = None if boxes is None else {(tensor, *box) for tensor, held in boxes.items() for box in held}
    holders: dict[PieceKey, Holder] = {}
    resolved: dict[str, str] = {}

    def real_holder(file: ReferencedFile) -> ReferencedFile:
        """The parent's own reference, naming its holder as the root lists it (an earlier release recorded
        the name a parent was spelled by, a link perhaps): the new reference must name the real checkpoint."""
        spelled = file.target.checkpoint
        if spelled not in resolved:
            where, real = home(root.child(spelled))
            if not same_place(where, root):
                raise ShardckptUsageError(
                    f"{storage.url} references {spelled}, which lies in {where.url}, not in the root {root.url}: a "
                    "save cannot reference it (that root's collector may delete it); save without a parent (a full "
                    "save)"
                )
            resolved[spelled] = real
        if resolved[spelled] == spelled:
            return file
        target = ReferencePath(resolved[spelled], file.target.rank, file.target.attempt)
        return ReferencedFile(target, file.data_size, file.logical_size)

    unhashed = []
    other_alg: dict[str, list[int]] = {}
    for rank in sorted(ranks):
        local = _local_manifest(storage, manifest.files[rank])
        if local.references is None or local.references.piece_hash is None:
            unhashed.append(rank)
        # Digests of two algorithms never compare equal in meaning: rather than hash twice, write these pieces again.
        if local.references is not None and local.references.hash_alg != HASH_ALG:
            other_alg.setdefault(local.references.hash_alg, []).append(rank)
            continue
        _add_holders(holders, local, name, wanted, real_holder, keys)
    if unhashed:
        warnings.warn(
            f"{storage.url}: the parent's ranks {unhashed} recorded no piece hashes, so none of their pieces can be "
            "referenced and this save writes them again; save parents with piece_hashes=True (Checkpointer("
            "incremental=True) does)",
            UnhashedParentWarning,
            stacklevel=3,
        )
    for alg, others in other_alg.items():
        warnings.warn(
            f"{storage.url}: the parent's ranks {others} recorded {alg} piece hashes (an earlier release), this save "
            f"computes {HASH_ALG}, so none of their pieces can be referenced and this save writes them again; the "
            "next save can use this one as its parent",
            ParentHashAlgWarning,
            stacklevel=3,
        )
    return ParentPieces(name, attempt, holders, root)


def holder_ranks(manifest: GlobalManifest, wanted: Collection[str], boxes: Boxes | None = None) -> set[int]:
    """The ranks whose local manifests record the parent's pieces of `wanted` tensors (of these `boxes` only, if
    given): the rank of each piece's file, or of the parent's reference to it."""
    ranks: set[int] = set()
    own_files = len(manifest.files)
    for entry in manifest.tensors:
        if entry.name in wanted and entry.pieces.count:
            files = entry.pieces.file
            if boxes is not None:  # the pieces of these boxes, found by search (format/piece_columns.py)
                rows = [entry.pieces.geometry().matching(*box) for box in boxes.get(entry.name, ())]
                files = files[np.concatenate(rows)] if rows else files[:0]
            for file in np.unique(files).tolist():
                ranks.add(file if file < own_files else manifest.references[file - own_files].rank)
    return ranks


class UnhashedParentWarning(UserWarning):
    """An incremental save's parent was saved without piece hashes: nothing of it can be referenced."""


class ParentHashAlgWarning(UserWarning):
    """An incremental save's parent recorded its piece hashes with another algorithm than the save computes (an
    earlier release's BLAKE2b-128): nothing of it can be referenced."""


def _local_manifest(storage: Storage, entry: FileEntry) -> LocalManifest:
    path = entry.index
    raw = storage.read_small(path, limits.MAX_LOCAL_MANIFEST_BYTES)
    size, crc = entry.index_size, entry.index_crc32c
    if len(raw) != size or crc32c_of(raw) != crc:
        raise IntegrityError(
            f"{storage.describe(path)}: {len(raw)} bytes with CRC32C {crc32c_of(raw):#010x}, but the global manifest "
            f"promises {size} bytes with CRC32C {crc:#010x}"
        )
    return decode_local_manifest(raw, storage.describe(path))


def _first_blocks(nbytes: np.ndarray, block_size: int) -> np.ndarray:
    blocks = -(-nbytes // block_size)
    return np.concatenate([[0], np.cumsum(blocks)[:-1]]).astype(np.int64) if blocks.size else blocks


def _add_holders(
    holders: dict[PieceKey, Holder],
    local: LocalManifest,
    name: str,
    wanted: set[str],
    real: Callable[[ReferencedFile], ReferencedFile],
    keys: set[tuple[str, tuple[int, ...], tuple[int, ...]]] | None = None,
) -> None:
    """Add the holders of `local`'s pieces of `wanted` tensors (of these (name, start, length) `keys` only, if any)."""
    block = local.block_size
    refs = local.references
    specs = local.tensors
    pieces = local.pieces
    # Pieces without a recorded hash are never referenced: they are written anew. A compressed file's pieces are
    # referenced with their stored blocks' places, sizes and both checksums (SPEC 6.2, format 1.2).
    if refs is not None and refs.piece_hash is not None:
        compression = local.compression
        logical = None if compression is None else compression.logical_size
        own = ReferencedFile(ReferencePath(name, local.rank, local.attempt), local.data_size, logical)
        first = _first_blocks(pieces.nbytes, block)
        starts = None if compression is None else BlockMap(local.header_size, compression).starts
        for row in range(pieces.count):
            spec = specs[int(pieces.tensor[row])]
            if spec.name not in wanted:
                continue
            at, k = int(pieces.position[row]), int(pieces.k[row])
            key = (spec.name, spec.dtype, spec.shape, spec.layout, _ints(pieces.start[at : at + k]),
                   _ints(pieces.length[at : at + k]))  # fmt: skip
            if keys is not None and (spec.name, key[4], key[5]) not in keys:
                continue
            nbytes = int(pieces.nbytes[row])
            blocks = -(-nbytes // block)
            digest = refs.piece_hash[HASH_BYTES * row : HASH_BYTES * (row + 1)]
            lo, hi = int(first[row]), int(first[row]) + blocks
            crcs = local.crc32c[lo:hi]
            holder = Holder(own, int(pieces.offset[row]), nbytes, block, crcs, digest)
            if compression is not None and starts is not None:
                holder = replace(holder, stored_offset=int(starts[lo]), stored=compression.stored[lo:hi],
                                 logical_crc32c=compression.crc32c[lo:hi])  # fmt: skip
            holders[key] = holder
    table = None if refs is None else refs.pieces
    if table is None or refs is None:
        return
    mapped = None
    if table.compression is not None:
        mapped = table.compression.block_map(table, compressed_rows(table, refs.files), block)
    for row in range(table.count):
        spec = specs[int(table.tensor[row])]
        if spec.name not in wanted:
            continue
        start, length = table.box(row)
        if keys is not None and (spec.name, start, length) not in keys:
            continue
        nbytes = int(table.nbytes[row])
        first_block = int(table.first_block[row])
        crcs = table.crc32c[first_block : first_block + -(-nbytes // block)]
        # The parent's own reference: the new one names the same holder (SPEC 6.2 "No chains").
        file = real(refs.files[int(table.source[row])])
        key = (spec.name, spec.dtype, spec.shape, spec.layout, start, length)
        holder = Holder(file, int(table.offset[row]), nbytes, block, crcs, table.digest(row))
        if file.logical_size is not None and mapped is not None:  # the same stored blocks, carried forward
            lo, hi = first_block, first_block + len(crcs)
            holder = replace(holder, stored_offset=int(mapped[0][lo]), stored=mapped[1][lo:hi].astype(np.uint32),
                             logical_crc32c=mapped[2][lo:hi])  # fmt: skip
        holders[key] = holder


Box = tuple[tuple[int, ...], tuple[int, ...]]  # (start, length) as a piece table records it


def piece_boxes(pieces: Iterable[tuple[str, Any, Mapping[str, Any]]]) -> dict[str, set[Box]]:
    """The (start, length) of each piece of ShardWriter.add's arguments (name, tensor, placement), by tensor, as the
    writer will record it. A placement it cannot read is left out: the writer refuses it, naming it, and a piece
    left out here is only written rather than referenced."""
    boxes: dict[str, set[Box]] = {}
    for name, tensor, placement in pieces:
        box: Box
        try:
            shape, numel = tuple(int(n) for n in tensor.shape), int(tensor.numel())
            if "flat_offset" in placement:
                box = ((int(placement["flat_offset"]),), (numel,))
            elif "offsets" in placement:
                box = (tuple(int(o) for o in placement["offsets"]), shape)
            else:
                box = ((0,) * len(shape), shape)
        except (TypeError, ValueError, AttributeError):
            continue
        boxes.setdefault(name, set()).add(box)
    return boxes


def _ints(values: np.ndarray) -> tuple[int, ...]:
    return tuple(int(v) for v in values.tolist())


def recheck_referenced(root: Storage, pairs: Sequence[tuple[str, str]], referencing: str) -> None:
    """(coordinator, just before COMMITTED) Every referenced checkpoint is still committed by the attempt the
    references name (SPEC 9 phase 3, 14): NotCommittedError otherwise, and the save must commit nothing."""
    for name, attempt in pairs:
        storage = root.child(name)
        marker = read_commit_marker(storage)
        if marker is None or marker.attempt != attempt:
            found = "no COMMITTED" if marker is None else f"COMMITTED of attempt {marker.attempt}"
            raise NotCommittedError(
                f"{referencing} references {storage.url} attempt {attempt}, which now has {found} (deleted or "
                "replaced since the save chose it): nothing was committed; save again (a full save, or with another "
                "parent)"
            )


def check_referenced_files(root: Storage, files: Sequence[ReferencedFile], referencing: str) -> None:
    """(coordinator) Every referenced data file exists with the size the references carry."""
    for file in {entry.path: entry for entry in files}.values():
        storage = root.child(file.target.checkpoint)
        size = storage.size(file.target.data)
        if size != file.data_size:
            raise IntegrityError(
                f"{referencing} references {storage.describe(file.target.data)} as {file.data_size} bytes; it holds "
                f"{size}"
            )
