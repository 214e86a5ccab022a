"""Format 1.1 checkpoints for tests, built by hand until the write side lands: a parent saved by the library, and a
child whose ranks write the changed tensors and store the unchanged ones by reference to the parent's data files.

The child's documents are edited with the format layer's encoders (columns, hash columns, msgpack) and re-sealed
(sizes and CRC32C from COMMITTED down), as SPEC 6.2 describes them; `alg` makes a root as a release hashing with
another algorithm would have written it (BLAKE2b-128: the previous one). Import from tests.helpers.references.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import crc32c
import msgpack
import torch

from shardckpt.format.columns import encode_int_column, encode_u32_column
from shardckpt.format.layout import data_path, global_manifest_path, local_manifest_path
from shardckpt.format.local_manifest import decode_local_manifest
from shardckpt.format.references import FEATURE, HASH_ALG, encode_hash_column, piece_hash, reference_path
from shardckpt.format.values import pack_value
from tests.helpers.checkpoints import save_sharded

PARENT, CHILD = "step-1", "step-2"


def _unpack(raw: bytes) -> Any:
    return msgpack.unpackb(raw, raw=False, strict_map_key=False)


def _committed(ckpt: Path) -> dict[str, Any]:
    marker: dict[str, Any] = json.loads((ckpt / "COMMITTED").read_text())
    return marker


def save_incremental(
    root: Path,
    parent_state: dict[str, torch.Tensor],
    changed: dict[str, torch.Tensor],
    world: int,
    *,
    block_size: int = 4096,
    alg: str = HASH_ALG,
) -> tuple[str, str]:
    """ROOT/step-1 holds `parent_state` (a full save of `world` ranks, Shard(0) rows); ROOT/step-2 holds the same
    tensors with `changed` written anew and every other tensor stored by reference to step-1's files (format 1.1),
    every hash of both in `alg`. Returns the two attempts. Every tensor must be at least 1-D (0-D tensors live on
    rank 0 only)."""
    # The parent records piece hashes, as a parent written by an incremental series does.
    parent_attempt = save_sharded(
        parent_state, str(root / PARENT), world, block_size=block_size, step=1, piece_hashes=True
    )
    if alg != HASH_ALG:
        for rank in range(world):
            rehash(root / PARENT, rank, alg)
    child_attempt = save_sharded(changed, str(root / CHILD), world, block_size=block_size, step=2)
    unchanged = sorted(set(parent_state) - set(changed))
    reference_tensors(root / CHILD, root / PARENT, parent_attempt, unchanged, alg)
    return parent_attempt, child_attempt


def rehash(ckpt: Path, rank: int, alg: str) -> None:
    """Record rank `rank`'s piece hashes of the committed `ckpt` (saved with piece hashes, no references) in `alg`,
    as a writer hashing with `alg` would have; the chain above is re-sealed."""
    attempt = _committed(ckpt)["attempt"]
    own = decode_local_manifest((ckpt / local_manifest_path(rank, attempt)).read_bytes())
    data = (ckpt / data_path(rank, attempt)).read_bytes()
    spans = zip(own.pieces.offset.tolist(), own.pieces.nbytes.tolist())
    column = encode_hash_column([piece_hash(data[at : at + size], alg) for at, size in spans], alg)
    edit_local_manifest(ckpt, rank, lambda document: document.update(piece_hash=column))


def reference_tensors(child: Path, parent: Path, parent_attempt: str, names: list[str], alg: str = HASH_ALG) -> None:
    """Make `child` (a committed 1.0 checkpoint of the parent's world size, without tensors `names`) store the
    parent's pieces of `names` by reference, rank r to the parent's rank-r file; its hashes in `alg`."""
    marker = _committed(child)
    attempt, world = marker["attempt"], marker["world_size"]
    sealed: dict[int, tuple[int, int]] = {}
    global_refs: list[dict[str, Any]] = []
    referenced_pieces: list[tuple[int, str, dict[str, Any]]] = []  # (rank, name, piece row)
    for rank in range(world):
        held_raw = (parent / local_manifest_path(rank, parent_attempt)).read_bytes()
        held = decode_local_manifest(held_raw)
        held_data = (parent / data_path(rank, parent_attempt)).read_bytes()
        first_block = 0
        rows = []
        for i in range(held.pieces.count):
            spec = held.tensors[int(held.pieces.tensor[i])]
            size = int(held.pieces.nbytes[i])
            blocks = -(-size // held.block_size)
            if spec.name in names:
                offset, at = int(held.pieces.offset[i]), int(held.pieces.position[i])
                rows.append(
                    {
                        "spec": spec,
                        "offset": offset,
                        "start": held.pieces.start[at : at + spec.k].tolist(),
                        "length": held.pieces.length[at : at + spec.k].tolist(),
                        "crc32c": held.crc32c[first_block : first_block + blocks].tolist(),
                        "hash": piece_hash(held_data[offset : offset + size], alg),
                    }
                )
            first_block += blocks
        if not rows:
            raise AssertionError(f"{parent}: rank {rank} holds none of {names}; reference_tensors needs one each")
        sealed[rank] = _reference_rank(child, attempt, rank, parent.name, parent_attempt, len(held_data), rows, alg)
        global_refs.append(
            {"rank": rank, "path": reference_path(parent.name, rank, parent_attempt), "data_size": len(held_data)}
        )
        referenced_pieces += [(rank, row["spec"].name, row) for row in rows]

    manifest_file = child / global_manifest_path(attempt)
    document = _unpack(manifest_file.read_bytes())
    document["version"], document["must_understand"] = [1, 1], [FEATURE]
    for entry in document["files"]:
        entry["index_size"], entry["index_crc32c"] = sealed[entry["rank"]]
    document["references"] = global_refs
    for name in names:
        mine = [(world + rank, row) for rank, tensor, row in referenced_pieces if tensor == name]
        spec = mine[0][1]["spec"]
        k = spec.k
        document["tensors"].append(
            {
                "name": name,
                "dtype": spec.dtype,
                "shape": list(spec.shape),
                "layout": spec.layout,
                "pieces": {
                    "count": len(mine),
                    "file": encode_int_column([file for file, _ in mine]),
                    "offset": encode_int_column([row["offset"] for _, row in mine]),
                    # The global piece lists are dimension-major (SPEC appendix A).
                    "start": encode_int_column([row["start"][d] for d in range(k) for _, row in mine]),
                    "length": encode_int_column([row["length"][d] for d in range(k) for _, row in mine]),
                },
            }
        )
    document["tensors"].sort(key=lambda entry: entry["name"])
    raw = pack_value(document)
    manifest_file.write_bytes(raw)
    marker["version"], marker["must_understand"] = [1, 1], [FEATURE]
    marker["manifest_size"], marker["manifest_crc32c"] = len(raw), crc32c.crc32c(raw)
    marker["references"] = [{"checkpoint": parent.name, "attempt": parent_attempt}]
    (child / "COMMITTED").write_text(json.dumps(marker))


def _reference_rank(
    child: Path,
    attempt: str,
    rank: int,
    parent_name: str,
    parent_attempt: str,
    parent_size: int,
    rows: list[dict[str, Any]],
    alg: str,
) -> tuple[int, int]:
    """Add the referenced pieces `rows` to the child's rank-`rank` local manifest; its new (size, CRC32C)."""
    local_file = child / local_manifest_path(rank, attempt)
    document = _unpack(local_file.read_bytes())
    own = decode_local_manifest(local_file.read_bytes())
    data = (child / data_path(rank, attempt)).read_bytes()
    table = document["tensors"]
    names = table["names"].split("\x00") if table["count"] else []
    dtypes = table["dtypes"].split("\x00") if table["count"] else []
    layouts = table["layouts"].split("\x00") if table["count"] else []
    ndims = [len(spec.shape) for spec in own.tensors]
    shape = [dim for spec in own.tensors for dim in spec.shape]
    for row in rows:
        spec = row["spec"]
        if spec.name not in names:
            names.append(spec.name)
            dtypes.append(spec.dtype)
            layouts.append(spec.layout)
            ndims.append(len(spec.shape))
            shape.extend(spec.shape)
    table.update(
        count=len(names),
        names="\x00".join(names),
        dtypes="\x00".join(dtypes),
        layouts="\x00".join(layouts),
        ndim=encode_int_column(ndims),
        shape=encode_int_column(shape),
    )
    pieces = own.pieces
    document["version"], document["must_understand"] = [1, 1], [FEATURE]
    document["piece_hash"] = encode_hash_column(
        [
            piece_hash(data[offset : offset + size], alg)
            for offset, size in zip(pieces.offset.tolist(), pieces.nbytes.tolist())
        ],
        alg,
    )
    document["references"] = [{"path": reference_path(parent_name, rank, parent_attempt), "data_size": parent_size}]
    rows = sorted(rows, key=lambda row: row["offset"])
    document["referenced"] = {
        "count": len(rows),
        "tensor": encode_int_column([names.index(row["spec"].name) for row in rows]),
        "source": encode_int_column([0] * len(rows)),
        "offset": encode_int_column([row["offset"] for row in rows]),
        "start": encode_int_column([v for row in rows for v in row["start"]]),
        "length": encode_int_column([v for row in rows for v in row["length"]]),
        "crc32c": encode_u32_column([c for row in rows for c in row["crc32c"]]),
        "hash": encode_hash_column([row["hash"] for row in rows], alg),
    }
    raw = pack_value(document)
    local_file.write_bytes(raw)
    return len(raw), crc32c.crc32c(raw)


def edit_local_manifest(ckpt: Path, rank: int, edit: Callable[[dict[str, Any]], None]) -> None:
    """Apply `edit` to the decoded local manifest of `rank` and re-seal the chain above it (global manifest's
    index_size and index_crc32c, COMMITTED's manifest_size and manifest_crc32c), as a writer would have."""
    marker = _committed(ckpt)
    attempt = marker["attempt"]
    local_file = ckpt / local_manifest_path(rank, attempt)
    document = _unpack(local_file.read_bytes())
    edit(document)
    raw_local = pack_value(document)
    local_file.write_bytes(raw_local)
    manifest_file = ckpt / global_manifest_path(attempt)
    manifest = _unpack(manifest_file.read_bytes())
    (entry,) = [entry for entry in manifest["files"] if entry["rank"] == rank]
    entry["index_size"], entry["index_crc32c"] = len(raw_local), crc32c.crc32c(raw_local)
    raw = pack_value(manifest)
    manifest_file.write_bytes(raw)
    marker["manifest_size"], marker["manifest_crc32c"] = len(raw), crc32c.crc32c(raw)
    (ckpt / "COMMITTED").write_text(json.dumps(marker))
