"""Regenerate the format 1.2 vectors of compressed data files (SPEC 4.1): `python spec/vectors/generate_compression.py`.

The valid case is written by the library with compression="zstd"; each invalid case copies it and breaks one rule at
the byte level with this script's own msgpack/CRC32C code, updating the size/CRC32C chain above the defect.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from generate import (
    ATTEMPT,
    BLOCK,
    INVALID,
    ValidCase,
    column_values,
    data_file,
    edit_global,
    edit_local,
    expect,
    invalid,
    local_file,
    make_column,
    unpack,
    write_json,
)

import shardckpt

CASE = "compressed_blocks"
U32 = "<u4"


def valid_compressed_blocks() -> None:
    case = ValidCase(
        CASE,
        "format 1.2: every block stored compressed (byte grouping, sign-rotated floats, Huffman-only deflate for "
        "exponent bytes and zstd for the other groups) or raw where "
        "it does not shrink (the random bytes of 'noise'); pieces are U8 safetensors entries of their stored bytes",
        2,
        7,
    )
    case.writers = [
        shardckpt.ShardWriter(
            str(case.dir), rank=rank, world_size=2, attempt=ATTEMPT, block_size=BLOCK, step=7, compression="zstd"
        )
        for rank in range(2)
    ]
    generator = torch.Generator().manual_seed(12)
    bf = case.tensor("bf", (torch.randn(96, 64, generator=generator) * 0.02).to(torch.bfloat16))
    f32 = case.tensor("f32", torch.randn(40, 100, generator=generator) * 0.05)
    case.tensor("noise", torch.randint(0, 256, (5000,), generator=generator, dtype=torch.uint8))
    case.tensor("zeros", torch.zeros(700, dtype=torch.int64))
    case.tensor("mask", torch.rand(33, generator=generator) > 0.5)
    case.tensor("odd", torch.randn(1001, generator=generator).to(torch.float16))
    case.tensor("scalar", torch.tensor(2.5, dtype=torch.float64))
    for rank in range(2):
        case.add_box(rank, "bf", (48 * rank, 0), (48, 64))
        case.add_box(rank, "f32", (20 * rank, 0), (20, 100))
        case.add_flat(rank, "odd", 501 * rank, 501 + 500 * rank)
    case.add_box(0, "noise", (0,), (5000,))
    case.add_box(1, "zeros", (0,), (700,))
    case.add_box(1, "mask", (0,), (33,))
    case.add_box(0, "scalar", (), ())
    case.add_object("trainer", {"step": 7})
    assert bf.numel() and f32.numel()
    case.finish()


def blocks_of(root: Path, rank: int, name: str) -> tuple[list[int], int]:
    """(indexes of the blocks of `name`'s piece in rank's file, in crc32c order; the file offset of its first
    stored byte), from the local manifest alone."""
    document = unpack((root / local_file(rank)).read_bytes())
    names = document["tensors"]["names"].split("\0")
    tensor, offset = column_values(document["pieces"]["tensor"]), column_values(document["pieces"]["offset"])
    ends = offset[1:] + [document["compression"]["logical_size"]]
    stored = np.frombuffer(document["compression"]["stored"]["data"], dtype=U32).astype(np.int64)
    first = 0
    for t, lo, hi in zip(tensor, offset, ends):
        count = -(-(hi - lo) // BLOCK)
        if names[t] == name:
            return list(range(first, first + count)), document["header_size"] + int(stored[:first].sum())
        first += count
    raise KeyError(name)


def _edit_u32(column: dict[str, Any], index: int, value: int) -> None:
    values = np.frombuffer(column["data"], dtype=U32).copy()
    values[index] = value
    column["data"] = values.astype(U32).tobytes()


@invalid("compression_not_listed", CASE)
def _not_listed(root: Path) -> dict[str, Any]:
    edit_local(root, 0, lambda d: d.update(must_understand=[]))
    return expect(
        "FormatError",
        "read",
        "SPEC.md §2, §4.1: a document that uses a feature without listing it in must_understand MUST be refused",
        f"{local_file(0)} has its compression table but an empty must_understand",
        [local_file(0), "compression"],
        [local_file(0)],
    )


@invalid("compression_listed_unused", "single_rank_basic")
def _listed_unused(root: Path) -> dict[str, Any]:
    edit_global(root, lambda d: d.update(must_understand=["compression"], version=[1, 2]))
    return expect(
        "FormatError",
        "open",
        "SPEC.md §2, §4.1: a document that lists an entry it understands but does not use MUST be refused",
        "the global manifest of a raw checkpoint lists 'compression' (version 1.2); no file has logical_size",
        ["compression"],
        [],
    )


@invalid("compression_version_1_1", CASE)
def _version(root: Path) -> dict[str, Any]:
    edit_local(root, 1, lambda d: d.update(version=[1, 1]))
    return expect(
        "FormatError",
        "read",
        "SPEC.md §4.1: compressed data files need format version 1.2 or later",
        f"{local_file(1)} is compressed but says version [1, 1]",
        [local_file(1), "1.2"],
        [local_file(1)],
    )


@invalid("compression_unknown_codec", CASE)
def _codec(root: Path) -> dict[str, Any]:
    edit_local(root, 1, lambda d: d["compression"].update(codec="lz4"))
    return expect(
        "FormatError",
        "read",
        "SPEC.md §4.1: codec is closed: 'zstd' only in 1.2",
        f"{local_file(1)} names codec 'lz4'",
        [local_file(1), "lz4"],
        [local_file(1)],
    )


@invalid("compression_stored_larger_than_block", CASE)
def _stored_larger(root: Path) -> dict[str, Any]:
    blocks, _ = blocks_of(root, 1, "zeros")
    edit_local(root, 1, lambda d: _edit_u32(d["compression"]["stored"], blocks[0], BLOCK + 1))
    return expect(
        "FormatError",
        "read",
        "SPEC.md §4.1: a block's stored size MUST be 1..its logical size",
        f"{local_file(1)}: the first block of 'zeros' claims {BLOCK + 1} stored bytes",
        [local_file(1), "block"],
        [local_file(1)],
    )


@invalid("compression_logical_size_differs", CASE)
def _logical_size(root: Path) -> dict[str, Any]:
    def edit(document: dict[str, Any]) -> None:
        document["files"][0]["logical_size"] += 8

    edit_global(root, edit)
    return expect(
        "FormatError",
        "read",
        "SPEC.md §4.1, §8 step 3: a compressed file's logical_size MUST equal its local manifest's",
        "files[0].logical_size of the global manifest is 8 more than rank 0's local manifest says",
        [local_file(0)],
        [local_file(0)],
    )


@invalid("compression_stored_bit_flip", CASE)
def _stored_flip(root: Path) -> dict[str, Any]:
    _, start = blocks_of(root, 1, "bf")
    path = root / data_file(1)
    raw = bytearray(path.read_bytes())
    raw[start + 20] ^= 0x04
    path.write_bytes(bytes(raw))
    return expect(
        "IntegrityError",
        "read",
        "SPEC.md §4.1: the CRC32C of a block's stored bytes MUST be verified before it is decompressed",
        f"one bit flipped at byte {start + 20} of {data_file(1)}: in block 0 of the stored piece of 'bf'",
        [data_file(1), "bf", "block 0"],
        [data_file(1)],
    )


@invalid("compression_logical_crc_wrong", CASE)
def _logical_crc(root: Path) -> dict[str, Any]:
    blocks, _ = blocks_of(root, 1, "zeros")

    def edit(document: dict[str, Any]) -> None:
        values = np.frombuffer(document["compression"]["crc32c"]["data"], dtype=U32)
        _edit_u32(document["compression"]["crc32c"], blocks[0], int(values[blocks[0]]) ^ 1)

    edit_local(root, 1, edit)
    return expect(
        "IntegrityError",
        "read",
        "SPEC.md §4.1: the decompressed bytes of a block MUST match the CRC32C of its logical bytes",
        f"{local_file(1)}: the logical CRC32C of block 0 of 'zeros' has one bit flipped",
        [data_file(1), "zeros", "block 0"],
        [data_file(1)],
    )


@invalid("compression_corrupt_frame", CASE)
def _corrupt_frame(root: Path) -> dict[str, Any]:
    blocks, start = blocks_of(root, 1, "zeros")
    document = unpack((root / local_file(1)).read_bytes())
    size = int(np.frombuffer(document["compression"]["stored"]["data"], dtype=U32)[blocks[0]])
    path = root / data_file(1)
    raw = bytearray(path.read_bytes())
    for at in range(start + 7, start + size):  # past the block and group headers: the zstd frame, zeroed
        raw[at] = 0
    path.write_bytes(bytes(raw))
    new_crc = crc32c.crc32c(bytes(raw[start : start + size]))
    edit_local(root, 1, lambda d: _edit_u32(d["crc32c"], blocks[0], new_crc))
    return expect(
        "IntegrityError",
        "read",
        "SPEC.md §4.1: a stored block that does not decode to exactly its logical size is an IntegrityError",
        f"block 0 of 'zeros' in {data_file(1)}: its zstd frame zeroed, the stored CRC32C updated to match",
        [data_file(1), "zeros", "block 0"],
        [data_file(1)],
    )


# ------------------------------------------------------------------ references to compressed holders (SPEC 6.2)

REF_CASE = "reference_to_compressed"
REF_ATTEMPTS = {"step-1": "golden1", "step-2": "golden2"}


def _reference_root(root: Path, big: bool) -> dict[str, Any]:
    """A root of step-1 (compressed, 1 rank, piece hashes) and step-2 (raw, written by the library with step-1 as its
    parent): step-2 stores 'w' (and, with `big`, the 3-block 'v') by reference to step-1's compressed file and
    writes 'm' itself. Returns the tensors."""
    from generate import describe_tensor, pinned_clock

    from shardckpt.storage import open_storage
    from shardckpt.write.parent import open_parent

    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    generator = torch.Generator().manual_seed(29)
    tensors = {"w": (torch.randn(1500, generator=generator) * 0.02).to(torch.bfloat16)}
    if big:
        tensors["v"] = (torch.randn(6000, generator=generator) * 0.02).to(torch.bfloat16)
    m = torch.randn(64, generator=generator)
    for step, name in ((1, "step-1"), (2, "step-2")):
        parent = open_parent(open_storage(str(root)), "step-1", list(tensors)) if step == 2 else None
        writer = shardckpt.ShardWriter(
            str(root / name),
            rank=0,
            world_size=1,
            attempt=REF_ATTEMPTS[name],
            block_size=BLOCK,
            step=step,
            compression="zstd" if step == 1 else None,
            piece_hashes=True,
            parent=parent,
        )
        for key, value in tensors.items():
            writer.add(key, value)
        writer.add("m", m + step)
        writer.close()
        with pinned_clock():
            shardckpt.commit(str(root / name), world_size=1, attempt=REF_ATTEMPTS[name])
    described = {key: describe_tensor(value) for key, value in tensors.items()}
    described["m"] = describe_tensor(m + 2)
    return described


def valid_reference_to_compressed() -> None:
    from generate import VALID

    root = VALID / REF_CASE
    described = _reference_root(root, big=True)
    write_json(
        root / "description.json",
        {
            "description": "format 1.2: a root of step-1 (compressed) and step-2 (raw), in which 'w' (one block) and "
            "'v' (three blocks) are stored by reference to step-1's compressed file: step-2's references[0] carries "
            "logical_size and its referenced table a compression map (stored_offset, stored sizes, logical CRC32Cs; "
            "its crc32c column holds the stored CRC32Cs). Opening step-2 reads and decodes step-1's stored blocks.",
            "checkpoint": "step-2",
            "world_size": 1,
            "step": 2,
            "attempt": REF_ATTEMPTS["step-2"],
            "block_size": BLOCK,
            "tensors": described,
            "objects": {},
            "rank_objects": {"0": {}},
            "data_files": {"data/00000-golden2.safetensors": ["m"]},
        },
    )


def _reference_invalid(name: str, big: bool, expected: dict[str, Any], edit: Any) -> None:
    from generate_references import edit_child

    root = INVALID / name
    _reference_root(root, big)
    edit_child(root, edit_local=edit[0], edit_global=edit[1])
    write_json(root / "expected_error.json", {**expected, "checkpoint": "step-2", "source": REF_CASE})
    print(f"invalid/{name}: {expected['operation']} -> {expected['error']}")


def invalid_references() -> None:
    local = "ranks/00000-golden2.msgpack"
    _reference_invalid(
        "reference_compressed_not_listed",
        True,
        expect(
            "FormatError",
            "read",
            "SPEC.md §6.2 (compressed holders): a local manifest that references a compressed file uses "
            "'compression' and MUST list it in must_understand",
            "step-2's local manifest references step-1's compressed file but lists only 'references'",
            [local, "compression"],
            [local],
        ),
        (lambda d: d.update(must_understand=["references"]), None),
    )

    def out_of_range(document: dict[str, Any]) -> None:
        table = document["referenced"]["compression"]["stored_offset"]
        values = column_values(table)
        values[-1] = document["references"][0]["data_size"] - 1
        table.update(make_column(values))

    _reference_invalid(
        "reference_compressed_stored_out_of_range",
        True,
        expect(
            "FormatError",
            "read",
            "SPEC.md §6.2 (compressed holders): stored_offset + sum(stored) <= data_size of the referenced file",
            "the last referenced row's stored_offset is one byte before the end of step-1's data file",
            [local, "stored blocks", "outside"],
            [local],
        ),
        (out_of_range, None),
    )

    def block_size(document: dict[str, Any]) -> None:
        document["block_size"] = 2 * BLOCK

    _reference_invalid(
        "reference_compressed_block_size_differs",
        False,
        expect(
            "FormatError",
            "verify",
            "SPEC.md §6.2 (compressed holders): a reference's blocks are of the referencing manifest's block_size, "
            "which MUST equal the holder's",
            "step-2 says block_size 8192 (its pieces are one block either way), step-1's compressed file has 4096",
            [],
            ["block size"],
        ),
        (block_size, block_size),
    )

    def stored_crc(document: dict[str, Any]) -> None:
        _edit_u32(document["referenced"]["crc32c"], 0, int.from_bytes(document["referenced"]["crc32c"]["data"][:4],
                                                                       "little") ^ 1)  # fmt: skip

    _reference_invalid(
        "reference_compressed_stored_crc_wrong",
        True,
        expect(
            "IntegrityError",
            "read",
            "SPEC.md §6.2, §4.1: a referenced row's stored blocks are checked against the stored CRC32C it carries",
            "the stored CRC32C of the first referenced block has one bit flipped",
            ["step-1/data/00000-golden1.safetensors", "block 0"],
            ["step-1"],
        ),
        (stored_crc, None),
    )


def main() -> None:
    if sys.argv[1:] == ["references"]:  # the 6.2 cases only: the vectors above keep their bytes
        torch.use_deterministic_algorithms(True)
        valid_reference_to_compressed()
        print(f"valid/{REF_CASE}")
        invalid_references()
        return
    torch.use_deterministic_algorithms(True)
    valid_compressed_blocks()
    print(f"valid/{CASE}")
    names = sys.argv[1:] or [
        "compression_not_listed",
        "compression_listed_unused",
        "compression_version_1_1",
        "compression_unknown_codec",
        "compression_stored_larger_than_block",
        "compression_logical_size_differs",
        "compression_stored_bit_flip",
        "compression_logical_crc_wrong",
        "compression_corrupt_frame",
    ]
    from generate import INVALID_CASES

    for name in names:
        root = INVALID / name
        if root.exists():
            shutil.rmtree(root)
        expected = INVALID_CASES[name](root)
        write_json(root / "expected_error.json", expected)
        print(f"invalid/{name}: {expected['operation']} -> {expected['error']}")


if __name__ == "__main__":
    main()
