"""What `shardckpt inspect` shows: a checkpoint's status, step, tensors, ranks, objects and (format 1.1) the pieces it
stores by reference and where, from its manifests only.

Torch-free: the manifests are read and checked through catalog (COMMITTED, then the global manifest's checksum).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from shardckpt.catalog.chain import INCOMPLETE, not_a_checkpoint, read_commit_marker, read_opening, what_is
from shardckpt.errors import ShardckptError
from shardckpt.format import layout
from shardckpt.format.dtypes import itemsize
from shardckpt.format.manifest import TensorEntry
from shardckpt.ops.local_tier import describe_copy, is_local_copy
from shardckpt.storage import Storage, open_storage


def inspect_checkpoint(url: str | Storage, *, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """A summary of the checkpoint at `url`: "status" committed (with everything the manifest says) or incomplete
    (the attempts whose local manifests are there, and the data files). Anything else raises the error of
    catalog.chain.not_a_checkpoint (NotFoundError when nothing is there)."""
    storage = open_storage(url, storage_options)
    if read_commit_marker(storage) is None:
        if what_is(storage).kind != INCOMPLETE:
            raise not_a_checkpoint(storage)  # nothing there, a root, a DCP checkpoint...: say which, and what to do
        return _incomplete(storage)
    opening = read_opening(storage)
    manifest = opening.manifest
    own = len(manifest.files)
    # The rank of every piece-table file index: own data files, then the references (SPEC 6.2).
    rank_of = [f.rank for f in manifest.files] + [entry.rank for entry in manifest.references]
    by_reference: dict[int, list[int]] = {j: [0, 0] for j in range(len(manifest.references))}  # pieces, bytes
    tensors: list[dict[str, Any]] = []
    for entry in manifest.tensors:
        files = entry.pieces.file.tolist()
        summary: dict[str, Any] = {
            "name": entry.name,
            "dtype": entry.dtype,
            "shape": list(entry.shape),
            "layout": entry.layout,
            "bytes": entry.nbytes,
            "pieces": entry.pieces.count,
            "pieces_per_rank": dict(Counter(rank_of[f] for f in files)),
        }
        if manifest.references:
            sizes = _piece_bytes(entry)
            referenced = [(f - own, size) for f, size in zip(files, sizes) if f >= own]
            for j, size in referenced:
                by_reference[j][0] += 1
                by_reference[j][1] += size
            summary["referenced"] = {
                "pieces": len(referenced),
                "bytes": sum(size for _, size in referenced),
                "from": sorted({manifest.references[j].file.path for j, _ in referenced}),
            }
        tensors.append(summary)
    ranks = [
        {
            "rank": f.rank,
            "data": f.data,
            "bytes": f.data_size,
            "logical_bytes": f.extent,  # format 1.2: what the file holds decompressed (SPEC 4.1); = bytes if raw
            "compressed": f.logical_size is not None,
            "pieces": sum(t["pieces_per_rank"].get(f.rank, 0) for t in tensors),
        }
        for f in manifest.files
    ]
    logical = sum(f.extent for f in manifest.files)
    result: dict[str, Any] = {
        "url": storage.url,
        "status": "committed",
        "format_version": f"{manifest.version[0]}.{manifest.version[1]}",
        "attempt": manifest.attempt,
        "step": manifest.step,
        "created": manifest.created,
        "world_size": manifest.world_size,
        "block_size": manifest.block_size,
        "total_bytes": manifest.total_bytes,
        # Format 1.2: stored (total_bytes) against logical bytes of the data files; ratio = stored / logical.
        "compressed_files": sum(f.logical_size is not None for f in manifest.files),
        "logical_bytes": logical,
        "compression_ratio": manifest.total_bytes / logical if logical else 1.0,
        "tensors": tensors,
        "ranks": ranks,
        "objects": [{"name": o.name, "rank": o.rank, "value": o.value} for o in manifest.objects],
        "metadata": manifest.metadata,
        # Format 1.1: the checkpoints of the root this one stores pieces in, and whether the root holds each as the
        # attempt referenced (a copy made without them cannot be loaded).
        "parents": [
            {"name": name, "attempt": attempt, "present": _committed_as(storage.parent().child(name), attempt)}
            for name, attempt in opening.marker.references
        ],
        # Format 1.1: the data files of other checkpoints of the root that pieces are stored in (paths relative
        # to the root), with what each rank reads there.
        "references": [
            {
                "rank": entry.rank,
                "path": entry.file.path,
                "checkpoint": entry.file.target.checkpoint,
                "attempt": entry.file.target.attempt,
                "data_size": entry.file.data_size,
                "pieces": by_reference[j][0],
                "bytes": by_reference[j][1],
            }
            for j, entry in enumerate(manifest.references)
        ],
    }
    if is_local_copy(manifest):  # a node's copy of a local-tier save: what this node holds of it
        result["local"] = describe_copy(storage, manifest)
    return result


def _committed_as(storage: Storage, attempt: str) -> bool:
    try:
        marker = read_commit_marker(storage)
    except ShardckptError:
        return False
    return marker is not None and marker.attempt == attempt


def _piece_bytes(entry: TensorEntry) -> list[int]:
    """The stored size of each piece of a tensor (its box's elements times the element size)."""
    _, _, _, length = entry.pieces.arrays()
    return (np.prod(length, axis=1, dtype=np.int64) * itemsize(entry.dtype)).tolist()  # type: ignore[no-any-return]


def _incomplete(storage: Storage) -> dict[str, Any]:
    attempts: dict[str, list[int]] = {}
    for name in storage.list(layout.RANKS_DIR):
        try:
            rank, attempt = layout.parse_local_manifest_path(f"{layout.RANKS_DIR}/{name}")
        except ShardckptError:
            continue
        attempts.setdefault(attempt, []).append(rank)
    return {
        "url": storage.url,
        "status": "incomplete",
        "attempts": {a: sorted(r) for a, r in attempts.items()},
        "data_files": len(storage.list(layout.DATA_DIR)),
    }
