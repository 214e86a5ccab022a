"""Manifest types of format v1 (global manifest, local manifest, COMMITTED marker) and their strict codecs.

Decoding checks every type, size, name, path and range before a value reaches the library; see SPEC.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import crc32c
import msgpack
import numpy as np

from shardckpt.errors import FormatError
from shardckpt.format import limits
from shardckpt.format.bulk import gc_paused
from shardckpt.format.columns import (
    DELTA_ZLIB,
    SMALL_COLUMN,
    Int64Array,
    column_values,
    decode_int_list,
    encode_int_column,
    encode_small_int_column,
    small_column_values,
)
from shardckpt.format.compressed import FEATURE as COMPRESSION
from shardckpt.format.compressed import check_feature as check_compression
from shardckpt.format.dtypes import DTYPE_SIZES, itemsize
from shardckpt.format.layout import parse_data_path, parse_local_manifest_path
from shardckpt.format.local_manifest import LAYOUTS, NAME_SEPARATOR
from shardckpt.format.marker import CommitMarker as CommitMarker
from shardckpt.format.marker import decode_commit_marker as decode_commit_marker
from shardckpt.format.marker import encode_commit_marker as encode_commit_marker
from shardckpt.format.piece_columns import SCAN_PIECES as _FEW_PIECES
from shardckpt.format.piece_columns import Geometry, SharedColumns
from shardckpt.format.piece_columns import PieceCheck as _PieceCheck
from shardckpt.format.piece_index import (
    FEATURE as INDEX_FEATURE,
)
from shardckpt.format.piece_index import (
    FIRST_VERSION as INDEX_VERSION,
)
from shardckpt.format.piece_index import (
    PieceIndex,
    build_index,
    check_block,
    check_block_names,
    decode_piece_index,
    encode_piece_index,
)
from shardckpt.format.piece_index import listed as index_listed
from shardckpt.format.references import (
    FEATURE,
    GlobalReference,
    decode_global_references,
    encode_global_references,
)
from shardckpt.format.strict import (
    DOCUMENT_DEPTH,
    FORMAT_NAME,
    FORMAT_VERSION,
    Fields,
    ObjectEntry,
    attempt_field,
    block_size_field,
    check_header,
    check_name,
    check_shape,
    created_field,
    decode_objects,
    unpack_manifest,
)
from shardckpt.format.values import ROOT_ITEMS, check_depth, pack_value, unpack_value

# (file, offset, start, length) of a few pieces as Python ints; start/length hold one list per piece.
PieceLists = tuple[Sequence[int], Sequence[int], list[list[int]], list[list[int]]]


# ----------------------------------------------------------------------------------------------- types


class PieceTable:
    """The stored pieces of one tensor as columns; decoded from the manifest on first use.

    start/length have shape (count, k): k = ndim for layout "box", 1 for layout "flat".
    """

    __slots__ = ("_arrays", "_check", "_encoded", "_geometry", "_lists", "count", "k")

    def __init__(
        self,
        file: Int64Array,
        offset: Int64Array,
        start: Int64Array,
        length: Int64Array,
    ) -> None:
        count = int(file.shape[0])
        self.count = count
        self.k = int(start.shape[1]) if start.ndim == 2 else 0
        self._arrays: tuple[Int64Array, Int64Array, Int64Array, Int64Array] | None = (
            np.ascontiguousarray(file, dtype=np.int64),
            np.ascontiguousarray(offset, dtype=np.int64),
            np.ascontiguousarray(start, dtype=np.int64).reshape(count, self.k),
            np.ascontiguousarray(length, dtype=np.int64).reshape(count, self.k),
        )
        self._encoded: dict[str, Any] | None = None
        self._check: Any = None
        self._lists: PieceLists | None = None
        self._geometry: Geometry | None = None

    @classmethod
    def from_lists(
        cls, k: int, file: list[int], offset: list[int], start: list[list[int]], length: list[list[int]]
    ) -> PieceTable:
        """A table of a few pieces from Python ints (checked by the caller): numpy arrays are made only if asked."""
        table = cls.__new__(cls)
        table.count, table.k = len(file), k
        table._arrays, table._encoded, table._check, table._lists = None, None, None, (file, offset, start, length)
        table._geometry = None
        return table

    @classmethod
    def lazy(cls, encoded: dict[str, Any], count: int, k: int, check: Any) -> PieceTable:
        table = cls.__new__(cls)
        table.count, table.k = count, k
        table._arrays, table._encoded, table._check, table._lists, table._geometry = None, encoded, check, None, None
        return table

    def arrays(self) -> tuple[Int64Array, Int64Array, Int64Array, Int64Array]:
        """(file, offset, start, length), decoding and range-checking them on first call."""
        if self._arrays is None:
            if self._lists is None and self.count > _FEW_PIECES:
                assert self._encoded is not None
                self._check.before_decoding(self.count)
                file, offset, geometry = self._check.decode(self._encoded, self.count, self.k)
                self._arrays = file, offset, geometry.start, geometry.length  # file, start, length: shared, read-only
                self._geometry, self._encoded = geometry, None
                return self._arrays
            file, offset, start, length = self.small_arrays()
            self._arrays = (
                np.array(file, dtype=np.int64),
                np.array(offset, dtype=np.int64),
                np.array(start, dtype=np.int64).reshape(self.count, self.k),
                np.array(length, dtype=np.int64).reshape(self.count, self.k),
            )
        return self._arrays

    def small_arrays(self) -> PieceLists:
        """arrays() as Python lists (start/length: a list per piece), decoded and checked without numpy when the
        tensor has few pieces (most tensors: numpy's per-call cost would be most of the work)."""
        if self._lists is None:
            if self._arrays is not None:
                file, offset, start, length = self._arrays
                self._lists = (file.tolist(), offset.tolist(), start.tolist(), length.tolist())
            elif self.count > _FEW_PIECES:
                self.arrays()
                return self.small_arrays()
            else:
                assert self._encoded is not None
                self._check.before_decoding(self.count)
                lists = (_decode_one_piece(self._encoded, self.k) if self.count == 1 else None) or _decode_piece_lists(
                    self._encoded, self.count, self.k, self._check.where
                )
                self._check.check_lists(*lists)
                self._lists, self._encoded = lists, None
        return self._lists

    def piece(self, number: int) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
        """(file, offset, start, length) of one piece as Python ints, without numpy for a tensor of few pieces."""
        if self._lists is not None or (self._arrays is None and self.count <= _FEW_PIECES):
            file, offset, start, length = self.small_arrays()
            return file[number], offset[number], tuple(start[number]), tuple(length[number])
        files, offsets, starts, lengths = self.arrays()
        return (
            int(files[number]),
            int(offsets[number]),
            tuple(starts[number].tolist()),
            tuple(lengths[number].tolist()),
        )

    def geometry(self) -> Geometry:
        """The pieces' boxes, with a search for those that overlap a box (shared by tables of the same boxes)."""
        if self._geometry is None:
            _, _, start, length = self.arrays()
            if self._geometry is None:
                self._geometry = Geometry(start, length)
        return self._geometry

    def overlapping(self, lo: Sequence[int], hi: Sequence[int]) -> Int64Array:
        """The numbers, increasing, of the pieces with start < hi and start + length > lo in every stored dimension
        (layout "flat": the one, of the flattened tensor), without a scan of a tiling that orders them."""
        return self.geometry().overlapping(lo, hi)

    def is_whole(self, shape: tuple[int, ...], layout: str) -> bool:
        """Whether this is one piece holding the whole tensor (the cover check's first case), cheaply decided."""
        if self.count != 1:
            return False
        _, _, start, length = self.piece(0)
        if layout == "flat":
            return start == (0,) and length == (math.prod(shape),)
        return not any(start) and length == shape

    @property
    def file(self) -> Int64Array:
        return self.arrays()[0]

    @property
    def offset(self) -> Int64Array:
        return self.arrays()[1]

    @property
    def start(self) -> Int64Array:
        return self.arrays()[2]

    @property
    def length(self) -> Int64Array:
        return self.arrays()[3]

    def encode(self) -> dict[str, Any]:
        """The table as the manifest stores it; made once (a save encodes the manifest it commits more than once)."""
        if self._encoded is not None:
            return self._encoded
        if self._lists is not None and self.count <= _FEW_PIECES:  # Python ints already: no numpy call per column
            file, offset, start, length = self._lists
            # Dimension-major, as below.
            starts = [row[dim] for dim in range(self.k) for row in start]
            lengths = [row[dim] for dim in range(self.k) for row in length]
            encoded = {
                "count": self.count,
                "file": encode_small_int_column(list(file)),
                "offset": encode_small_int_column(list(offset)),
                "start": encode_int_column(starts),
                "length": encode_int_column(lengths),
            }
        else:
            files, offsets, start_array, length_array = self.arrays()
            # Dimension-major: all dim-0 starts, then all dim-1 starts; each run compresses on its own.
            encoded = {
                "count": self.count,
                "file": encode_int_column(files),
                "offset": encode_int_column(offsets),
                "start": encode_int_column(start_array.T.reshape(-1)),
                "length": encode_int_column(length_array.T.reshape(-1)),
            }
        self._encoded = encoded
        return encoded


@dataclass(frozen=True, eq=False)
class TensorEntry:
    """One global tensor: name, dtype, global shape and the pieces that store it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    layout: str
    pieces: PieceTable

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


@dataclass(frozen=True)
class FileEntry:
    """One rank's data file and the local manifest that holds its checksums."""

    rank: int
    data: str
    data_size: int
    index: str
    index_size: int
    index_crc32c: int
    logical_size: int | None = None  # format 1.2: the file is compressed; piece offsets address this extent

    @property
    def extent(self) -> int:
        """The end of the address space of the file's piece offsets (SPEC 4.1)."""
        return self.data_size if self.logical_size is None else self.logical_size


@dataclass(frozen=True, eq=False)
class GlobalManifest:
    attempt: str
    world_size: int
    block_size: int
    files: tuple[FileEntry, ...]
    tensors: tuple[TensorEntry, ...]
    objects: tuple[ObjectEntry, ...] = ()
    step: int | None = None
    created: float = 0.0
    metadata: dict[str, Any] = field(default_factory=dict)
    version: tuple[int, int] = FORMAT_VERSION
    references: tuple[GlobalReference, ...] = ()  # format 1.1: piece file index len(files) + j is references[j]
    # Format 1.2 (SPEC 11.1): the fence of a manifest stored with a piece index. Decoded from a head alone (a
    # loading rank), `tensors` holds only the entries of the blocks read so far (`partial`).
    piece_index: PieceIndex | None = None
    index_block: int = 0  # bytes per piece index block when encoded; 0: no piece index (unless piece_index)
    partial: bool = False

    def tensor(self, name: str) -> TensorEntry | None:
        return self.tensor_index().get(name)

    def tensor_index(self) -> dict[str, TensorEntry]:
        index: dict[str, TensorEntry] | None = self.__dict__.get("_index")
        if index is None:
            index = {entry.name: entry for entry in self.tensors}
            object.__setattr__(self, "_index", index)
        return index

    @property
    def total_bytes(self) -> int:
        return sum(entry.data_size for entry in self.files)

    @property
    def compressed(self) -> bool:
        """Whether a data file it describes or references is compressed (SPEC 4.1, 6.2): its pieces' ranges are
        then stored blocks only the reader that decodes them can check."""
        return any(f.logical_size is not None for f in self.files) or any(
            e.file.logical_size is not None for e in self.references
        )


def _decode_piece_lists(raw: dict[str, Any], count: int, k: int, where: str) -> PieceLists:
    """_decode_piece_columns as Python lists, for a few pieces."""
    file = decode_int_list(raw.get("file"), f"{where} pieces.file", count)
    offset = decode_int_list(raw.get("offset"), f"{where} pieces.offset", count)
    start = decode_int_list(raw.get("start"), f"{where} pieces.start", count * k)
    length = decode_int_list(raw.get("length"), f"{where} pieces.length", count * k)
    # Stored dimension-major (all dim-0 values first): piece i's values are i, i + count, ...
    return file, offset, [list(start[i::count]) for i in range(count)], [list(length[i::count]) for i in range(count)]


def _decode_one_piece(raw: dict[str, Any], k: int) -> PieceLists | None:
    """_decode_piece_lists of a one-piece tensor (most tensors) when its four columns are well formed, with the
    values of each distinct column bytes cached; None otherwise (the general path then names the fault)."""
    try:
        columns = raw["file"], raw["offset"], raw["start"], raw["length"]
        encodings = [column["enc"] for column in columns]
        counts = [column["n"] for column in columns]
        data = [column["data"] for column in columns]
    except (KeyError, TypeError):  # not maps, or a key missing
        return None
    if encodings != _FOUR_DELTA_ZLIB or counts != [1, 1, k, k] or k > SMALL_COLUMN:
        return None
    if any(type(n) is not int for n in counts) or any(type(part) is not bytes for part in data):
        return None
    shared = _shared_columns(data[0], data[2], data[3], k)  # file, start, length: the same for most tensors
    offset = column_values(data[1], 1)  # distinct per tensor: not cached
    if shared is None or offset is None:
        return None
    return shared[0], offset, [list(shared[1])], [list(shared[2])]


_FOUR_DELTA_ZLIB = [DELTA_ZLIB] * 4


@functools.lru_cache(maxsize=4096)
def _shared_columns(
    file: bytes, start: bytes, length: bytes, k: int
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
    values = small_column_values(file, 1), small_column_values(start, k), small_column_values(length, k)
    return None if None in values else values  # type: ignore[return-value]


def _decode_tensor(raw: object, where: str, file_sizes: SharedColumns) -> TensorEntry:
    fields = Fields(raw, where)
    name = check_name(fields.get("name", str), where)
    where = f"{where.rsplit(' tensors', 1)[0]} tensor {name!r}"
    dtype = fields.get("dtype", str)
    if dtype not in DTYPE_SIZES:
        raise FormatError(f"{where}: unknown dtype {dtype!r}")
    size = DTYPE_SIZES[dtype]
    shape = check_shape(fields.get("shape", list), where)
    layout = fields.get("layout", str)
    if layout not in LAYOUTS:
        raise FormatError(f"{where}: layout must be one of {LAYOUTS}, got {layout!r}")
    if math.prod(shape) * size > limits.MAX_EXTENT:
        raise FormatError(f"{where}: tensor holds more than 2^62 bytes")
    pieces_raw = Fields(fields.get("pieces", dict), f"{where} pieces")
    count = pieces_raw.integer("count", 0, limits.MAX_PIECES_PER_TENSOR)
    k = 1 if layout == "flat" else len(shape)
    if math.prod(shape) == 0 and count:
        raise FormatError(f"{where}: a tensor with no elements cannot have stored pieces")
    check = _PieceCheck(where, shape, layout, size, file_sizes)
    return TensorEntry(name, dtype, shape, layout, PieceTable.lazy(pieces_raw.raw, count, k, check))


_ENTRY_KEYS = frozenset({"name", "dtype", "shape", "layout", "pieces"})
_PIECES_KEYS = frozenset({"count", "file", "offset", "start", "length"})
_COLUMN_KEYS = frozenset({"enc", "n", "data"})


_INT_ONLY = {int}
_Signature = tuple[str, str, tuple[int, ...]]


def _plain_tensor(
    raw: object, base: str, index: int, file_sizes: SharedColumns, checked: dict[_Signature, tuple[int, int]]
) -> TensorEntry | None:
    """_decode_tensor of an entry that has exactly the shape a writer gives it (these keys, these types, nothing
    nested further, so it needs no depth walk), else None for the general path. The same checks in the same order
    with the same messages, without typed field access; the dtype/layout/shape checks are made once per distinct
    (dtype, layout, shape) in `checked` (a MoE model repeats a few shapes 10^5 times). Texts for errors are made
    when raised; names are checked for UTF-8 by the caller, all at once."""
    if type(raw) is not dict or raw.keys() != _ENTRY_KEYS:
        return None
    name, dtype, layout, dims, pieces = raw["name"], raw["dtype"], raw["layout"], raw["shape"], raw["pieces"]
    if type(name) is not str or type(dtype) is not str or type(layout) is not str or type(dims) is not list:
        return None
    if dims and set(map(type, dims)) != _INT_ONLY:  # exactly int: a bool would hash and compare as 0 or 1
        return None
    if type(pieces) is not dict or pieces.keys() != _PIECES_KEYS or type(pieces["count"]) is not int:
        return None
    # The four columns, each {"enc": str, "n": int, "data": bytes}, in chained comparisons (no loop: per tensor).
    a, b, c, d = pieces["file"], pieces["offset"], pieces["start"], pieces["length"]
    if not type(a) is type(b) is type(c) is type(d) is dict:
        return None
    if not a.keys() == b.keys() == c.keys() == d.keys() == _COLUMN_KEYS:
        return None
    if not type(a["enc"]) is type(b["enc"]) is type(c["enc"]) is type(d["enc"]) is str:
        return None
    if not type(a["n"]) is type(b["n"]) is type(c["n"]) is type(d["n"]) is int:
        return None
    if not type(a["data"]) is type(b["data"]) is type(c["data"]) is type(d["data"]) is bytes:
        return None
    if not 1 <= len(name) <= limits.MAX_NAME_CHARS or "\x00" in name:
        check_name(name, f"{base} tensors[{index}]")  # raises
    shape = tuple(dims)
    signature = (dtype, layout, shape)
    known = checked.get(signature)
    if known is None:
        size = DTYPE_SIZES.get(dtype)
        if size is None:
            raise FormatError(f"{base} tensor {name!r}: unknown dtype {dtype!r}")
        if len(shape) > limits.MAX_NDIM or (shape and (min(shape) < 0 or max(shape) > limits.MAX_EXTENT)):
            check_shape(dims, f"{base} tensor {name!r}")  # raises
        numel = math.prod(shape)
        if numel > limits.MAX_EXTENT:
            check_shape(dims, f"{base} tensor {name!r}")  # raises
        if layout not in LAYOUTS:
            raise FormatError(f"{base} tensor {name!r}: layout must be one of {LAYOUTS}, got {layout!r}")
        if numel * size > limits.MAX_EXTENT:
            raise FormatError(f"{base} tensor {name!r}: tensor holds more than 2^62 bytes")
        known = checked[signature] = (size, numel)  # only once every check passed
    size, numel = known
    count = pieces["count"]
    if not 0 <= count <= limits.MAX_PIECES_PER_TENSOR:
        raise FormatError(
            f"{base} tensor {name!r} pieces: field 'count' = {count} is outside 0..{limits.MAX_PIECES_PER_TENSOR}"
        )
    if numel == 0 and count:
        raise FormatError(f"{base} tensor {name!r}: a tensor with no elements cannot have stored pieces")
    check = _PieceCheck((base, name), shape, layout, size, file_sizes)
    return TensorEntry(
        name, dtype, shape, layout, PieceTable.lazy(pieces, count, 1 if layout == "flat" else len(shape), check)
    )


def _decode_tensors(raw: list[Any], where: str, file_sizes: SharedColumns) -> tuple[TensorEntry, ...]:
    """Decode the tensor entries; the document was unpacked with "tensors" shallow, so entries of any other shape
    than a writer's are checked for depth here, before anything reads them."""
    decoded = []
    checked: dict[_Signature, tuple[int, int]] = {}
    for i, item in enumerate(raw):
        plain = _plain_tensor(item, where, i, file_sizes, checked)
        if plain is not None:
            decoded.append(plain)
            continue
        check_depth(item, where, DOCUMENT_DEPTH + 2)
        decoded.append(_decode_tensor(item, f"{where} tensors[{i}]", file_sizes))
    tensors = tuple(decoded)
    names = [entry.name for entry in tensors]
    try:  # check_name's UTF-8 rule for every name in one call (msgpack decodes text strictly: it holds)
        NAME_SEPARATOR.join(names).encode("utf-8")
    except UnicodeEncodeError:
        for name in names:
            check_name(name, f"{where} tensor names")
    if len(set(names)) != len(names):
        duplicate = next(name for name in names if names.count(name) > 1)
        raise FormatError(f"{where}: tensor {duplicate!r} appears twice")
    return tensors


# ------------------------------------------------------------------------------------ global manifest


@gc_paused()
def encode_global_manifest(manifest: GlobalManifest) -> bytes:
    document = {
        "format": FORMAT_NAME,
        "kind": "global",
        "version": list(manifest.version),
        "attempt": manifest.attempt,
        "world_size": manifest.world_size,
        "step": manifest.step,
        "created": manifest.created,
        "block_size": manifest.block_size,
        "files": [
            {
                "rank": f.rank,
                "data": f.data,
                "data_size": f.data_size,
                "index": f.index,
                "index_size": f.index_size,
                "index_crc32c": f.index_crc32c,
                **({} if f.logical_size is None else {"logical_size": f.logical_size}),
            }
            for f in manifest.files
        ],
        "tensors": [],
        "objects": [{"name": o.name, "rank": o.rank, "value": o.value} for o in manifest.objects],
        "metadata": manifest.metadata,
    }
    features = [FEATURE] if manifest.references else []
    if manifest.references:
        document["references"] = encode_global_references(manifest.references)
    if manifest.compressed:
        features.append(COMPRESSION)
    if manifest.piece_index is None and not manifest.index_block:
        document["tensors"] = [_encode_tensor(entry) for entry in manifest.tensors]
        if features:
            document["must_understand"] = features
        return pack_value(document)
    if manifest.partial or manifest.version < INDEX_VERSION:
        raise FormatError("a piece index is for whole manifests of format 1.2 or later (not one decoded in part)")
    # SPEC 11.1: the entries in blocks sorted by name after the head; a decoded manifest keeps its own blocks.
    entries = sorted(((e.name, pack_value(_encode_tensor(e))) for e in manifest.tensors), key=lambda pair: pair[0])
    counts = manifest.piece_index.count if manifest.piece_index is not None else ()
    region, index = build_index(entries, block_bytes=manifest.index_block, counts=counts)
    document["must_understand"] = [*features, INDEX_FEATURE]
    document["piece_index"] = encode_piece_index(index)
    return pack_value(document) + region


def manifest_head_size(data: bytes, where: str = "manifest") -> int:
    """The byte length of the head document that starts `data` (all of it for a manifest without a piece index)."""
    unpacker = msgpack.Unpacker(max_buffer_size=max(len(data), 1))
    unpacker.feed(data)
    try:
        unpacker.skip()
    except Exception as exc:  # OutOfData, StackError, ValueError: all mean one thing here
        raise FormatError(f"{where}: not valid msgpack ({type(exc).__name__}: {exc})") from None
    return int(unpacker.tell())


def _encode_tensor(entry: TensorEntry) -> dict[str, Any]:
    return {
        "name": entry.name,
        "dtype": entry.dtype,
        "shape": list(entry.shape),
        "layout": entry.layout,
        "pieces": entry.pieces.encode(),
    }


@gc_paused()
def decode_global_manifest(data: bytes, where: str = "manifest", *, head_only: bool = False) -> GlobalManifest:
    """Strictly decode a global manifest. Piece columns are range-checked when first used.

    head_only: `data` is the head of a manifest with a piece index (SPEC 11.1) alone: the result is `partial`, with
    no tensors until decode_index_blocks adds some."""
    if len(data) > limits.MAX_GLOBAL_MANIFEST_BYTES:
        raise FormatError(f"{where}: manifest is {len(data)} bytes, over the {limits.MAX_GLOBAL_MANIFEST_BYTES} limit")
    head = data if head_only else data[: manifest_head_size(data, where)]
    fields = unpack_manifest(head, where, limits.MAX_GLOBAL_MANIFEST_BYTES, shallow="tensors")
    version = check_header(fields, "global")
    index = _piece_index_field(fields, version)
    if index is None and (head_only or len(head) != len(data)):
        raise FormatError(f"{where}: {len(data) - len(head)} bytes follow the manifest, which has no piece index")
    attempt = attempt_field(fields)
    world_size = fields.integer("world_size", 1, limits.MAX_WORLD_SIZE)
    block_size = block_size_field(fields)
    raw_files = fields.get("files", list)
    if len(raw_files) > limits.MAX_FILES:
        raise FormatError(f"{where}: {len(raw_files)} files exceed the limit of {limits.MAX_FILES}")
    files = tuple(_decode_file(item, f"{where} files[{i}]", world_size, attempt) for i, item in enumerate(raw_files))
    if len(files) != world_size or [f.rank for f in files] != list(range(world_size)):
        raise FormatError(f"{where}: files must list one data file per rank, in rank order 0..{world_size - 1}")
    references = decode_global_references(fields, version, attempt, world_size)
    compressed = any(f.logical_size is not None for f in files)
    check_compression(fields, version, compressed or any(e.file.logical_size is not None for e in references))
    sizes = SharedColumns([f.extent for f in files] + [entry.file.extent for entry in references])
    tensors = _decode_tensors(fields.get("tensors", list), where, sizes)
    if index is not None and tensors:
        raise FormatError(f"{where}: a manifest with a piece index keeps its tensors there; 'tensors' must be empty")
    metadata = fields.get("metadata", dict, optional=True) or {}
    objects = decode_objects(fields.get("objects", list, optional=True) or [], where, world_size)
    if objects:  # a load by name could not tell which one the state dict's key means (SPEC 7)
        clash = {o.name for o in objects} & {t.name for t in tensors}
        if clash:
            raise FormatError(f"{where}: {min(clash)!r} is the name of a tensor and of an object")
    manifest = GlobalManifest(
        attempt=attempt,
        world_size=world_size,
        block_size=block_size,
        files=files,
        tensors=tensors,
        objects=objects,
        step=fields.integer("step", -(1 << 63), (1 << 63) - 1, optional=True),
        created=created_field(fields),
        metadata=metadata,
        version=version,
        references=references,
        piece_index=index,
        partial=index is not None,
    )
    if index is not None and not head_only:
        if len(data) - len(head) != index.region_size:
            raise FormatError(
                f"{where}: {len(data) - len(head)} bytes follow the head, its piece index has {index.region_size}"
            )
        offsets = index.offsets()
        blocks = {n: data[len(head) + offsets[n] : len(head) + offsets[n] + index.size[n]] for n in range(index.blocks)}
        manifest = decode_index_blocks(manifest, blocks, where)
    return manifest


def _piece_index_field(fields: Fields, version: tuple[int, int]) -> PieceIndex | None:
    """The fence, present if and only if must_understand lists "piece_index", and only from version 1.2."""
    if not index_listed(fields, version):
        return None
    return decode_piece_index(fields.raw["piece_index"], fields.where)


@gc_paused()
def decode_index_blocks(manifest: GlobalManifest, blocks: Mapping[int, bytes], where: str) -> GlobalManifest:
    """`manifest` (decoded from its head) with the tensors of the piece index `blocks` (number -> bytes) added: each
    size- and CRC32C-checked against the fence, then decoded strictly. All blocks: no longer partial."""
    index = manifest.piece_index
    assert index is not None
    sizes = SharedColumns([f.extent for f in manifest.files] + [e.file.extent for e in manifest.references])
    known = {entry.name: entry for entry in manifest.tensors}
    for number in sorted(blocks):
        if not 0 <= number < index.blocks:
            raise FormatError(f"{where}: the piece index has no block {number}")
        data = blocks[number]
        check_block(data, index, number, where)
        at = f"{where} piece index block {number}"
        raw = unpack_value(data, at, DOCUMENT_DEPTH + 1, shallow=ROOT_ITEMS)
        if type(raw) is not list:
            raise FormatError(f"{at}: expected an array of tensor entries, got {type(raw).__name__}")
        entries = _decode_tensors(raw, at, sizes)
        check_block_names([entry.name for entry in entries], index, number, where)
        known.update((entry.name, entry) for entry in entries)
    clash = {o.name for o in manifest.objects} & known.keys()
    if clash:
        raise FormatError(f"{where}: {min(clash)!r} is the name of a tensor and of an object")
    whole = len(known) == index.tensors
    tensors = tuple(sorted(known.values(), key=lambda entry: entry.name))
    return dataclasses.replace(manifest, tensors=tensors, partial=not whole)


def _decode_file(raw: object, where: str, world_size: int, attempt: str) -> FileEntry:
    fields = Fields(raw, where)
    rank = fields.integer("rank", 0, world_size - 1)
    data, index = fields.get("data", str), fields.get("index", str)
    for path, parse in ((data, parse_data_path), (index, parse_local_manifest_path)):
        try:
            path_rank, path_attempt = parse(path)
        except FormatError as exc:
            raise FormatError(f"{where}: {exc}") from None
        if (path_rank, path_attempt) != (rank, attempt):
            raise FormatError(f"{where}: path {path!r} does not belong to rank {rank} of attempt {attempt}")
    return FileEntry(
        rank=rank,
        data=data,
        data_size=fields.integer("data_size", 8, limits.MAX_EXTENT),
        index=index,
        index_size=fields.integer("index_size", 1, limits.MAX_LOCAL_MANIFEST_BYTES),
        index_crc32c=fields.integer("index_crc32c", 0, (1 << 32) - 1),
        logical_size=fields.integer("logical_size", 8, limits.MAX_EXTENT, optional=True),
    )


def tensor_entry(name: str, dtype: str, shape: tuple[int, ...], layout: str, table: PieceTable) -> TensorEntry:
    """Build an entry from trusted in-memory parts (the writer and coordinator), checking the same rules."""
    check_name(name, "tensor")
    itemsize(dtype)
    check_shape(shape, f"tensor {name!r}")
    if layout not in LAYOUTS:
        raise FormatError(f"tensor {name!r}: layout must be one of {LAYOUTS}, got {layout!r}")
    return TensorEntry(name, dtype, tuple(shape), layout, table)


def crc32c_of(data: bytes) -> int:
    """Checksum used for manifests and blocks (CRC32C, as S3 computes natively)."""
    return int(crc32c.crc32c(data))
