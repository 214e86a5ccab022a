"""Merging the local manifests of all ranks into the global manifest's tensor entries and objects.

Vectorized over all pieces of all ranks (one sort, one gather per tensor), then exact cover per tensor, so
a commit of thousands of ranks stays in seconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from shardckpt.errors import CoverageError
from shardckpt.format.local_manifest import LocalManifest, TensorSpec
from shardckpt.format.manifest import PieceTable, TensorEntry
from shardckpt.format.strict import ObjectEntry
from shardckpt.format.values import pack_value
from shardckpt.planner import check_cover


def merge_tensors(manifests: Sequence[LocalManifest]) -> tuple[TensorEntry, ...]:
    """One global entry per tensor, pieces of every rank (file index = position in `manifests`), cover checked.

    Format 1.1: a rank's referenced pieces get file index len(manifests) + j, j counting the referenced files of
    all ranks in rank order (the global manifest's `references`, SPEC 6.2), and count towards cover like others.
    """
    specs, layouts, mappings = _global_table(manifests)
    tensor_ids, files, offsets, starts, lengths, positions, flat_piece = [], [], [], [], [], [], []
    value_base = 0
    reference_base = len(manifests)
    for manifest, mapping in zip(manifests, mappings):
        held = None if manifest.references is None else manifest.references.pieces
        if held is None or not held.count:
            continue
        tensor_ids.append(mapping[held.tensor])
        files.append(held.source + reference_base)
        offsets.append(held.offset)
        starts.append(held.start)
        lengths.append(held.length)
        positions.append(held.position + value_base)
        layout_of = np.array([spec.layout == "flat" for spec in manifest.tensors], dtype=bool)
        flat_piece.append(layout_of[held.tensor])
        value_base += held.start.size
        reference_base += len(manifest.references.files) if manifest.references is not None else 0
    for file_index, (manifest, mapping) in enumerate(zip(manifests, mappings)):
        pieces = manifest.pieces
        global_ids = mapping[pieces.tensor] if pieces.count else pieces.tensor
        tensor_ids.append(global_ids)
        files.append(np.full(pieces.count, file_index, dtype=np.int64))
        offsets.append(pieces.offset)
        starts.append(pieces.start)
        lengths.append(pieces.length)
        positions.append(pieces.position + value_base)
        layout_of = np.array([spec.layout == "flat" for spec in manifest.tensors], dtype=bool)
        flat_piece.append(layout_of[pieces.tensor] if pieces.count else np.zeros(0, bool))
        value_base += pieces.start.size
    all_ids = np.concatenate(tensor_ids) if tensor_ids else np.zeros(0, np.int64)
    order = np.argsort(all_ids, kind="stable")
    bounds = np.searchsorted(all_ids[order], np.arange(len(specs) + 1))
    file_all, offset_all = np.concatenate(files), np.concatenate(offsets)
    start_all, length_all = np.concatenate(starts), np.concatenate(lengths)
    position_all, flat_all = np.concatenate(positions), np.concatenate(flat_piece)
    merged = []
    # Tensors stored as one piece (most, and all of a one-process save) are handled in Python ints: numpy's cost
    # per call would be most of the work. One whole piece is exactly what check_cover accepts of a single piece.
    counts = np.diff(bounds).tolist()
    first_of = order[np.minimum(bounds[:-1], max(order.size - 1, 0))].tolist() if order.size else counts
    file_list, offset_list, position_list = file_all.tolist(), offset_all.tolist(), position_all.tolist()
    start_list, length_list, flat_list = start_all.tolist(), length_all.tolist(), flat_all.tolist()
    for number in np.argsort([spec.name for spec in specs], kind="stable").tolist():
        spec, layout = specs[number], layouts[number]
        if counts[number] == 1:
            piece = first_of[number]
            if flat_list[piece] == (layout == "flat"):
                k = 1 if layout == "flat" else len(spec.shape)
                first = position_list[piece]
                start_row, length_row = start_list[first : first + k], length_list[first : first + k]
                whole = [spec.numel] if layout == "flat" else list(spec.shape)
                if not any(start_row) and length_row == whole:
                    table = PieceTable.from_lists(
                        k, [file_list[piece]], [offset_list[piece]], [start_row], [length_row]
                    )
                    merged.append(TensorEntry(spec.name, spec.dtype, spec.shape, layout, table))
                    continue
        selected = order[bounds[number] : bounds[number + 1]]
        start, length = _gather(spec, layout, selected, position_all, flat_all, start_all, length_all, file_all)
        k = 1 if layout == "flat" else len(spec.shape)
        start, length = start.reshape(selected.size, k), length.reshape(selected.size, k)
        check_cover(spec.name, spec.shape, layout, start, length)
        table = PieceTable(file_all[selected], offset_all[selected], start, length)
        merged.append(TensorEntry(spec.name, spec.dtype, spec.shape, layout, table))
    return tuple(merged)


def _global_table(
    manifests: Sequence[LocalManifest],
) -> tuple[list[TensorSpec], list[str], list[np.ndarray]]:
    """Every tensor once (dtype and shape agreed by all ranks), and each rank's local -> global index map."""
    index: dict[str, int] = {}
    specs: list[TensorSpec] = []
    layouts: list[str] = []
    owner: list[int] = []
    mappings: list[np.ndarray] = []
    # Identical tables decode to one shared tuple (the decoder's cache): its mapping is made and checked once,
    # however the ranks that send it interleave (expert-parallel groups send theirs in rotation).
    by_table: dict[int, np.ndarray] = {}
    for manifest in manifests:
        seen = by_table.get(id(manifest.tensors))
        if seen is not None:
            mappings.append(seen)
            continue
        mapping = np.empty(len(manifest.tensors), dtype=np.int64)
        for local, spec in enumerate(manifest.tensors):
            number = index.get(spec.name)
            if number is None:
                number = index[spec.name] = len(specs)
                specs.append(spec)
                layouts.append(spec.layout)
                owner.append(manifest.rank)
            elif (specs[number].dtype, specs[number].shape) != (spec.dtype, spec.shape):
                known = specs[number]
                raise CoverageError(
                    f"tensor {spec.name!r}: rank {owner[number]} stores dtype {known.dtype} shape "
                    f"{list(known.shape)}, rank {manifest.rank} stores dtype {spec.dtype} shape "
                    f"{list(spec.shape)} (mismatch)"
                )
            elif spec.layout == "flat":
                layouts[number] = "flat"  # a tensor stored flat anywhere is described flat everywhere
            mapping[local] = number
        by_table[id(manifest.tensors)] = mapping
        mappings.append(mapping)
    return specs, layouts, mappings


def _gather(
    spec: TensorSpec,
    layout: str,
    selected: np.ndarray,
    position: np.ndarray,
    flat_piece: np.ndarray,
    start_all: np.ndarray,
    length_all: np.ndarray,
    file_all: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Start/length values of the selected pieces, box pieces turned into element ranges for a flat tensor."""
    if layout == "box" or flat_piece[selected].all():
        k = 1 if layout == "flat" else len(spec.shape)
        gather = position[selected][:, None] + np.arange(k, dtype=np.int64)[None, :]
        return start_all[gather], length_all[gather]
    start, length = np.empty(selected.size, np.int64), np.empty(selected.size, np.int64)
    strides = [math.prod(spec.shape[d + 1 :]) for d in range(len(spec.shape))]
    for row, piece in enumerate(selected.tolist()):
        first = int(position[piece])
        if flat_piece[piece]:
            start[row], length[row] = start_all[first], length_all[first]
            continue
        box_start = start_all[first : first + len(spec.shape)].tolist()
        box_length = length_all[first : first + len(spec.shape)].tolist()
        outer = next((d for d, n in enumerate(box_length) if n > 1), len(spec.shape))
        if not all(box_start[d] == 0 and box_length[d] == spec.shape[d] for d in range(outer + 1, len(spec.shape))):
            raise CoverageError(
                f"tensor {spec.name!r}: file {int(file_all[piece])} stores a box piece at {box_start} of shape "
                f"{box_length} that is not a contiguous element range, while other ranks store flat ranges"
            )
        start[row] = sum(o * s for o, s in zip(box_start, strides))
        length[row] = math.prod(box_length)
    return start, length


def merge_objects(manifests: Sequence[LocalManifest]) -> tuple[ObjectEntry, ...]:
    """Shared objects once (every rank that gives one must give the same bytes), per-rank objects of every rank."""
    shared: dict[str, tuple[int, ObjectEntry, bytes]] = {}
    per_rank: list[ObjectEntry] = []
    for manifest in manifests:
        for entry in manifest.objects:
            if entry.rank is not None:
                per_rank.append(ObjectEntry(entry.name, manifest.rank, entry.value))
                continue
            packed = pack_value(entry.value)
            seen = shared.get(entry.name)
            if seen is None:
                shared[entry.name] = (manifest.rank, entry, packed)
            elif seen[2] != packed:
                raise CoverageError(
                    f"shared object {entry.name!r} differs between rank {seen[0]} and rank {manifest.rank}: a shared "
                    "value is saved once for all ranks; wrap one that differs between ranks in shardckpt.PerRank"
                )
    return tuple(entry for _, entry, _ in shared.values()) + tuple(per_rank)
