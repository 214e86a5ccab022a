"""Format 1.1 references (SPEC 6.2, 6.3): pieces stored in a data file of an earlier committed checkpoint of the
same root, the paths that name such files, the referenced piece tables and the piece hashes (BLAKE3-128; BLAKE2b-128
as the previous release wrote them).

Pure: decoding and validating untrusted documents, no I/O. Every failure is a FormatError naming file and field.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import blake3
import numpy as np

from shardckpt.errors import FormatError, IntegrityError
from shardckpt.format import limits
from shardckpt.format.columns import (
    Int64Array,
    UInt32Array,
    decode_int_column,
    decode_u32_column,
    encode_int_column,
    encode_u32_column,
)
from shardckpt.format.layout import data_path, validate_attempt
from shardckpt.format.strict import Fields

FEATURE = "references"  # the must_understand entry of every document that uses references
HASH_ALG = "blake3-128"  # what this library writes (SPEC 6.3)
LEGACY_HASH_ALG = "blake2b-128"  # what the previous release wrote: still read, verified and never referenced
HASH_ALGS = (HASH_ALG, LEGACY_HASH_ALG)  # closed: any other alg is refused
HASH_BYTES = 16
AUTO_THREADS = blake3.blake3.AUTO  # piece_hash(threads=...): BLAKE3's own pool, one thread per core
FIRST_VERSION = (1, 1)  # the version that added references (SPEC 6.2)

_NAME = r"[0-9A-Za-z._-]{1,255}"
_CHECKPOINT_NAME = re.compile(_NAME)
_REFERENCE = re.compile(rf"({_NAME})/data/([0-9]{{5,8}})-([0-9a-z]{{1,{limits.MAX_ATTEMPT_CHARS}}})\.safetensors")


# ------------------------------------------------------------------------------------------------- paths


@dataclass(frozen=True)
class ReferencePath:
    """A data file of another checkpoint of the same root: ROOT/<checkpoint>/data/<rank>-<attempt>.safetensors."""

    checkpoint: str
    rank: int
    attempt: str

    @property
    def path(self) -> str:
        """Relative to the root."""
        return f"{self.checkpoint}/{self.data}"

    @property
    def data(self) -> str:
        """Relative to the referenced checkpoint."""
        return data_path(self.rank, self.attempt)


def check_checkpoint_name(name: object) -> str:
    if not isinstance(name, str) or not _CHECKPOINT_NAME.fullmatch(name) or name in (".", ".."):
        raise FormatError(f"checkpoint name {name!r} is not 1..255 characters of [0-9A-Za-z._-] (nor '.' or '..')")
    return name


def reference_path(checkpoint: str, rank: int, attempt: str) -> str:
    return ReferencePath(check_checkpoint_name(checkpoint), rank, validate_attempt(attempt)).path


def parse_reference_path(path: object, *, own_attempt: str, own_name: str | None = None) -> ReferencePath:
    """The file a reference path names; FormatError for anything but a data file of another checkpoint of the
    root (absolute paths, '..', URLs, the checkpoint itself), before anything touches storage."""
    if not isinstance(path, str) or len(path) > limits.MAX_PATH_CHARS:
        raise FormatError(
            f"reference path must be a string of at most {limits.MAX_PATH_CHARS} characters, got {path!r}"
        )
    match = _REFERENCE.fullmatch(path)
    # One message for traversal, absolute paths, URLs and typos alike: only <checkpoint>/data/... is legal.
    if match is None or match.group(1) in (".", ".."):
        raise FormatError(
            f"reference path {path!r} does not name a data file of a checkpoint of the same root "
            f"(expected <checkpoint name>/data/<rank>-<attempt>.safetensors)"
        )
    rank = int(match.group(2))
    if match.group(2) != f"{rank:05d}":
        raise FormatError(f"reference path {path!r} does not write its rank {rank} as exactly {rank:05d}")
    if rank >= limits.MAX_WORLD_SIZE:  # 8 digits reach 99,999,999; no checkpoint has a rank past 2^24 - 1
        raise FormatError(
            f"reference path {path!r} names rank {rank}, above the largest rank {limits.MAX_WORLD_SIZE - 1}"
        )
    checkpoint, attempt = match.group(1), match.group(3)
    if attempt == own_attempt or checkpoint == own_name:
        raise FormatError(f"reference path {path!r} names the referencing checkpoint itself, not an earlier one")
    return ReferencePath(checkpoint, rank, attempt)


# ------------------------------------------------------------------------------------------------ hashes


class ContentHasher(Protocol):
    """An incremental piece hash: update with the piece's bytes in order, then its 16-byte digest."""

    def update(self, data: Any, /) -> object: ...

    def digest(self) -> bytes: ...


