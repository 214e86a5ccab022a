"""Regenerate the format 1.1 vectors of pieces stored by reference (SPEC 6.2):
`python spec/vectors/generate_references.py`.

Each case is a *root* holding several checkpoints; its description.json / expected_error.json names the one to open
("checkpoint"). The referencing checkpoints are written as 1.0 by the library and then given their references
here, at the byte level, with this script's own msgpack/CRC32C/column/hash code. `references_basic` hashes with
BLAKE2b-128 (the first 1.1 writer), `references_blake3` with BLAKE3-128 (SPEC 6.3: readers accept both).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import crc32c
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from generate import (
    BLOCK,
    INVALID,
    VALID,
    column_values,
    describe_tensor,
    expect,
    make_column,
    pack,
    pinned_clock,
    unpack,
    write_json,
)

import shardckpt

ROOT_CASE = "references_basic"
BLAKE3_CASE = "references_blake3"
PARENT, CHILD = "step-1", "step-2"
ATTEMPTS = {"step-1": "golden1", "step-2": "golden2", "step-3": "golden3"}
Row = dict[str, Any]


def digest(data: bytes, alg: str) -> bytes:
    """SPEC 6.3: the first 16 bytes of BLAKE3, or BLAKE2b with a 16-byte digest."""
    if alg == "blake3-128":
        return blake3.blake3(data).digest(16)
    assert alg == "blake2b-128", alg
    return hashlib.blake2b(data, digest_size=16).digest()


def hash_column(digests: list[bytes], alg: str) -> dict[str, Any]:
    return {"alg": alg, "n": len(digests), "data": b"".join(digests)}


def u32_column(values: list[int]) -> dict[str, Any]:
    return {"enc": "u32le", "n": len(values), "data": b"".join(v.to_bytes(4, "little") for v in values)}


def data_path(rank: int, attempt: str) -> str:
    return f"data/{rank:05d}-{attempt}.safetensors"


def local_path(rank: int, attempt: str) -> str:
    return f"ranks/{rank:05d}-{attempt}.msgpack"


def write_checkpoint(
    root: Path, name: str, step: int, pieces: dict[int, list[tuple[str, torch.Tensor, slice]]], *, flat: bool = False
) -> None:
    """A 1.0 checkpoint ROOT/name of 2 ranks, written by the library; pieces: rank -> (tensor, full, rows), or with
    `flat` (tensor, full, row-major element range) stored as flat pieces."""
    attempt = ATTEMPTS[name]
    url = str(root / name)
    writers = [
        shardckpt.ShardWriter(url, rank=rank, world_size=2, attempt=attempt, block_size=BLOCK, step=step)
        for rank in range(2)
    ]
    for rank, items in pieces.items():
        for tensor, full, rows in items:
            if flat:
                part = full.reshape(-1)[rows].clone()
                writers[rank].add(tensor, part, global_shape=tuple(full.shape), flat_offset=rows.start)
            else:
                writers[rank].add(tensor, full[rows].clone(), global_shape=tuple(full.shape), offsets=(rows.start, 0))
    for writer in writers:
        writer.close()
    with pinned_clock():
        shardckpt.commit(url, world_size=2, attempt=attempt)


def local_doc(root: Path, name: str, rank: int) -> dict[str, Any]:
    document: dict[str, Any] = unpack((root / name / local_path(rank, ATTEMPTS[name])).read_bytes())
    return document


def physical_pieces(root: Path, name: str, rank: int) -> list[Row]:
    """The rows of a local manifest's pieces table (every tensor here is F32): name, box, bytes, checksums."""
    document = local_doc(root, name, rank)
    names = document["tensors"]["names"].split("\x00")
    layouts = document["tensors"]["layouts"].split("\x00")
    ndims = column_values(document["tensors"]["ndim"])
    table = document["pieces"]
    tensor, offset = column_values(table["tensor"]), column_values(table["offset"])
    start, length = column_values(table["start"]), column_values(table["length"])
    data = (root / name / data_path(rank, ATTEMPTS[name])).read_bytes()
    raw_crcs = document["crc32c"]["data"]
    crcs = [int.from_bytes(raw_crcs[i : i + 4], "little") for i in range(0, len(raw_crcs), 4)]
    rows, block_at, at = [], 0, 0
    for i in range(table["count"]):
        k = ndims[tensor[i]] if layouts[tensor[i]] == "box" else 1
        size = 4 * int(np.prod(length[at : at + k]))
        blocks = -(-size // BLOCK)
        rows.append(
            {
                "name": names[tensor[i]],
                "offset": offset[i],
                "start": start[at : at + k],
                "length": length[at : at + k],
                "bytes": data[offset[i] : offset[i] + size],
                "crc32c": crcs[block_at : block_at + blocks],
            }
        )
        block_at += blocks
        at += k
    return rows


def w_row(root: Path, holder: str, rank: int) -> Row:
    (row,) = [row for row in physical_pieces(root, holder, rank) if row["name"] == "w"]
    return row


def _declare_w(table: dict[str, Any], shape: list[int], layout: str = "box") -> int:
    """Add tensor w to a local tensor table (if absent); its index."""
    names = table["names"].split("\x00") if table["count"] else []
    if "w" not in names:
        dtypes = table["dtypes"].split("\x00") if names else []
        layouts = table["layouts"].split("\x00") if names else []
        table["count"] += 1
        table["names"] = "\x00".join([*names, "w"])
        table["dtypes"] = "\x00".join([*dtypes, "F32"])
        table["layouts"] = "\x00".join([*layouts, layout])
        table["ndim"] = make_column([*column_values(table["ndim"]), 2])
        table["shape"] = make_column([*column_values(table["shape"]), *shape])
        names.append("w")
    return names.index("w")


def add_references(
    root: Path,
    name: str,
    refs: dict[int, list[tuple[str, Row]]],
    shape: list[int],
    alg: str = "blake2b-128",
    layout: str = "box",
) -> None:
    """Make ROOT/name a 1.1 checkpoint whose rank r also stores tensor w's pieces refs[r] by reference: (reference
    path, holder row); its hashes in `alg`; sizes and checksums of the whole chain are set to match. A rank without
    references keeps a [1, 0] local manifest with piece hashes (SPEC 2: must_understand lists what is used)."""
    attempt = ATTEMPTS[name]
    ckpt = root / name
    global_refs: list[dict[str, Any]] = []
    sealed = {}
    for rank in range(2):
        document = local_doc(root, name, rank)
        w_index = _declare_w(document["tensors"], shape, layout) if refs.get(rank) else -1
        own = physical_pieces(root, name, rank)
        if refs.get(rank):
            document["version"] = [1, 1]
            document["must_understand"] = ["references"]
        document["piece_hash"] = hash_column([digest(row["bytes"], alg) for row in own], alg)
        if not refs.get(rank):
            raw = pack(document)
            (ckpt / local_path(rank, attempt)).write_bytes(raw)
            sealed[rank] = (len(raw), crc32c.crc32c(raw))
            continue
        paths = sorted({path for path, _ in refs.get(rank, [])})
        rows = sorted(refs.get(rank, []), key=lambda item: (paths.index(item[0]), item[1]["offset"]))
        sizes = {path: (root / path).stat().st_size for path in paths}
        document["references"] = [{"path": path, "data_size": sizes[path]} for path in paths]
        document["referenced"] = {
            "count": len(rows),
            "tensor": make_column([w_index] * len(rows)),
            "source": make_column([paths.index(path) for path, _ in rows]),
            "offset": make_column([row["offset"] for _, row in rows]),
            "start": make_column([v for _, row in rows for v in row["start"]]),
            "length": make_column([v for _, row in rows for v in row["length"]]),
            "crc32c": u32_column([c for _, row in rows for c in row["crc32c"]]),
            "hash": hash_column([digest(row["bytes"], alg) for _, row in rows], alg),
        }
        raw = pack(document)
        (ckpt / local_path(rank, attempt)).write_bytes(raw)
        sealed[rank] = (len(raw), crc32c.crc32c(raw))
        global_refs += [{"rank": rank, "path": path, "data_size": sizes[path]} for path in paths]

    manifest_file = ckpt / f"manifest-{attempt}.msgpack"
    document = unpack(manifest_file.read_bytes())
    document["version"] = [1, 1]
    document["must_understand"] = ["references"]
    for entry in document["files"]:
        entry["index_size"], entry["index_crc32c"] = sealed[entry["rank"]]
    document["references"] = global_refs
    stored = [
        (len(document["files"]) + j, row)
        for j, ref in enumerate(global_refs)
        for path, row in refs.get(ref["rank"], [])
        if path == ref["path"]
    ]
    k = len(shape) if layout == "box" else 1
    document["tensors"].append(
        {
            "name": "w",
            "dtype": "F32",
            "shape": shape,
            "layout": layout,
            "pieces": {
                "count": len(stored),
                "file": make_column([file for file, _ in stored]),
                "offset": make_column([row["offset"] for _, row in stored]),
                "start": make_column([row["start"][d] for d in range(k) for _, row in stored]),
                "length": make_column([row["length"][d] for d in range(k) for _, row in stored]),
            },
        }
    )
    raw = pack(document)
    manifest_file.write_bytes(raw)
    marker = json.loads((ckpt / "COMMITTED").read_text())
    marker["version"] = [1, 1]
    marker["must_understand"] = ["references"]
    marker["manifest_size"], marker["manifest_crc32c"] = len(raw), crc32c.crc32c(raw)
    targets = sorted({ref["path"].split("/")[0] for ref in global_refs})
    marker["references"] = [{"checkpoint": t, "attempt": ATTEMPTS[t]} for t in targets]
    (ckpt / "COMMITTED").write_text(json.dumps(marker, indent=1) + "\n")


def build_valid(case: str, alg: str) -> None:
    root = VALID / case
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    gen = torch.Generator().manual_seed(18)
    w = torch.randn(4, 3, generator=gen)
    m = torch.randn(64, 1, generator=gen)
    write_checkpoint(root, PARENT, 1, {0: [("w", w, slice(0, 2))], 1: [("w", w, slice(2, 4))]})
    # The child changed m only: rank 0 writes m, both ranks reference their piece of w.
    write_checkpoint(root, CHILD, 2, {0: [("m", m, slice(0, 64))]})
    parent_files = {r: f"{PARENT}/{data_path(r, ATTEMPTS[PARENT])}" for r in range(2)}
    add_references(root, CHILD, {r: [(parent_files[r], w_row(root, PARENT, r))] for r in range(2)}, [4, 3], alg)
    write_json(
        root / "description.json",
        {
            "description": "A root of two checkpoints: step-1 (1.0, w on two ranks) and step-2 (1.1), in which rank 0 "
            "wrote m and both ranks store their piece of the unchanged w by reference to step-1's data files. "
            "Opening step-2 reads w from step-1's files, verified against the checksums step-2 carries. "
            f"step-2's piece hashes are {alg} (SPEC 6.3).",
            "checkpoint": CHILD,
            "world_size": 2,
            "step": 2,
            "attempt": ATTEMPTS[CHILD],
            "block_size": BLOCK,
            "tensors": {"w": describe_tensor(w), "m": describe_tensor(m)},
            "objects": {},
            "rank_objects": {"0": {}, "1": {}},
            "data_files": {data_path(0, ATTEMPTS[CHILD]): ["m"], data_path(1, ATTEMPTS[CHILD]): []},
        },
    )


def invalid_case(name: str, expected: dict[str, Any], checkpoint: str = CHILD) -> Path:
    root = INVALID / name
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(VALID / ROOT_CASE, root, ignore=shutil.ignore_patterns("description.json"))
    write_json(root / "expected_error.json", {**expected, "checkpoint": checkpoint, "source": ROOT_CASE})
    return root


def edit_child(
    root: Path,
    edit_local: Callable[[dict[str, Any]], None] | None = None,
    edit_global: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """Edit step-2's rank-0 local manifest and/or its global manifest, re-sealing sizes and checksums above them."""
    ckpt, attempt = root / CHILD, ATTEMPTS[CHILD]
    manifest_file = ckpt / f"manifest-{attempt}.msgpack"
    document = unpack(manifest_file.read_bytes())
    if edit_local is not None:
        local = local_doc(root, CHILD, 0)
        edit_local(local)
        raw_local = pack(local)
        (ckpt / local_path(0, attempt)).write_bytes(raw_local)
        document["files"][0]["index_size"] = len(raw_local)
        document["files"][0]["index_crc32c"] = crc32c.crc32c(raw_local)
    if edit_global is not None:
        edit_global(document)
    raw = pack(document)
    manifest_file.write_bytes(raw)
    marker = json.loads((ckpt / "COMMITTED").read_text())
    marker["manifest_size"], marker["manifest_crc32c"] = len(raw), crc32c.crc32c(raw)
    (ckpt / "COMMITTED").write_text(json.dumps(marker, indent=1) + "\n")


def build_invalid() -> None:
    parent_file = f"{PARENT}/{data_path(0, ATTEMPTS[PARENT])}"

    root = invalid_case(
        "reference_outside_root",
        expect(
            "FormatError",
            "open",
            "SPEC.md §6.2: a reference path names a data file of a checkpoint of the same root; no '..'",
            "step-2's global manifest references ../references_basic/step-1/... (outside the root)",
            ["reference path", "../"],
        ),
    )
    edit_child(root, edit_global=lambda d: d["references"][0].update(path=f"../{ROOT_CASE}/{parent_file}"))

    root = invalid_case(
        "reference_uncommitted",
        expect(
            "NotCommittedError",
            "open",
            "SPEC.md §6.2/§8 step 2a: a referenced checkpoint MUST be committed, its COMMITTED naming the attempt",
            "step-1's COMMITTED is missing; step-2 references step-1's data files",
            ["step-1", "golden1"],
            ["step-1"],
        ),
    )
    (root / PARENT / "COMMITTED").unlink()

    root = invalid_case(
        "reference_wrong_size",
        expect(
            "IntegrityError",
            "read",
            "SPEC.md §8 step 5: a referenced file whose size differs from the reference's data_size is refused",
            "step-2 says step-1/data/00000-golden1.safetensors has 8 bytes more than it has (in both manifests)",
            [parent_file],
            [parent_file],
        ),
    )
    size = (root / parent_file).stat().st_size + 8
    edit_child(
        root,
        edit_local=lambda d: d["references"][0].update(data_size=size),
        edit_global=lambda d: d["references"][0].update(data_size=size),
    )

    root = invalid_case(
        "reference_wrong_checksum",
        expect(
            "IntegrityError",
            "read",
            "SPEC.md §8 step 5: every referenced block is verified against the CRC32C the referencing manifest carries",
            "the carried CRC32C of rank 0's referenced piece of w has its lowest bit flipped",
            [parent_file, "w"],
            [parent_file],
        ),
    )

    def flip(local: dict[str, Any]) -> None:
        data = bytearray(local["referenced"]["crc32c"]["data"])
        data[0] ^= 1
        local["referenced"]["crc32c"]["data"] = bytes(data)

    edit_child(root, edit_local=flip)

    # A chain: step-3 references w rows 0:2 in step-2's rank-0 file, which does not hold them (step-2 references
    # them itself). The carried checksums are those of the real bytes, so a reader fails them, and a verifier,
    # which reads step-2's local manifest, names the chain.
    child_file = f"{CHILD}/{data_path(0, ATTEMPTS[CHILD])}"
    root = invalid_case(
        "reference_chain",
        expect(
            "IntegrityError",
            "read",
            "SPEC.md §6.2 'No chains': a reference names the file that holds the bytes, never one that references them",
            "step-3 references w rows 0:2 in step-2's rank-0 file, where step-2 stores them by reference",
            [child_file, "w"],
            ["chain"],
        ),
        checkpoint="step-3",
    )
    gen = torch.Generator().manual_seed(3)
    write_checkpoint(root, "step-3", 3, {0: [("m", torch.randn(64, 1, generator=gen), slice(0, 64))]})
    chained = w_row(root, PARENT, 0)
    refs = {0: [(child_file, chained)], 1: [(f"{PARENT}/{data_path(1, ATTEMPTS[PARENT])}", w_row(root, PARENT, 1))]}
    add_references(root, "step-3", refs, [4, 3])

    child_manifest = f"{CHILD}/{local_path(0, ATTEMPTS[CHILD])}"
    root = invalid_case(
        "reference_unknown_hash_alg",
        expect(
            "FormatError",
            "read",
            "SPEC.md §6.3: a hash column's alg is blake3-128 or blake2b-128; a reader refuses any other",
            "step-2's rank-0 local manifest names its hash columns' algorithm sha256-128",
            [child_manifest, "sha256-128"],
            [child_manifest, "sha256-128"],
        ),
    )

    def unknown_alg(local: dict[str, Any]) -> None:
        local["piece_hash"]["alg"] = local["referenced"]["hash"]["alg"] = "sha256-128"

    edit_child(root, edit_local=unknown_alg)


def main() -> None:
    torch.use_deterministic_algorithms(True)
    build_valid(ROOT_CASE, "blake2b-128")
    build_valid(BLAKE3_CASE, "blake3-128")
    build_invalid()
    print(f"valid/{ROOT_CASE}, valid/{BLAKE3_CASE}, invalid/reference_*")


if __name__ == "__main__":
    main()
