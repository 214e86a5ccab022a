"""The local manifest: one rank's tensor table, its pieces in file order, and the CRC32C of every block.

Columnar (a handful of columns per rank, not a map per piece), so a coordinator decodes and merges the
manifests of thousands of ranks with numpy; identical tensor tables are validated once.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardckpt.errors import FormatError
from shardckpt.format import limits
from shardckpt.format.bulk import gc_paused
from shardckpt.format.columns import (
    Int64Array,
    UInt32Array,
    decode_int_column,
    decode_u32_column,
    encode_int_column,
    encode_u32_column,
)
from shardckpt.format.compressed import (
    FEATURE as COMPRESSION,
)
from shardckpt.format.compressed import (
    LocalCompression,
    block_sizes,
    decode_local_compression,
    encode_local_compression,
)
from shardckpt.format.dtypes import DTYPE_SIZES
from shardckpt.format.layout import parse_data_path
from shardckpt.format.references import (
    FEATURE,
    LocalReferences,
    decode_local_references,
    encode_local_references,
)
from shardckpt.format.strict import (
    FORMAT_NAME,
    FORMAT_VERSION,
    Fields,
    ObjectEntry,
    attempt_field,
    block_size_field,
    check_header,
    check_name,
    decode_objects,
    unpack_manifest,
)
from shardckpt.format.values import pack_value

LAYOUTS = ("box", "flat")
NAME_SEPARATOR = "\x00"  # names never contain NUL, so the joined names split back unambiguously


@dataclass(frozen=True)
class TensorSpec:
    """A tensor as one rank declares it: global name, dtype, global shape and piece layout."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    layout: str

    @property
    def k(self) -> int:
        """Values per piece in the start/length columns: ndim for "box", 1 for "flat"."""
        return 1 if self.layout == "flat" else len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class LocalPieces:
    """One data file's pieces in file order; start/length hold k values per piece, back to back."""

    __slots__ = ("k", "length", "nbytes", "offset", "position", "start", "tensor")

    def __init__(
        self,
        specs: tuple[TensorSpec, ...],
        tensor: Int64Array,
        offset: Int64Array,
        start: Int64Array,
        length: Int64Array,
        *,
        k_of: Int64Array | None = None,
        size_of: Int64Array | None = None,
    ) -> None:
        """k_of/size_of: values per piece and itemsize of each tensor, when the caller has them already."""
        self.tensor, self.offset = tensor.astype(np.int64), offset.astype(np.int64)
        self.start, self.length = start.astype(np.int64), length.astype(np.int64)
        if k_of is None:
            k_of = np.array([spec.k for spec in specs], dtype=np.int64)
        if size_of is None:
            size_of = np.array([DTYPE_SIZES[spec.dtype] for spec in specs], dtype=np.int64)
        self.k = k_of[self.tensor] if self.tensor.size else np.zeros(0, np.int64)
        self.position = np.concatenate([[0], np.cumsum(self.k)[:-1]]).astype(np.int64) if self.k.size else self.k
        volume = np.ones(self.tensor.size, dtype=np.int64)
        has_dims = self.k > 0
        if self.length.size:
            volume[has_dims] = np.multiply.reduceat(self.length, self.position[has_dims])
        self.nbytes = volume * (size_of[self.tensor] if self.tensor.size else 0)

    @property
    def count(self) -> int:
        return int(self.tensor.size)

    def of_tensor(self, index: int, k: int) -> tuple[Int64Array, Int64Array, Int64Array]:
        """(offset, start (n, k), length (n, k)) of the pieces of tensor `index` in this file."""
        selected = np.nonzero(self.tensor == index)[0]
        gather = self.position[selected][:, None] + np.arange(k, dtype=np.int64)[None, :]
        return self.offset[selected], self.start[gather], self.length[gather]


@dataclass(frozen=True, eq=False)
class LocalManifest:
    attempt: str
    rank: int
    world_size: int
    data: str
    data_size: int
    header_size: int
    header_crc32c: int
    block_size: int
    tensors: tuple[TensorSpec, ...]
    pieces: LocalPieces
    crc32c: UInt32Array
    objects: tuple[ObjectEntry, ...] = ()
    step: int | None = None
    version: tuple[int, int] = FORMAT_VERSION
    references: LocalReferences | None = None  # format 1.1: piece hashes, pieces stored by reference
    compression: LocalCompression | None = None  # format 1.2: the data file's blocks are stored compressed

    @property
    def logical_size(self) -> int:
        """The end of the pieces' logical address space: data_size unless the file is compressed (SPEC 4.1)."""
        return self.data_size if self.compression is None else self.compression.logical_size


