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
    unpack,
    write_json,
)

import shardckpt

CASE = "compressed_blocks"
U32 = "<u4"


def valid_compressed_blocks() -> None:
    case = ValidCase(
        CASE,
        "format 1.2: every block stored compressed (byte grouping, sign-rotated floats, zstd per group) or raw where "
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


def main() -> None:
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
