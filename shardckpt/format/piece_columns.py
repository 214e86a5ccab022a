"""A manifest's piece columns decoded and range-checked (SPEC 5, 6): each distinct column once per manifest, and
the pieces that overlap a box found by binary search along a dimension the tiling orders, not by a scan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from shardckpt.errors import CoverageError, FormatError
from shardckpt.format.columns import Int64Array, column_data, decode_int_column

# Tables of this many pieces or fewer are scanned: two binary searches and slices cost more than one comparison.
SCAN_PIECES = 16


class Geometry:
    """The boxes of a piece table, start and length of shape (count, k), read-only; shared by every table of one
    manifest whose start and length columns are the same bytes (under FSDP, every tensor of one shape)."""

    __slots__ = ("_axis", "_axis_ends", "_axis_starts", "_ends", "_nbytes", "checked", "count", "k", "length", "start")

    def __init__(self, start: Int64Array, length: Int64Array) -> None:
        self.start, self.length = _frozen(start), _frozen(length)
        self.count, self.k = (int(n) for n in self.start.shape)
        self._ends: Int64Array | None = None
        self._axis: int | None = -1  # -1: not looked for yet; None: no dimension orders the pieces
        self._axis_starts = self._axis_ends = np.zeros(0, np.int64)  # along the axis, contiguous (searchsorted)
        self._nbytes: dict[int, Int64Array] = {}
        self.checked: set[tuple[tuple[int, ...], str]] = set()  # (shape, layout) the boxes were checked against

    @property
    def ends(self) -> Int64Array:
        if self._ends is None:
            self._ends = _frozen(self.start + self.length)
        return self._ends

    def nbytes(self, size: int) -> Int64Array:
        """Each piece's bytes for elements of `size` bytes (the boxes were checked: no overflow)."""
        found = self._nbytes.get(size)
        if found is None:
            found = self._nbytes[size] = _frozen(np.prod(self.length, axis=1, dtype=np.int64) * size)
        return found

    def axis(self) -> int | None:
        """A dimension along which both the starts and the ends of the pieces never decrease (a row tiling's 0, a
        flat table's only one), preferring one they differ along; None if there is none."""
        if self._axis == -1:
            self._axis = None
            if self.count > SCAN_PIECES:
                start, ends = self.start, self.ends
                for dim in range(self.k):
                    s, e = start[:, dim], ends[:, dim]
                    if bool((s[1:] >= s[:-1]).all()) and bool((e[1:] >= e[:-1]).all()):
                        if self._axis is None or s[0] != s[-1]:
                            self._axis = dim
                        if s[0] != s[-1]:
                            break
                if self._axis is not None:
                    self._axis_starts = np.ascontiguousarray(start[:, self._axis])
                    self._axis_ends = np.ascontiguousarray(ends[:, self._axis])
        return self._axis

    def overlapping(self, lo: Sequence[int], hi: Sequence[int]) -> Int64Array:
        """The numbers, increasing, of the pieces with start < hi and start + length > lo in every dimension."""
        axis = self.axis()
        first = 0
        start, ends = self.start, self.ends
        if axis is not None:
            # Ends never decrease: those past lo are a suffix; starts never decrease: those before hi a prefix.
            first = int(np.searchsorted(self._axis_ends, lo[axis], side="right"))
            last = int(np.searchsorted(self._axis_starts, hi[axis], side="left"))
            if last <= first:
                return np.zeros(0, np.int64)
            if last - first <= SCAN_PIECES:  # a few candidates (a row tiling's one or two): plain integers
                rows = zip(start[first:last].tolist(), ends[first:last].tolist())
                hits = [
                    first + i
                    for i, (s, e) in enumerate(rows)
                    if all(a < b for a, b in zip(s, hi)) and all(a > b for a, b in zip(e, lo))
                ]
                return np.array(hits, dtype=np.int64)
            start, ends = start[first:last], ends[first:last]
        if not self.k:
            return np.arange(first, first + start.shape[0], dtype=np.int64)
        low, high = np.array(lo, dtype=np.int64), np.array(hi, dtype=np.int64)
        hit = np.nonzero(((start < high) & (ends > low)).all(axis=1))[0]
        return hit + first if first else hit

    def matching(self, start: Sequence[int], length: Sequence[int]) -> Int64Array:
        """The numbers of the pieces whose box is exactly (start, length)."""
        end = [a + n for a, n in zip(start, length)]
        hit = self.overlapping(start, end)
        if not hit.size:
            return hit
        same = (self.start[hit] == np.array(start, np.int64)) & (self.length[hit] == np.array(length, np.int64))
        found: Int64Array = hit[same.all(axis=1)]
        return found


