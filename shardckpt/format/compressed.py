"""Format 1.2's compressed data files (SPEC 4.1) in the manifests: the local `compression` table and block map.

Offsets in every manifest stay logical (as if uncompressed); this table maps each block to its stored bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from shardckpt.errors import FormatError
from shardckpt.format import limits
from shardckpt.format.codec import CODECS
from shardckpt.format.columns import Int64Array, UInt32Array, decode_u32_column, encode_u32_column
from shardckpt.format.strict import Fields

FEATURE = "compression"  # the must_understand entry of every manifest that describes a compressed data file
FIRST_VERSION = (1, 2)


@dataclass(frozen=True, eq=False)
class LocalCompression:
    """A compressed data file: its logical extent, every block's stored size and the CRC32C of its logical bytes.

    The local manifest's own `crc32c` column then covers the STORED bytes of each block (SPEC 4.1)."""

    codec: str
    logical_size: int  # header_size + the pieces' logical bytes: what the manifests' offsets address
    stored: UInt32Array  # per block, in crc32c order: 1..logical size of the block (equal means stored raw)
    crc32c: UInt32Array  # per block: CRC32C of the logical (decompressed) bytes


def block_sizes(nbytes: Int64Array, block_size: int) -> Int64Array:
    """The logical size of every block of pieces of `nbytes` bytes, pieces in order, each piece's blocks in order."""
    counts = -(-nbytes // block_size)
    sizes = np.full(int(counts.sum()), block_size, dtype=np.int64)
    if sizes.size:
        last = np.cumsum(counts) - 1
        sizes[last] = nbytes - (counts - 1) * block_size
    return sizes


def uses_compression(fields: Fields) -> bool:
    return FEATURE in (fields.raw.get("must_understand") or ())


def references_compressed(raw_references: object) -> bool:
    """Whether a `references` array names a compressed file (an entry with `logical_size`, SPEC 6.2): the manifest
    then uses the feature too. Read before the entries are decoded; they are validated there."""
    return isinstance(raw_references, list) and any(
        isinstance(item, dict) and item.get("logical_size") is not None for item in raw_references
    )


def check_feature(fields: Fields, version: tuple[int, int], used: bool) -> None:
    """SPEC 2: a manifest lists `compression` if and only if it describes a compressed file, from version 1.2."""
    if used != uses_compression(fields):
        raise FormatError(
            f"{fields.where}: "
            + (
                f"describes a compressed data file but does not list {FEATURE!r} in must_understand"
                if used
                else f"lists {FEATURE!r} in must_understand but describes no compressed data file"
            )
        )
    if used and version < FIRST_VERSION:
        raise FormatError(
            f"{fields.where}: compressed data files need format version 1.2 or later, got {version[0]}.{version[1]}"
        )


def encode_local_compression(table: LocalCompression) -> dict[str, Any]:
    return {
        "codec": table.codec,
        "logical_size": table.logical_size,
        "stored": encode_u32_column(table.stored),
        "crc32c": encode_u32_column(table.crc32c),
    }


def decode_local_compression(
    fields: Fields,
    version: tuple[int, int],
    *,
    header_size: int,
    data_size: int,
    logical_blocks: Int64Array,
) -> LocalCompression | None:
    """The local manifest's `compression` map (None when absent), every block's stored size checked against its
    logical size and the stored sizes against the data file's size."""
    raw = fields.raw.get("compression")
    check_feature(fields, version, raw is not None or references_compressed(fields.raw.get("references")))
    if raw is None:
        return None
    table = Fields(raw, f"{fields.where} compression")
    codec = table.get("codec", str)
    if codec not in CODECS:
        raise FormatError(f"{table.where}: unknown codec {codec!r}; this reader knows {', '.join(CODECS)}")
    logical_size = table.integer("logical_size", header_size, limits.MAX_EXTENT)
    count = int(logical_blocks.size)
    stored = decode_u32_column(table.raw.get("stored"), f"{table.where}.stored", count)
    crcs = decode_u32_column(table.raw.get("crc32c"), f"{table.where}.crc32c", count)
    stored64 = stored.astype(np.int64)
    if count and ((stored64 < 1).any() or (stored64 > logical_blocks).any()):
        bad = int(np.argmax((stored64 < 1) | (stored64 > logical_blocks)))
        raise FormatError(
            f"{table.where}: block {bad} is stored in {int(stored64[bad])} bytes, outside 1..its "
            f"{int(logical_blocks[bad])} logical bytes"
        )
    if header_size + int(stored64.sum()) != data_size:
        raise FormatError(
            f"{table.where}: the header and the stored blocks hold {header_size + int(stored64.sum())} bytes, but "
            f"data_size is {data_size}"
        )
    return LocalCompression(codec, logical_size, stored, crcs)


class BlockMap:
    """Where each block of a compressed file is stored: the file offset of its stored bytes, and their size."""

    def __init__(self, header_size: int, table: LocalCompression) -> None:
        self.table = table
        sizes = table.stored.astype(np.int64)
        self.starts: Int64Array = header_size + np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.sizes: Int64Array = sizes

    @classmethod
    def of_blocks(cls, table: LocalCompression, starts: Int64Array) -> BlockMap:
        """A map of blocks stored at `starts` (a referenced file's rows, SPEC 6.2), not back to back from a header."""
        blocks = cls(0, table)
        blocks.starts = starts
        return blocks

    def stored_range(self, first: int, last: int) -> tuple[int, int]:
        """File bytes [start, end) holding blocks first..last - 1 (file order, consecutive)."""
        return int(self.starts[first]), int(self.starts[last - 1] + self.sizes[last - 1])
