"""What `shardckpt inspect` shows: a checkpoint's status, step, tensors, ranks and objects, from its manifests only.

Torch-free: the manifests are read and checked through catalog (COMMITTED, then the global manifest's checksum).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from shardckpt.catalog.chain import INCOMPLETE, not_a_checkpoint, read_commit_marker, read_opening, what_is
from shardckpt.errors import ShardckptError
from shardckpt.format import layout
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
    manifest = read_opening(storage).manifest
    tensors: list[dict[str, Any]] = []
    for entry in manifest.tensors:
        files = entry.pieces.file
        tensors.append(
            {
                "name": entry.name,
                "dtype": entry.dtype,
                "shape": list(entry.shape),
                "layout": entry.layout,
                "bytes": entry.nbytes,
                "pieces": entry.pieces.count,
                "pieces_per_rank": dict(Counter(manifest.files[int(f)].rank for f in files.tolist())),
            }
        )
    ranks = [
        {
            "rank": f.rank,
            "data": f.data,
            "bytes": f.data_size,
            "pieces": sum(t["pieces_per_rank"].get(f.rank, 0) for t in tensors),
        }
        for f in manifest.files
    ]
    return {
        "url": storage.url,
        "status": "committed",
        "format_version": f"{manifest.version[0]}.{manifest.version[1]}",
        "attempt": manifest.attempt,
        "step": manifest.step,
        "created": manifest.created,
        "world_size": manifest.world_size,
        "block_size": manifest.block_size,
        "total_bytes": manifest.total_bytes,
        "tensors": tensors,
        "ranks": ranks,
        "objects": [{"name": o.name, "rank": o.rank, "value": o.value} for o in manifest.objects],
        "metadata": manifest.metadata,
    }


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
