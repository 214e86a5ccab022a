"""Format 1.2's piece index (SPEC 11.1): a global manifest's tensor entries in name-sorted, CRC32C-checked blocks.

The blocks follow the manifest's head document; its fence table lets a reader range-read only the blocks it needs.
"""

from __future__ import annotations

import bisect
import itertools
import struct
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import crc32c

from shardckpt.errors import FormatError, IntegrityError
from shardckpt.format import limits
from shardckpt.format.columns import (
    U32LE,
    decode_int_list,
    decode_u32_column,
    encode_int_column,
    encode_u32_column,
)
from shardckpt.format.strict import Fields, check_name

FEATURE = "piece_index"  # the must_understand entry of a manifest and marker whose manifest has a piece index
FIRST_VERSION = (1, 2)  # the version that added the piece index (SPEC 2.1)
_NAMES_ENC = "nul-zlib"  # the fence's first names: UTF-8, each ended by NUL, the whole zlib-compressed
_FENCE_KEYS = frozenset({"tensors", "blocks", "first", "size", "crc32c", "count"})


@dataclass(frozen=True)
class PieceIndex:
    """The fence table: for block i its first tensor name, byte size, CRC32C and tensor count. Blocks lie end to end
    from the end of the head document (the region), in order; block i holds the names first[i] <= n < first[i+1]."""

    first: tuple[str, ...]
    size: tuple[int, ...]
    crc32c: tuple[int, ...]
    count: tuple[int, ...]

    @property
    def blocks(self) -> int:
        return len(self.first)

    @property
    def tensors(self) -> int:
        return sum(self.count)

    @property
    def region_size(self) -> int:
        return sum(self.size)

    def offsets(self) -> list[int]:
        """Where each block starts, relative to the region's start."""
        return [0, *itertools.accumulate(self.size)][:-1]

    def blocks_for(self, names: Iterable[str]) -> list[int]:
        """The sorted numbers of the blocks that hold `names` if the checkpoint has them (a name before the first
        block's first is in none)."""
        found = {bisect.bisect_right(self.first, name) - 1 for name in names}
        found.discard(-1)
        return sorted(found)

    def runs(self, blocks: Sequence[int]) -> list[tuple[int, int, int, int]]:
        """(first block, end block, region offset, bytes) of each run of consecutive `blocks`: one read each."""
        offsets, runs = self.offsets(), []
        for _, group in itertools.groupby(enumerate(blocks), key=lambda pair: pair[1] - pair[0]):
            numbers = [number for _, number in group]
            begin, end = numbers[0], numbers[-1] + 1
            runs.append((begin, end, offsets[begin], offsets[end - 1] + self.size[end - 1] - offsets[begin]))
        return runs


def array_header(count: int) -> bytes:
    """The msgpack header of an array of `count` items (a block is one array of pre-packed entries)."""
    if count < 16:
        return bytes([0x90 | count])
    if count < 1 << 16:
        return b"\xdc" + struct.pack(">H", count)
    return b"\xdd" + struct.pack(">I", count)


def build_index(
    entries: Sequence[tuple[str, bytes]], *, block_bytes: int = 0, counts: Sequence[int] = ()
) -> tuple[bytes, PieceIndex]:
    """The region and its fence from (name, packed entry) sorted by name: each block closed once it holds
    `block_bytes` or more, or (re-encoding a decoded manifest) blocks of exactly `counts` entries."""
    if not counts:
        sizes, grouped, total = [], [], 0
        for _, packed in entries:
            total += len(packed)
            grouped.append(packed)
            if total >= block_bytes:
                sizes.append(len(grouped))
                grouped, total = [], 0
        if grouped:
            sizes.append(len(grouped))
        counts = sizes
    if sum(counts) != len(entries):
        raise FormatError(f"piece index: blocks of {sum(counts)} entries for {len(entries)} tensors")
    parts, first, size, crcs = [], [], [], []
    at = 0
    for count in counts:
        block = array_header(count) + b"".join(packed for _, packed in entries[at : at + count])
        first.append(entries[at][0])
        size.append(len(block))
        crcs.append(int(crc32c.crc32c(block)))
        parts.append(block)
        at += count
    return b"".join(parts), PieceIndex(tuple(first), tuple(size), tuple(crcs), tuple(counts))


def encode_piece_index(index: PieceIndex) -> dict[str, Any]:
    """The fence as the head stores it under "piece_index"."""
    names = b"".join(name.encode("utf-8") + b"\x00" for name in index.first)
    return {
        "tensors": index.tensors,
        "blocks": index.blocks,
        "first": {"enc": _NAMES_ENC, "n": index.blocks, "data": zlib.compress(names, 6)},
        "size": encode_int_column(list(index.size)),
        "crc32c": encode_u32_column(list(index.crc32c)),
        "count": encode_int_column(list(index.count)),
    }