class _Blake3Hasher:
    __slots__ = ("inner",)

    def __init__(self, threads: int) -> None:
        self.inner = blake3.blake3(max_threads=threads)

    def update(self, data: Any, /) -> object:
        return self.inner.update(data)

    def digest(self) -> bytes:
        return self.inner.digest(HASH_BYTES)


def check_hash_alg(alg: object, where: str) -> str:
    """`alg` if it is one of HASH_ALGS; FormatError naming `where` and the alg otherwise (the set is closed)."""
    if alg not in HASH_ALGS:
        raise FormatError(f"{where}: hash algorithm {alg!r} is not one of {', '.join(map(repr, HASH_ALGS))}")
    return str(alg)


def new_hasher(alg: str = HASH_ALG, *, threads: int = 1) -> ContentHasher:
    """An incremental hasher of `alg`; threads > 1 (or AUTO_THREADS) lets BLAKE3 split one piece over its threads."""
    if alg == LEGACY_HASH_ALG:
        return hashlib.blake2b(digest_size=HASH_BYTES)
    check_hash_alg(alg, "piece hash")
    return _Blake3Hasher(threads)


def piece_hash(data: Any, alg: str = HASH_ALG, *, threads: int = 1) -> bytes:
    """The content hash of a piece's stored bytes (SPEC 6.3): BLAKE3 (default mode, first 16 bytes of its output),
    or BLAKE2b with a 16-byte digest and no key. Both release the GIL from 2 KiB on, so threads overlap."""
    if alg == LEGACY_HASH_ALG:
        return hashlib.blake2b(data, digest_size=HASH_BYTES).digest()
    check_hash_alg(alg, "piece hash")
    return blake3.blake3(data, max_threads=threads).digest(HASH_BYTES)


def encode_hash_column(digests: Sequence[bytes], alg: str = HASH_ALG) -> dict[str, Any]:
    if any(len(digest) != HASH_BYTES for digest in digests):
        raise FormatError(f"a {alg} digest is {HASH_BYTES} bytes")
    return {"alg": check_hash_alg(alg, "hash column"), "n": len(digests), "data": b"".join(digests)}


def decode_hash_column(column: object, where: str, expected_n: int) -> tuple[str, bytes]:
    """(alg, the 16n digest bytes) of a hash column; FormatError for an unknown algorithm, a count or length."""
    fields = Fields(column, where)
    alg = check_hash_alg(fields.get("alg", str), where)
    n = fields.integer("n", 0, limits.MAX_PIECES_PER_TENSOR)
    if n != expected_n:
        raise FormatError(f"{where}: {n} hashes for {expected_n} pieces")
    data = fields.get("data", bytes)
    if len(data) != HASH_BYTES * n:
        raise FormatError(f"{where}: hash column holds {len(data)} bytes, expected {HASH_BYTES * n}")
    return alg, bytes(data)


# ------------------------------------------------------------------------------------- referenced files


@dataclass(frozen=True)
class ReferencedFile:
    """A data file of another checkpoint that pieces of this one are stored in, with its size."""

    target: ReferencePath
    data_size: int
    logical_size: int | None = None  # format 1.2: the holder file is compressed; offsets address this extent

    @property
    def path(self) -> str:
        return self.target.path

    @property
    def extent(self) -> int:
        """The byte range piece offsets in this file address: logical when compressed (SPEC 4.1)."""
        return self.data_size if self.logical_size is None else self.logical_size

    def entry(self) -> dict[str, Any]:
        """The `references[j]` map (local manifests; the global one adds the rank)."""
        extra = {} if self.logical_size is None else {"logical_size": self.logical_size}
        return {"path": self.path, "data_size": self.data_size, **extra}