def _frozen(array: Int64Array) -> Int64Array:
    """A contiguous, read-only view of `array`: tables share it, so a write through one would change the others. A
    view, so that the caller's own array stays writable."""
    view: Int64Array = np.ascontiguousarray(array, dtype=np.int64).view()
    view.flags.writeable = False
    return view


class SharedColumns:
    """What the tables of one manifest share: the file sizes, and each distinct long column decoded once, keyed by
    its bytes (a regular tiling repeats its file, start and length columns in every tensor of a shape). Only the
    tables' own data: at most as much memory as the tables would hold decoded one by one."""

    def __init__(self, file_sizes: list[int]) -> None:
        self.file_sizes = file_sizes
        self._sizes: Int64Array | None = None
        self._columns: dict[tuple[int, bytes], Int64Array] = {}
        self._geometries: dict[tuple[bytes, bytes, int, int], Geometry] = {}
        self._files_checked: set[int] = set()  # ids of file columns checked (the cache keeps them alive)
        self._limits: dict[tuple[int, int, int], tuple[Int64Array, Geometry]] = {}

    @property
    def sizes(self) -> Int64Array:
        if self._sizes is None:
            self._sizes = _frozen(np.array(self.file_sizes, dtype=np.int64))
        return self._sizes

    def column(self, column: object, where: str, n: int) -> Int64Array:
        """decode_int_column of a column, the same checks and errors, decoded once per distinct bytes."""
        data = column_data(column, where, n)
        key = (n, data)
        found = self._columns.get(key)
        if found is None:
            found = self._columns[key] = _frozen(decode_int_column(column, where, n))
        return found

    def geometry(self, start: object, length: object, count: int, k: int, where: str) -> Geometry:
        """The boxes of the start and length columns (stored dimension-major), decoded once per distinct pair."""
        starts = self.column(start, f"{where} pieces.start", count * k)
        lengths = self.column(length, f"{where} pieces.length", count * k)
        key = (start["data"], length["data"], count, k)  # type: ignore[index]  # checked by column()
        found = self._geometries.get(key)
        if found is None:
            found = Geometry(starts.reshape(k, count).T, lengths.reshape(k, count).T)
            self._geometries[key] = found
        return found

    def file_checked(self, file: Int64Array) -> bool:
        return id(file) in self._files_checked

    def mark_file_checked(self, file: Int64Array) -> None:
        self._files_checked.add(id(file))

    def room(self, file: Int64Array, geometry: Geometry, size: int) -> Int64Array:
        """Each piece's file size less its bytes: the largest offset at which the piece still fits its file."""
        key = (id(file), id(geometry), size)
        found = self._limits.get(key)
        if found is None:
            found = (_frozen(self.sizes[file] - geometry.nbytes(size)), geometry)
            self._limits[key] = found
        return found[0]