def decode_piece_index(raw: object, where: str) -> PieceIndex:
    """Strictly decode a fence: sizes, counts, checksums in range; first names valid and strictly increasing."""
    where = f"{where} piece_index"
    fields = Fields(raw, where)
    extra = set(fields.raw) - _FENCE_KEYS
    if extra:
        raise FormatError(f"{where}: unknown field {min(map(str, extra))!r}")
    tensors = fields.integer("tensors", 0, limits.MAX_INDEX_TENSORS)
    blocks = fields.integer("blocks", 0, min(tensors, limits.MAX_INDEX_BLOCKS))
    size = decode_int_list(fields.get("size", dict), f"{where}.size", blocks)
    count = decode_int_list(fields.get("count", dict), f"{where}.count", blocks)
    column = fields.get("crc32c", dict)
    if column.get("enc") != U32LE:
        raise FormatError(f"{where}.crc32c: column encoding must be {U32LE!r}, got {column.get('enc')!r}")
    crcs = tuple(int(value) for value in decode_u32_column(column, f"{where}.crc32c", blocks).tolist())
    for number in range(blocks):
        if not 1 <= size[number] <= limits.MAX_INDEX_BLOCK_BYTES:
            raise FormatError(
                f"{where}: block {number} size {size[number]} is outside 1..{limits.MAX_INDEX_BLOCK_BYTES}"
            )
        if not 1 <= count[number] <= tensors:
            raise FormatError(f"{where}: block {number} count {count[number]} is outside 1..{tensors}")
    if sum(count) != tensors:
        raise FormatError(f"{where}: the blocks hold {sum(count)} tensors, the field 'tensors' says {tensors}")
    if sum(size) > limits.MAX_GLOBAL_MANIFEST_BYTES:
        raise FormatError(f"{where}: the blocks total {sum(size)} bytes, over the manifest limit")
    # Every first name is inside its block, so the names take fewer bytes than the blocks: a zlib bomb stops there.
    first = _decode_names(fields.get("first", dict), f"{where}.first", blocks, sum(size))
    return PieceIndex(first, tuple(size), crcs, tuple(count))


def _decode_names(column: dict[str, Any], where: str, expected: int, most: int) -> tuple[str, ...]:
    if column.get("enc") != _NAMES_ENC or column.get("n") != expected or type(column.get("data")) is not bytes:
        raise FormatError(f"{where}: must be {{'enc': {_NAMES_ENC!r}, 'n': {expected}, 'data': binary}}")
    if set(column) != {"enc", "n", "data"}:
        raise FormatError(f"{where}: a names column has exactly the fields enc, n, data")
    bound = min(most, expected * (4 * limits.MAX_NAME_CHARS + 1))  # UTF-8 is at most 4 bytes a character
    inflater = zlib.decompressobj()
    try:
        raw = inflater.decompress(column["data"], bound + 1)
    except zlib.error as exc:
        raise FormatError(f"{where}: not valid zlib ({exc})") from None
    if len(raw) > bound or inflater.unconsumed_tail or inflater.unused_data or not inflater.eof:
        raise FormatError(f"{where}: does not decode to {expected} NUL-ended names")
    if expected == 0:
        if raw:
            raise FormatError(f"{where}: holds names but the index has no blocks")
        return ()
    if not raw.endswith(b"\x00"):
        raise FormatError(f"{where}: the last name is not ended by NUL")
    parts = raw[:-1].split(b"\x00")
    if len(parts) != expected:
        raise FormatError(f"{where}: holds {len(parts)} names, expected {expected}")
    try:
        names = [part.decode("utf-8") for part in parts]
    except UnicodeDecodeError:
        raise FormatError(f"{where}: a name is not valid UTF-8") from None
    for number, name in enumerate(names):
        check_name(name, f"{where}[{number}]")
        if number and not names[number - 1] < name:
            raise FormatError(f"{where}: first names must increase strictly, but block {number} starts with {name!r}")
    return tuple(names)


def check_block(data: bytes, index: PieceIndex, number: int, where: str) -> None:
    """Block `number`'s bytes against the fence: size and CRC32C (IntegrityError naming the block)."""
    size, crc = index.size[number], index.crc32c[number]
    if len(data) != size or int(crc32c.crc32c(data)) != crc:
        raise IntegrityError(
            f"{where}: piece index block {number} (tensors from {index.first[number]!r}) holds {len(data)} bytes "
            f"with CRC32C {int(crc32c.crc32c(data)):#010x}, the manifest's fence promises {size} with {crc:#010x}"
        )


def check_block_names(names: Sequence[str], index: PieceIndex, number: int, where: str) -> None:
    """A decoded block's names: as many as the fence counts, the first its fence name, strictly increasing, and
    all before the next block's first (so a name is in exactly the block blocks_for finds)."""
    at = f"{where}: piece index block {number}"
    if len(names) != index.count[number]:
        raise FormatError(f"{at} holds {len(names)} tensors, the fence counts {index.count[number]}")
    if names[0] != index.first[number]:
        raise FormatError(f"{at} starts with {names[0]!r}, the fence says {index.first[number]!r}")
    for earlier, later in zip(names, names[1:]):
        if not earlier < later:
            raise FormatError(f"{at}: tensor names must increase strictly, but {later!r} follows {earlier!r}")
    if number + 1 < index.blocks and not names[-1] < index.first[number + 1]:
        raise FormatError(
            f"{at}: tensor {names[-1]!r} is not before the next block's first {index.first[number + 1]!r}"
        )


def listed(fields: Fields, version: tuple[int, int]) -> bool:
    """Whether a document uses the index (SPEC 2, 11.1): its field is there if and only if must_understand lists
    the feature, and only from version 1.2."""
    named = FEATURE in (fields.raw.get("must_understand") or ())
    if named != ("piece_index" in fields.raw):
        raise FormatError(f"{fields.where}: 'piece_index' must be in must_understand if and only if the field is there")
    if named and version < FIRST_VERSION:
        raise FormatError(f"{fields.where}: a piece index needs format 1.2 or later, got {version[0]}.{version[1]}")
    return named