@dataclass(frozen=True)
class GlobalReference:
    """A global manifest's reference entry: rank `rank`'s local manifest carries the checksums of the pieces stored
    in `file`. Entry j is the piece tables' file index len(files) + j."""

    rank: int
    file: ReferencedFile


def uses_references(fields: Fields) -> bool:
    """Whether a document lists the references feature (check_header has validated must_understand)."""
    return FEATURE in (fields.raw.get("must_understand") or ())


def _check_feature(fields: Fields, version: tuple[int, int], used: bool) -> None:
    """SPEC 2: a document lists the feature if and only if it uses it, and uses it only from version 1.1."""
    if not used and uses_references(fields):
        raise FormatError(
            f"{fields.where}: lists {FEATURE!r} in must_understand but names no referenced checkpoint or file; a "
            "document lists exactly the features it uses"
        )
    if used and not uses_references(fields):
        raise FormatError(
            f"{fields.where}: stores pieces by reference but does not list {FEATURE!r} in must_understand"
        )
    if used and version < FIRST_VERSION:
        raise FormatError(f"{fields.where}: references need format version 1.1 or later, got {version[0]}.{version[1]}")


def _referenced_file(raw: object, where: str, own_attempt: str) -> ReferencedFile:
    fields = Fields(raw, where)
    try:
        target = parse_reference_path(fields.get("path", str), own_attempt=own_attempt)
    except FormatError as exc:
        raise FormatError(f"{where}: {exc}") from None
    data_size = fields.integer("data_size", 8, limits.MAX_EXTENT)
    logical_size = fields.integer("logical_size", 8, limits.MAX_EXTENT, optional=True)
    if logical_size is not None and logical_size < data_size:  # stored blocks are never larger than logical ones
        raise FormatError(f"{where}: logical_size {logical_size} is below data_size {data_size}")
    return ReferencedFile(target, data_size, logical_size)


def _references_list(fields: Fields, version: tuple[int, int]) -> list[Any]:
    """A document's `references` array (empty when absent), its feature declared and its length within limits."""
    raw: list[Any] = fields.get("references", list, optional=True) or []
    _check_feature(fields, version, bool(raw))
    if len(raw) > limits.MAX_FILES:
        raise FormatError(f"{fields.where}: {len(raw)} references exceed the limit of {limits.MAX_FILES}")
    return raw


def decode_global_references(
    fields: Fields, version: tuple[int, int], attempt: str, world_size: int
) -> tuple[GlobalReference, ...]:
    """The global manifest's `references` (SPEC 6.2, appendix A); empty when absent."""
    raw = _references_list(fields, version)
    entries = []
    for index, item in enumerate(raw):
        where = f"{fields.where} references[{index}]"
        rank = Fields(item, where).integer("rank", 0, world_size - 1)
        entries.append(GlobalReference(rank, _referenced_file(item, where, attempt)))
    ranks = [entry.rank for entry in entries]
    if ranks != sorted(ranks):
        raise FormatError(f"{fields.where}: references must be listed by rank, in ascending order")
    if len({(entry.rank, entry.file.path) for entry in entries}) != len(entries):
        raise FormatError(f"{fields.where}: a rank lists one referenced file twice")
    return tuple(entries)


def check_committed_references(
    listed: Sequence[tuple[str, str]], references: Sequence[GlobalReference], where: str
) -> None:
    """COMMITTED's `references` must name exactly the checkpoints and attempts the manifest's references name."""
    named = sorted({(entry.file.target.checkpoint, entry.file.target.attempt) for entry in references})
    if list(listed) != named:
        raise FormatError(f"{where}: COMMITTED lists referenced checkpoints {list(listed)}, the manifest {named}")
    if len({checkpoint for checkpoint, _ in named}) != len(named):
        raise FormatError(f"{where}: references name two attempts of one checkpoint; only one can be committed")