# ------------------------------------------------------------------------------------------- encoding


@gc_paused()
def encode_local_manifest(manifest: LocalManifest) -> bytes:
    specs = manifest.tensors
    document = {
        "format": FORMAT_NAME,
        "kind": "local",
        "version": list(manifest.version),
        "attempt": manifest.attempt,
        "rank": manifest.rank,
        "world_size": manifest.world_size,
        "step": manifest.step,
        "data": manifest.data,
        "data_size": manifest.data_size,
        "header_size": manifest.header_size,
        "header_crc32c": manifest.header_crc32c,
        "block_size": manifest.block_size,
        "tensors": {
            "count": len(specs),
            "names": NAME_SEPARATOR.join(spec.name for spec in specs),
            "dtypes": NAME_SEPARATOR.join(spec.dtype for spec in specs),
            "layouts": NAME_SEPARATOR.join(spec.layout for spec in specs),
            "ndim": encode_int_column([len(spec.shape) for spec in specs]),
            "shape": encode_int_column([dim for spec in specs for dim in spec.shape]),
        },
        "pieces": {
            "count": manifest.pieces.count,
            "tensor": encode_int_column(manifest.pieces.tensor),
            "offset": encode_int_column(manifest.pieces.offset),
            "start": encode_int_column(manifest.pieces.start),
            "length": encode_int_column(manifest.pieces.length),
        },
        "crc32c": encode_u32_column(manifest.crc32c),
        "objects": [{"name": o.name, "rank": o.rank, "value": o.value} for o in manifest.objects],
    }
    must = []
    if manifest.references is not None:
        document.update(encode_local_references(manifest.references))
        if manifest.references.pieces is not None:
            must.append(FEATURE)  # a 1.0 reader refuses it rather than miss pieces
    if manifest.compression is not None:
        document["compression"] = encode_local_compression(manifest.compression)
    refs = manifest.references
    if manifest.compression is not None or (refs is not None and any(f.logical_size is not None for f in refs.files)):
        must.append(COMPRESSION)  # a 1.1 reader refuses it rather than read compressed bytes as raw
    if must:
        document["must_understand"] = must
    return pack_value(document)


# ------------------------------------------------------------------------------------------- decoding