class PieceCheck:
    """Range checks of one tensor's decoded piece columns against its shape and the file table."""

    def __init__(
        self,
        where: str | tuple[str, str],
        entry_shape: tuple[int, ...],
        layout: str,
        size: int,
        file_sizes: list[int] | SharedColumns,
    ):
        """where: the text errors start with, or (manifest, tensor name) to make it from when an error needs it.
        file_sizes: the manifest's file sizes, or what its tables share (their sizes and decoded columns)."""
        self._where, self.shape, self.layout, self.size = where, entry_shape, layout, size
        self.shared = file_sizes if isinstance(file_sizes, SharedColumns) else SharedColumns(file_sizes)
        self.file_sizes = self.shared.file_sizes

    @property
    def where(self) -> str:
        where = self._where
        if isinstance(where, tuple):
            where = self._where = f"{where[0]} tensor {where[1]!r}"
        return where

    def before_decoding(self, count: int) -> None:
        """Pieces hold at least one element each and must not overlap: refuse more pieces than elements at once."""
        numel = math.prod(self.shape)
        if count > numel:
            raise CoverageError(f"{self.where}: {count} pieces for {numel} element(s): pieces overlap")

    def decode(self, raw: dict[str, Any], count: int, k: int) -> tuple[Int64Array, Int64Array, Geometry]:
        """(file, offset, boxes) of an encoded table of many pieces, decoded and checked; long columns shared with
        the manifest's other tables (read-only). The same checks, order and messages as __call__."""
        where, shared = self.where, self.shared
        file = shared.column(raw.get("file"), f"{where} pieces.file", count)
        offset = decode_int_column(raw.get("offset"), f"{where} pieces.offset", count)
        geometry = shared.geometry(raw.get("start"), raw.get("length"), count, k, where)
        if not shared.file_checked(file):
            self._check_files(file)
            shared.mark_file_checked(file)
        if (self.shape, self.layout) not in geometry.checked:
            self._check_boxes(geometry.start, geometry.length)
            geometry.checked.add((self.shape, self.layout))
        # sizes[file] - nbytes rather than offset + nbytes: a hostile offset near 2^63 would overflow the sum.
        if offset.size and (offset.min() < 0 or (offset > shared.room(file, geometry, self.size)).any()):
            raise FormatError(f"{where}: a piece's bytes lie outside its data file")
        return file, offset, geometry

    def __call__(self, file: Int64Array, offset: Int64Array, start: Int64Array, length: Int64Array) -> None:
        if file.size <= SCAN_PIECES:  # most tensors: numpy's per-call cost would dominate; same checks, same order
            self.check_lists(file.tolist(), offset.tolist(), start.tolist(), length.tolist())
            return
        self._check_files(file)
        self._check_boxes(start, length)
        # Lengths are bounded by the shape (numel < 2^62), so the products below cannot overflow int64.
        nbytes = np.prod(length, axis=1, dtype=np.int64) * self.size
        sizes = self.shared.sizes[file] if file.size else np.zeros(0, np.int64)
        if offset.size and (offset.min() < 0 or (offset > sizes).any() or (offset + nbytes > sizes).any()):
            raise FormatError(f"{self.where}: a piece's bytes lie outside its data file")

    def _check_files(self, file: Int64Array) -> None:
        if file.size and (file.min() < 0 or file.max() >= len(self.file_sizes)):
            raise FormatError(f"{self.where}: a piece names a file index outside 0..{len(self.file_sizes) - 1}")

    def _check_boxes(self, start: Int64Array, length: Int64Array) -> None:
        extents = [math.prod(self.shape)] if self.layout == "flat" else list(self.shape)
        bound = np.array(extents, dtype=np.int64).reshape(1, -1) if extents else np.zeros((1, 0), np.int64)
        if start.size and (start.min() < 0 or length.min() < 1 or (length > bound).any() or (start > bound).any()):
            raise FormatError(f"{self.where}: a piece has a negative start, an empty length or lies outside the shape")
        if start.size and (start + length > bound).any():
            bad = int(np.nonzero((start + length > bound).any(axis=1))[0][0])
            raise FormatError(
                f"{self.where}: piece {bad} (start {start[bad].tolist()}, length {length[bad].tolist()}) "
                f"extends past shape {list(self.shape)}"
            )

    def check_lists(
        self,
        file: Sequence[int],
        offset: Sequence[int],
        start: Sequence[Sequence[int]],
        length: Sequence[Sequence[int]],
    ) -> None:
        """__call__ for a handful of pieces, in plain integers (no overflow to reason about)."""
        where = self.where
        if len(file) == 1 and len(start) == 1 and len(length) == 1:  # one piece (most tensors): no generators
            self._check_one(file[0], offset[0], start[0], length[0])
            return
        if any(f < 0 or f >= len(self.file_sizes) for f in file):
            raise FormatError(f"{where}: a piece names a file index outside 0..{len(self.file_sizes) - 1}")
        extents = [math.prod(self.shape)] if self.layout == "flat" else list(self.shape)
        for starts, lengths in zip(start, length):
            if any(a < 0 or n < 1 or n > b or a > b for a, n, b in zip(starts, lengths, extents)):
                raise FormatError(f"{where}: a piece has a negative start, an empty length or lies outside the shape")
        for bad, (starts, lengths) in enumerate(zip(start, length)):
            if any(a + n > b for a, n, b in zip(starts, lengths, extents)):
                raise FormatError(
                    f"{where}: piece {bad} (start {starts}, length {lengths}) extends past shape {list(self.shape)}"
                )
        for f, at, lengths in zip(file, offset, length):
            size = self.file_sizes[f]
            if at < 0 or at > size or at + math.prod(lengths) * self.size > size:
                raise FormatError(f"{where}: a piece's bytes lie outside its data file")

    def _check_one(self, file: int, at: int, starts: Sequence[int], lengths: Sequence[int]) -> None:
        """check_lists of one piece: the same checks, in the same order, with the same messages."""
        where = self.where
        if file < 0 or file >= len(self.file_sizes):
            raise FormatError(f"{where}: a piece names a file index outside 0..{len(self.file_sizes) - 1}")
        extents = (math.prod(self.shape),) if self.layout == "flat" else self.shape
        for a, n, b in zip(starts, lengths, extents):
            if a < 0 or n < 1 or n > b or a > b:
                raise FormatError(f"{where}: a piece has a negative start, an empty length or lies outside the shape")
        for a, n, b in zip(starts, lengths, extents):
            if a + n > b:
                raise FormatError(
                    f"{where}: piece 0 (start {starts}, length {lengths}) extends past shape {list(self.shape)}"
                )
        size = self.file_sizes[file]
        if at < 0 or at > size or at + math.prod(lengths) * self.size > size:
            raise FormatError(f"{where}: a piece's bytes lie outside its data file")

    _check_few = check_lists