def decode_committed_references(fields: Fields, version: tuple[int, int]) -> tuple[tuple[str, str], ...]:
    """COMMITTED's `references`: (checkpoint, attempt) pairs, sorted by name, one per name; empty when absent."""
    raw = _references_list(fields, version)
    pairs = []
    for index, item in enumerate(raw):
        entry = Fields(item, f"{fields.where} references[{index}]")
        try:
            name = check_checkpoint_name(entry.get("checkpoint", str))
            pairs.append((name, validate_attempt(entry.get("attempt", str))))
        except FormatError as exc:
            raise FormatError(f"{entry.where}: {exc}") from None
    names = [name for name, _ in pairs]
    if names != sorted(set(names)):
        raise FormatError(f"{fields.where}: references must be sorted by checkpoint name, one entry per checkpoint")
    return tuple(pairs)


def encode_global_references(entries: Sequence[GlobalReference]) -> list[dict[str, Any]]:
    """The global manifest's `references` array (the inverse of decode_global_references)."""
    return [{"rank": e.rank, **e.file.entry()} for e in entries]


def encode_committed_references(pairs: Sequence[tuple[str, str]]) -> list[dict[str, str]]:
    """COMMITTED's `references` array: (checkpoint, attempt) pairs as maps, in the order given (sorted by name)."""
    return [{"checkpoint": name, "attempt": attempt} for name, attempt in pairs]


def committed_references(entries: Sequence[GlobalReference]) -> tuple[tuple[str, str], ...]:
    """The distinct (checkpoint, attempt) pairs a manifest's references name, sorted by name: COMMITTED's list."""
    return tuple(sorted({(e.file.target.checkpoint, e.file.target.attempt) for e in entries}))


# -------------------------------------------------------------------------------- referenced piece table