@gc_paused()
def decode_local_manifest(data: bytes, where: str = "local manifest") -> LocalManifest:
    """Strictly decode one rank's local manifest: every piece range-checked, packing and checksums counted."""
    fields = unpack_manifest(data, where, limits.MAX_LOCAL_MANIFEST_BYTES)
    version = check_header(fields, "local")
    attempt = attempt_field(fields)
    world_size = fields.integer("world_size", 1, limits.MAX_WORLD_SIZE)
    rank = fields.integer("rank", 0, world_size - 1)
    path = fields.get("data", str)
    try:
        path_rank, path_attempt = parse_data_path(path)
    except FormatError as exc:
        raise FormatError(f"{where}: {exc}") from None
    if (path_rank, path_attempt) != (rank, attempt):
        raise FormatError(f"{where}: data path {path!r} does not belong to rank {rank} of attempt {attempt}")
    data_size = fields.integer("data_size", 8, limits.MAX_EXTENT)
    # The header's own limit (SPEC 4) bounds what a verifier reads of it, whatever data_size claims.
    header_size = fields.integer("header_size", 8, min(data_size, 8 + limits.MAX_HEADER_JSON_BYTES))
    block_size = block_size_field(fields)
    table = Fields(fields.get("tensors", dict), f"{where} tensors")
    try:
        specs, extents, extent_position, k_of, size_of = _tensor_table(
            table.integer("count", 0, limits.MAX_FILES),
            table.get("names", str),
            table.get("dtypes", str),
            table.get("layouts", str),
            _column_bytes(table.raw.get("ndim")),
            _column_bytes(table.raw.get("shape")),
        )
    except FormatError as exc:
        raise FormatError(f"{where} tensors: {exc}") from None
    # Checksums first: every piece has at least one block, and the checksum column is stored raw, so its length
    # bounds the piece count by the document's size before any compressed piece column is inflated.
    crcs = decode_u32_column(fields.get("crc32c", dict), f"{where} crc32c")
    pieces = _pieces(
        Fields(fields.get("pieces", dict), f"{where} pieces"),
        specs,
        extents,
        extent_position,
        k_of,
        size_of,
        max_count=int(crcs.size),
    )
    if fields.raw.get("compression") is None:
        _check_packing(pieces, header_size, data_size, where)
    elif float(pieces.nbytes.astype(np.float64).sum()) > limits.MAX_EXTENT:  # the block count below stays exact
        raise FormatError(f"{where}: pieces hold more than 2^62 bytes")
    blocks = int((-(-pieces.nbytes // block_size)).sum())
    if crcs.size != blocks:
        raise FormatError(f"{where}: {crcs.size} checksums for {blocks} blocks")
    compression = decode_local_compression(
        fields,
        version,
        header_size=header_size,
        data_size=data_size,
        logical_blocks=block_sizes(pieces.nbytes, block_size),
    )
    if compression is not None:
        # Pieces tile the logical address space (SPEC 4.1); the stored blocks tile the file (checked above). The
        # block count is bounded by the raw checksum column, so block_sizes above allocated nothing hostile.
        _check_packing(pieces, header_size, compression.logical_size, where)
    objects = decode_objects(fields.get("objects", list, optional=True) or [], where, world_size)
    if any(entry.rank not in (None, rank) for entry in objects):
        raise FormatError(f"{where}: a local manifest may only hold shared objects and objects of rank {rank}")
    references = decode_local_references(
        fields,
        version,
        attempt,
        piece_count=pieces.count,
        extents=extents,
        extent_position=extent_position,
        k_of=k_of,
        size_of=size_of,
        names=[spec.name for spec in specs],
        block_size=block_size,
    )
    return LocalManifest(
        attempt=attempt,
        rank=rank,
        world_size=world_size,
        data=path,
        data_size=data_size,
        header_size=header_size,
        header_crc32c=fields.integer("header_crc32c", 0, (1 << 32) - 1),
        block_size=block_size,
        tensors=specs,
        pieces=pieces,
        crc32c=crcs,
        objects=objects,
        step=fields.integer("step", -(1 << 63), (1 << 63) - 1, optional=True),
        version=version,
        references=references,
        compression=compression,
    )


def _column_bytes(column: object) -> tuple[Any, ...]:
    # A hashable key for the cache below; the column itself is validated when decoded.
    if isinstance(column, dict):
        key = (column.get("enc"), column.get("n"), column.get("data"))
        # A hostile list or map cannot key the cache: it goes on as its type's name and fails validation.
        return tuple(
            part if part is None or isinstance(part, (str, int, float, bytes)) else repr(type(part)) for part in key
        )
    return (repr(type(column)),)


# Ranks of one expert-parallel group send one table, so a job sends as many distinct tables as it has EP
# coordinates (64-256 for DeepSeek-V3-class jobs): a cache smaller than that misses on every rank in rotation.
@functools.lru_cache(maxsize=256)
def _tensor_table(
    count: int,
    names_joined: str,
    dtypes_joined: str,
    layouts_joined: str,
    ndim_key: tuple[Any, ...],
    shape_key: tuple[Any, ...],
) -> tuple[tuple[TensorSpec, ...], Int64Array, Int64Array, Int64Array, Int64Array]:
    """Validate a tensor table once; every rank of a job usually sends the identical one.

    Errors name the tensor; the caller adds the file (the file is not part of the cache key).
    """
    names = names_joined.split(NAME_SEPARATOR) if count else []
    dtypes = dtypes_joined.split(NAME_SEPARATOR) if count else []
    layouts = layouts_joined.split(NAME_SEPARATOR) if count else []
    if len(names) != count or len(dtypes) != count or len(layouts) != count:
        raise FormatError(f"tensors table lists {count} tensors but its columns disagree")
    ndim = decode_int_column(_as_column(ndim_key), "ndim", count)
    if ndim.size and (ndim.min() < 0 or ndim.max() > limits.MAX_NDIM):
        raise FormatError(f"a tensor has more than {limits.MAX_NDIM} dimensions")
    dims = decode_int_column(_as_column(shape_key), "shape", int(ndim.sum()))
    if dims.size and (dims.min() < 0 or dims.max() > limits.MAX_EXTENT):
        raise FormatError("a tensor dimension is outside 0..2^62")
    specs, extents, seen = [], [], set()
    position = 0
    for name, dtype, layout, rank in zip(names, dtypes, layouts, ndim.tolist()):
        check_name(name, "tensor name")
        if name in seen:
            raise FormatError(f"tensor {name!r} appears twice")
        seen.add(name)
        if dtype not in DTYPE_SIZES or layout not in LAYOUTS:
            raise FormatError(f"tensor {name!r} has unknown dtype {dtype!r} or layout {layout!r}")
        shape = tuple(dims[position : position + rank].tolist())
        position += rank
        numel = math.prod(shape)
        if numel * DTYPE_SIZES[dtype] > limits.MAX_EXTENT:
            raise FormatError(f"tensor {name!r} of shape {list(shape)} holds more than 2^62 bytes")
        spec = TensorSpec(name, dtype, shape, layout)
        specs.append(spec)
        extents.append([numel] if layout == "flat" else list(shape))
    extent_position = np.array([0, *np.cumsum([len(e) for e in extents])], dtype=np.int64)
    flat_extents = np.array([x for e in extents for x in e], dtype=np.int64)
    k_of = np.array([spec.k for spec in specs], dtype=np.int64)
    size_of = np.array([DTYPE_SIZES[spec.dtype] for spec in specs], dtype=np.int64)
    return tuple(specs), flat_extents, extent_position, k_of, size_of


def _as_column(key: tuple[Any, ...]) -> object:
    return {"enc": key[0], "n": key[1], "data": key[2]} if len(key) == 3 else None


def _pieces(
    fields: Fields,
    specs: tuple[TensorSpec, ...],
    extents: Int64Array,
    extent_position: Int64Array,
    k_of: Int64Array,
    size_of: Int64Array,
    max_count: int,
) -> LocalPieces:
    where = fields.where
    count = fields.integer("count", 0, limits.MAX_PIECES_PER_TENSOR)
    if count > max_count:
        raise FormatError(f"{where}: {count} pieces but {max_count} block checksums in crc32c (one or more per piece)")
    tensor = decode_int_column(fields.raw.get("tensor"), f"{where}.tensor", count)
    if tensor.size and (tensor.min() < 0 or tensor.max() >= len(specs)):
        raise FormatError(f"{where}: a piece names a tensor outside the table of {len(specs)}")
    k = k_of[tensor] if tensor.size else np.zeros(0, np.int64)
    values = int(k.sum())
    offset = decode_int_column(fields.raw.get("offset"), f"{where}.offset", count)
    start = decode_int_column(fields.raw.get("start"), f"{where}.start", values)
    length = decode_int_column(fields.raw.get("length"), f"{where}.length", values)
    # The extent that bounds each start/length value: its tensor's dimension (box) or element count (flat).
    piece_of_value = np.repeat(np.arange(count, dtype=np.int64), k)
    first_value = np.concatenate([[0], np.cumsum(k)[:-1]]).astype(np.int64) if count else k
    within = np.arange(values, dtype=np.int64) - first_value[piece_of_value]
    bound = extents[extent_position[tensor[piece_of_value]] + within] if values else np.zeros(0, np.int64)
    if values and (
        start.min() < 0
        or length.min() < 1
        or (start > bound).any()
        or (length > bound).any()
        or (start + length > bound).any()
    ):
        bad = int(piece_of_value[np.argmax((start < 0) | (length < 1) | (start + length > bound))])
        raise FormatError(
            f"{where}: piece {bad} of tensor {specs[int(tensor[bad])].name!r} lies outside the tensor or is empty"
        )
    return LocalPieces(specs, tensor, offset, start, length, k_of=k_of, size_of=size_of)


def _check_packing(pieces: LocalPieces, header_size: int, data_size: int, where: str) -> None:
    """Pieces are listed in file order and sit back to back from the end of the header to the end of file."""
    # Each piece is < 2^62 bytes; a float sum first keeps the exact int64 sums below from overflowing.
    if float(pieces.nbytes.astype(np.float64).sum()) > data_size + 1.0:
        raise FormatError(f"{where}: pieces hold more bytes than the data file")
    ends = np.concatenate([[header_size], pieces.offset + pieces.nbytes])
    if (pieces.offset != ends[:-1]).any() or int(ends[-1]) != data_size:
        raise FormatError(f"{where}: pieces are not listed in file order, back to back from the header to the end")