class ReferencedPieces:
    """A local manifest's referenced piece table: rows in (source, offset) order; start/length piece-major."""

    __slots__ = (
        "compression",
        "crc32c",
        "first_block",
        "hash",
        "k",
        "length",
        "nbytes",
        "offset",
        "position",
        "source",
        "start",
        "tensor",
    )

    def __init__(
        self,
        tensor: Int64Array,
        source: Int64Array,
        offset: Int64Array,
        start: Int64Array,
        length: Int64Array,
        crc32c: UInt32Array,
        digests: bytes,
        *,
        k_of: Int64Array,
        size_of: Int64Array,
        block_size: int,
        compression: ReferencedCompression | None = None,
    ) -> None:
        self.compression = compression  # format 1.2: where the rows held by compressed files are stored
        self.tensor, self.source, self.offset, self.start, self.length = tensor, source, offset, start, length
        self.crc32c, self.hash = crc32c, digests
        self.k = k_of[tensor] if tensor.size else np.zeros(0, np.int64)
        self.position = np.concatenate([[0], np.cumsum(self.k)[:-1]]).astype(np.int64) if tensor.size else self.k
        volume = np.ones(tensor.size, dtype=np.int64)
        has_dims = self.k > 0
        if length.size:
            volume[has_dims] = np.multiply.reduceat(length, self.position[has_dims])
        self.nbytes = volume * (size_of[tensor] if tensor.size else 0)
        blocks = -(-self.nbytes // block_size)
        self.first_block = np.concatenate([[0], np.cumsum(blocks)[:-1]]).astype(np.int64) if blocks.size else blocks

    @property
    def count(self) -> int:
        return int(self.tensor.size)

    def box(self, row: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        first, k = int(self.position[row]), int(self.k[row])
        return tuple(self.start[first : first + k].tolist()), tuple(self.length[first : first + k].tolist())

    def digest(self, row: int) -> bytes:
        return self.hash[HASH_BYTES * row : HASH_BYTES * (row + 1)]

    def find(self, source: int, offset: int) -> int | None:
        """The row of the piece at byte `offset` of referenced file `source`, if any."""
        rows = np.nonzero((self.source == source) & (self.offset == offset))[0]
        return int(rows[0]) if rows.size else None


@dataclass(frozen=True, eq=False)
class ReferencedCompression:
    """`referenced.compression` (SPEC 6.2, format 1.2): the stored blocks of the rows whose source is compressed,
    in row order. The table's `crc32c` then holds those rows' STORED checksums, as a compressed file's does (4.1)."""

    stored_offset: Int64Array  # per compressed row: the file byte of its first stored block
    stored: UInt32Array  # per block of those rows: its stored size, 1..its logical size
    crc32c: UInt32Array  # per block of those rows: the CRC32C of its logical bytes

    def block_map(
        self, pieces: ReferencedPieces, compressed_rows: Int64Array, block_size: int
    ) -> tuple[Int64Array, Int64Array, UInt32Array]:
        """(stored start, stored size, logical CRC32C) per block of the whole table (zero for raw rows' blocks),
        indexed as the table's `crc32c` column."""
        total = int(pieces.crc32c.size)
        starts, sizes = np.zeros(total, np.int64), np.zeros(total, np.int64)
        logical = np.zeros(total, np.uint32)
        blocks = -(-pieces.nbytes[compressed_rows] // block_size)
        if not blocks.size:
            return starts, sizes, logical
        first = pieces.first_block[compressed_rows]
        row_of_block = np.repeat(np.arange(blocks.size, dtype=np.int64), blocks)
        begin = np.concatenate([[0], np.cumsum(blocks)[:-1]]).astype(np.int64)
        positions = first[row_of_block] + np.arange(row_of_block.size, dtype=np.int64) - begin[row_of_block]
        stored = self.stored.astype(np.int64)
        within = np.cumsum(stored) - stored - np.concatenate([[0], np.cumsum(stored)])[begin][row_of_block]
        starts[positions] = self.stored_offset[row_of_block] + within
        sizes[positions] = stored
        logical[positions] = self.crc32c
        return starts, sizes, logical


def encode_referenced_compression(table: ReferencedCompression) -> dict[str, Any]:
    return {
        "stored_offset": encode_int_column(table.stored_offset),
        "stored": encode_u32_column(table.stored),
        "crc32c": encode_u32_column(table.crc32c),
    }


def compressed_rows(pieces: ReferencedPieces, files: Sequence[ReferencedFile]) -> Int64Array:
    """The rows of the table whose source file is compressed, in row order."""
    flags = np.array([entry.logical_size is not None for entry in files], dtype=bool)
    return np.nonzero(flags[pieces.source])[0].astype(np.int64) if pieces.count else np.zeros(0, np.int64)


def _referenced_compression(
    raw: object, where: str, pieces: ReferencedPieces, files: Sequence[ReferencedFile], block_size: int, names: Any
) -> ReferencedCompression | None:
    """Decode and bound `referenced.compression`: present exactly when a source is compressed (SPEC 6.2)."""
    rows = compressed_rows(pieces, files)
    if raw is None:
        if rows.size:
            raise FormatError(f"{where}: references a compressed file but has no 'compression' map")
        return None
    if not rows.size:
        raise FormatError(f"{where}.compression: present, but no referenced file is compressed")
    fields = Fields(raw, f"{where}.compression")
    nbytes = pieces.nbytes[rows]
    logical = _block_sizes(nbytes, block_size)
    stored_offset = decode_int_column(fields.raw.get("stored_offset"), f"{fields.where}.stored_offset", int(rows.size))
    stored = decode_u32_column(fields.raw.get("stored"), f"{fields.where}.stored", int(logical.size))
    crcs = decode_u32_column(fields.raw.get("crc32c"), f"{fields.where}.crc32c", int(logical.size))
    stored64 = stored.astype(np.int64)
    bad = (stored64 < 1) | (stored64 > logical)
    if bad.any():
        block = int(np.argmax(bad))
        raise FormatError(
            f"{fields.where}: block {block} is stored in {int(stored64[block])} bytes, outside 1..its "
            f"{int(logical[block])} logical bytes"
        )
    counts = -(-nbytes // block_size)
    ends = np.cumsum(stored64)
    per_row = ends[np.cumsum(counts) - 1] - np.concatenate([[0], ends])[np.cumsum(counts) - counts]
    sizes = np.array([entry.data_size for entry in files], dtype=np.int64)[pieces.source[rows]]
    outside = (stored_offset < 8) | (stored_offset > sizes) | (stored_offset + per_row > sizes)
    if outside.any():
        row = int(rows[int(np.argmax(outside))])
        raise FormatError(
            f"{fields.where}: the stored blocks of piece {row} of tensor {names[int(pieces.tensor[row])]!r} "
            f"({int(per_row[int(np.argmax(outside))])} bytes at {int(stored_offset[int(np.argmax(outside))])}) lie "
            f"outside {files[int(pieces.source[row])].path} of {int(sizes[int(np.argmax(outside))])} bytes"
        )
    # Stored blocks lie in row order, as the rows' logical pieces do: a range read of consecutive rows is one range.
    same = pieces.source[rows][1:] == pieces.source[rows][:-1]
    if (same & (stored_offset[1:] < stored_offset[:-1] + per_row[:-1])).any():
        raise FormatError(f"{fields.where}: the stored blocks of two rows of one file overlap or are out of order")
    return ReferencedCompression(stored_offset, stored, crcs)


def _block_sizes(nbytes: Int64Array, block_size: int) -> Int64Array:
    counts = -(-nbytes // block_size)
    sizes = np.full(int(counts.sum()), block_size, dtype=np.int64)
    if sizes.size:
        sizes[np.cumsum(counts) - 1] = nbytes - (counts - 1) * block_size
    return sizes


@dataclass(frozen=True, eq=False)
class LocalReferences:
    """What format 1.1 adds to a local manifest: piece hashes, referenced files and pieces (each may be absent);
    `hash_alg` is the algorithm of both its hash columns (SPEC 6.3: one per document)."""

    piece_hash: bytes | None
    files: tuple[ReferencedFile, ...]
    pieces: ReferencedPieces | None
    hash_alg: str = HASH_ALG


def encode_local_references(references: LocalReferences) -> dict[str, Any]:
    """The 1.1 fields of a local manifest (piece_hash, references, referenced), each only when present."""
    document: dict[str, Any] = {}
    if references.piece_hash is not None:
        document["piece_hash"] = encode_hash_column(
            [references.piece_hash[i : i + HASH_BYTES] for i in range(0, len(references.piece_hash), HASH_BYTES)],
            references.hash_alg,
        )
    pieces = references.pieces
    if pieces is not None:
        document["references"] = [f.entry() for f in references.files]
        document["referenced"] = {
            "count": pieces.count,
            "tensor": encode_int_column(pieces.tensor),
            "source": encode_int_column(pieces.source),
            "offset": encode_int_column(pieces.offset),
            "start": encode_int_column(pieces.start),
            "length": encode_int_column(pieces.length),
            "crc32c": encode_u32_column(pieces.crc32c),
            "hash": encode_hash_column([pieces.digest(row) for row in range(pieces.count)], references.hash_alg),
        }
        if pieces.compression is not None:
            document["referenced"]["compression"] = encode_referenced_compression(pieces.compression)
    return document


def decode_local_references(
    fields: Fields,
    version: tuple[int, int],
    attempt: str,
    *,
    piece_count: int,
    extents: Int64Array,
    extent_position: Int64Array,
    k_of: Int64Array,
    size_of: Int64Array,
    names: Sequence[str],
    block_size: int,
) -> LocalReferences:
    """Decode a local manifest's piece_hash, references and referenced table (SPEC 6.2, 6.3) after its 1.0 fields;
    extents/extent_position/k_of/size_of describe its tensor table as local_manifest's decoder builds them."""
    where = fields.where
    digests, alg = None, HASH_ALG
    if fields.raw.get("piece_hash") is not None:
        alg, digests = decode_hash_column(fields.raw["piece_hash"], f"{where} piece_hash", piece_count)
    raw_files = fields.get("references", list, optional=True) or []
    raw_table = fields.get("referenced", dict, optional=True)
    _check_feature(fields, version, bool(raw_files) or raw_table is not None)
    if raw_table is None:
        if raw_files:
            raise FormatError(f"{where}: lists referenced files but has no referenced piece table")
        return LocalReferences(digests, (), None, alg)
    if not raw_files:  # rows would name a source that does not exist, and a table of none means nothing
        raise FormatError(f"{where}: has a referenced piece table but lists no referenced files")
    if len(raw_files) > limits.MAX_FILES:
        raise FormatError(f"{where}: {len(raw_files)} references exceed the limit of {limits.MAX_FILES}")
    files = tuple(_referenced_file(item, f"{where} references[{i}]", attempt) for i, item in enumerate(raw_files))
    if len({entry.path for entry in files}) != len(files):
        raise FormatError(f"{where}: a referenced file is listed twice")
    table = Fields(raw_table, f"{where} referenced")
    table_alg, pieces = _referenced_pieces(table, files, extents, extent_position, k_of, size_of, names, block_size)
    if digests is not None and table_alg != alg:
        raise FormatError(
            f"{where}: piece_hash is {alg!r} but referenced.hash is {table_alg!r}; one local manifest hashes with one "
            "algorithm"
        )
    if files and set(range(len(files))) != set(pieces.source.tolist()):
        raise FormatError(f"{where}: a referenced file holds none of the referenced pieces")
    return LocalReferences(digests, files, pieces, table_alg)


def _referenced_pieces(
    table: Fields,
    files: tuple[ReferencedFile, ...],
    extents: Int64Array,
    extent_position: Int64Array,
    k_of: Int64Array,
    size_of: Int64Array,
    names: Sequence[str],
    block_size: int,
) -> tuple[str, ReferencedPieces]:
    """The referenced piece table and the algorithm of its hash column."""
    where = table.where
    # Checksums first, as in the 1.0 table: stored raw, their count bounds the rows before anything inflates.
    if table.raw.get("crc32c") is None:
        raise FormatError(f"{where}: missing field 'crc32c' (the block checksums of the referenced bytes)")
    crcs = decode_u32_column(table.raw["crc32c"], f"{where}.crc32c")
    count = table.integer("count", 0, min(limits.MAX_PIECES_PER_TENSOR, int(crcs.size)))
    if table.raw.get("hash") is None:
        raise FormatError(f"{where}: missing field 'hash' (the content hash of every referenced piece)")
    alg, digests = decode_hash_column(table.raw["hash"], f"{where}.hash", count)
    tensor = decode_int_column(table.raw.get("tensor"), f"{where}.tensor", count)
    if tensor.size and (tensor.min() < 0 or tensor.max() >= k_of.size):
        raise FormatError(f"{where}: a piece names a tensor outside the table of {k_of.size}")
    source = decode_int_column(table.raw.get("source"), f"{where}.source", count)
    if source.size and (source.min() < 0 or source.max() >= len(files)):
        raise FormatError(f"{where}: a piece names a referenced file outside 0..{len(files) - 1}")
    offset = decode_int_column(table.raw.get("offset"), f"{where}.offset", count)
    k = k_of[tensor] if tensor.size else np.zeros(0, np.int64)
    values = int(k.sum())
    start = decode_int_column(table.raw.get("start"), f"{where}.start", values)
    length = decode_int_column(table.raw.get("length"), f"{where}.length", values)
    piece_of_value = np.repeat(np.arange(count, dtype=np.int64), k)
    first_value = np.concatenate([[0], np.cumsum(k)[:-1]]).astype(np.int64) if count else k
    within = np.arange(values, dtype=np.int64) - first_value[piece_of_value]
    bound = extents[extent_position[tensor[piece_of_value]] + within] if values else np.zeros(0, np.int64)
    if values:
        bad = (start < 0) | (length < 1) | (start > bound) | (length > bound) | (start + length > bound)
        if bad.any():
            row = int(piece_of_value[np.argmax(bad)])
            raise FormatError(f"{where}: piece {row} of tensor {names[int(tensor[row])]!r} lies outside it or is empty")
    pieces = ReferencedPieces(
        tensor, source, offset, start, length, crcs, digests, k_of=k_of, size_of=size_of, block_size=block_size
    )
    sizes = np.array([entry.extent for entry in files], dtype=np.int64)[source] if count else np.zeros(0, np.int64)
    # Each piece is < 2^62 bytes and offsets are checked against sizes < 2^62 first, so the sums cannot overflow.
    if count and ((offset < 8).any() or (offset > sizes).any() or (offset + pieces.nbytes > sizes).any()):
        row = int(np.argmax((offset < 8) | (offset > sizes) | (offset + pieces.nbytes > sizes)))
        raise FormatError(
            f"{where}: piece {row} of tensor {names[int(tensor[row])]!r} ({int(pieces.nbytes[row])} bytes at "
            f"{int(offset[row])}) lies outside {files[int(source[row])].path} of {int(sizes[row])} bytes"
        )
    if count > 1:
        same = source[1:] == source[:-1]
        if (source[1:] < source[:-1]).any() or (same & (offset[1:] < offset[:-1] + pieces.nbytes[:-1])).any():
            raise FormatError(f"{where}: pieces are not in (source, offset) order, or two of one file overlap")
    blocks = int((-(-pieces.nbytes // block_size)).sum())
    if crcs.size != blocks:
        raise FormatError(f"{where}: {crcs.size} checksums for {blocks} blocks of the referenced pieces")
    pieces.compression = _referenced_compression(table.raw.get("compression"), where, pieces, files, block_size, names)
    return alg, pieces


def check_local_references(
    local: Sequence[ReferencedFile], global_entries: Sequence[GlobalReference], rank: int, where: str
) -> None:
    """A local manifest's referenced files must be the global manifest's entries of its rank, in order."""
    expected = [entry.file.entry() for entry in global_entries if entry.rank == rank]
    found = [entry.entry() for entry in local]
    if found != expected:
        raise FormatError(f"{where}: references {found} differ from the global manifest's for rank {rank}: {expected}")


# ----------------------------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class PieceIdentity:
    """What makes two stored pieces the same piece: tensor name, dtype, global shape, layout and box."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    layout: str
    start: tuple[int, ...]
    length: tuple[int, ...]


def check_target(
    piece: PieceIdentity,
    offset: int,
    digest: bytes,
    holder: Sequence[tuple[int, PieceIdentity, bytes | None]],
    holder_referenced: Sequence[PieceIdentity],
    where: str,
    *,
    alg: str = HASH_ALG,
    holder_alg: str = HASH_ALG,
) -> None:
    """A referenced piece must be a piece its holder stores at `offset` itself (SPEC 6.2 "No chains").

    holder: the holder's own pieces as (offset, identity, hash or None); holder_referenced: the pieces the holder
    stores by reference; alg / holder_alg: the algorithms of `digest` and of the holder's hashes. FormatError for a
    chain, IntegrityError for any other mismatch.
    """
    stored = next((item for item in holder if item[0] == offset), None)
    if stored is not None and stored[1] == piece:
        if stored[2] is not None and holder_alg != alg:
            raise IntegrityError(
                f"{where}: the holder records {holder_alg} hashes, the reference to {piece.name!r} at byte {offset} "
                f"carries a {alg} hash: a reference carries the hash its holder recorded"
            )
        if stored[2] is not None and stored[2] != digest:
            raise IntegrityError(f"{where}: the holder records another hash for {piece.name!r} at byte {offset}")
        return
    if piece in holder_referenced:
        raise FormatError(
            f"{where}: chain: {piece.name!r} start {list(piece.start)} is itself stored by reference in the file "
            "it references; a reference must name the file that holds the bytes"
        )
    found = "nothing" if stored is None else f"{stored[1].name!r} start {list(stored[1].start)}"
    raise IntegrityError(
        f"{where}: {piece.name!r} start {list(piece.start)} length {list(piece.length)} is not stored at byte "
        f"{offset} of the file it references ({found} is)"
    )
