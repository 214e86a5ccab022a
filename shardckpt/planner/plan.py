"""Read planning: from wanted boxes of tensors to coalesced byte-range requests and strided copies.

Each wanted box is intersected with the stored pieces it overlaps; each overlap becomes a strided copy whose
source byte runs are exactly the bytes needed. Copies are grouped into units whose runs are dense, units are
rounded to checksum blocks (piece-relative) and merged into requests bounded by a gap and a size limit.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from shardckpt.errors import ShardckptUsageError
from shardckpt.format.bulk import gc_paused
from shardckpt.format.dtypes import itemsize
from shardckpt.format.manifest import TensorEntry
from shardckpt.planner.box import Box, intersect, linear_index, linear_range_boxes, row_major_strides


@dataclass(frozen=True)
class Target:
    """A wanted region: box `box` of tensor `name`, written row-major into a buffer of the box's shape."""

    name: str
    box: Box


@dataclass(frozen=True)
class Copy:
    """Copy a strided block: shape = (outer counts..., run bytes); strides in bytes for the outer dims.

    `src` is an absolute byte offset in the request's file, `dst` a byte offset in target `target`'s buffer.
    """

    target: int
    src: int
    dst: int
    shape: tuple[int, ...]
    src_strides: tuple[int, ...]
    dst_strides: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape)

    @property
    def src_end(self) -> int:
        return self.src + sum((n - 1) * s for n, s in zip(self.shape[:-1], self.src_strides)) + self.shape[-1]


@dataclass(frozen=True)
class VerifySpan:
    """Bytes [start, end) of the piece stored at `piece_offset` (of `piece_size` bytes), block-aligned."""

    tensor: str
    piece: int  # index of the piece in the tensor's piece table, to check its identity against the file's index
    piece_offset: int
    piece_size: int
    start: int
    end: int


@dataclass(frozen=True)
class ReadRequest:
    """One range read [start, end) of file `file`, the checksum spans it covers and the copies it feeds."""

    file: int
    start: int
    end: int
    verify: tuple[VerifySpan, ...]
    copies: tuple[Copy, ...]

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ReadPlan:
    targets: tuple[Target, ...]
    requests: tuple[ReadRequest, ...]
    needed_bytes: int  # bytes the targets hold: what an ideal reader fetches
    exact_bytes: int  # bytes of the planned runs before coalescing and block rounding (== needed_bytes)
    block_size: int
    max_gap: int
    max_request: int

    @property
    def fetch_bytes(self) -> int:
        """Bytes the requests read, including coalescing gaps and checksum-block rounding."""
        return sum(request.size for request in self.requests)


@dataclass(frozen=True)
class _Unit:
    file: int
    tensor: str
    piece: int
    piece_offset: int
    piece_size: int
    copy: Copy


@gc_paused()
def plan_reads(
    tensors: Mapping[str, TensorEntry],
    targets: Sequence[Target],
    *,
    block_size: int,
    max_gap: int,
    max_request: int,
) -> ReadPlan:
    """Plan the reads that fill every target box from the stored pieces, reading only overlapping bytes.

    max_gap: bytes between two needed ranges of a file read through rather than split; max_request: the largest
    range read (the reader's defaults are knobs.MAX_GAP and knobs.MAX_REQUEST). Coalescing never splits a
    checksum block, so at most one block per cut is read twice."""
    if max_gap < 0 or max_request < 1:
        raise ShardckptUsageError(f"max_gap must be >= 0 and max_request >= 1, got {max_gap}, {max_request}")
    units: dict[int, list[_Unit]] = defaultdict(list)
    needed = exact = 0
    for index, target in enumerate(targets):
        entry = tensors.get(target.name)
        if entry is None:
            raise ShardckptUsageError(f"tensor {target.name!r} is not in the checkpoint")
        if not target.box.within(entry.shape):
            raise ShardckptUsageError(f"box {target.box} lies outside tensor {target.name!r} of shape {entry.shape}")
        size = itemsize(entry.dtype)
        needed += target.box.volume * size
        whole = _whole_piece_unit(entry, index, target.box, size, max_request)
        for unit in (
            (whole,) if whole is not None else _units_for_target(entry, index, target.box, max_gap, max_request)
        ):
            units[unit.file].append(unit)
            exact += unit.copy.nbytes
    requests: list[ReadRequest] = []
    for file in sorted(units):
        requests.extend(_coalesce(file, units[file], block_size, max_gap, max_request))
    return ReadPlan(tuple(targets), tuple(requests), needed, exact, block_size, max_gap, max_request)


def _stored_boxes(entry: TensorEntry, want: Box) -> Iterator[tuple[Box, int, tuple[int, ...], int, int, int, int]]:
    """(box, byte offset of its first element, element strides, piece, file, piece offset, piece bytes)."""
    file, offset, start, length = entry.pieces.arrays()
    size = itemsize(entry.dtype)
    if entry.layout == "box":
        if want.ndim:
            # Dimension 0 first (it rules out almost every piece of a row-sharded tensor), the rest on survivors.
            end0 = start[:, 0] + length[:, 0]
            hit = np.nonzero((start[:, 0] < want.end[0]) & (end0 > want.offsets[0]))[0]
            if want.ndim > 1 and hit.size:
                lo = np.array(want.offsets[1:], dtype=np.int64)
                hi = np.array(want.end[1:], dtype=np.int64)
                rest_start, rest_length = start[hit, 1:], length[hit, 1:]
                hit = hit[((rest_start < hi) & (rest_start + rest_length > lo)).all(axis=1)]
        else:
            hit = np.arange(entry.pieces.count)
        for i in hit.tolist():
            box = Box(tuple(start[i].tolist()), tuple(length[i].tolist()))
            piece_bytes = box.volume * size
            yield box, int(offset[i]), row_major_strides(box.shape), i, int(file[i]), int(offset[i]), piece_bytes
        return
    # Flat pieces: element ranges of the row-major tensor, cut into boxes only where the wanted box lies.
    lo_lin = linear_index(entry.shape, want.offsets)
    hi_lin = linear_index(entry.shape, tuple(e - 1 for e in want.end)) + 1
    flat_start, flat_len = start[:, 0], length[:, 0]
    hit = np.nonzero((flat_start < hi_lin) & (flat_start + flat_len > lo_lin))[0]
    strides = row_major_strides(entry.shape)
    for i in hit.tolist():
        first, count = int(flat_start[i]), int(flat_len[i])
        for box in linear_range_boxes(entry.shape, max(first, lo_lin), min(first + count, hi_lin)):
            base = int(offset[i]) + (linear_index(entry.shape, box.offsets) - first) * size
            yield box, base, strides, i, int(file[i]), int(offset[i]), count * size


def _whole_piece_unit(entry: TensorEntry, index: int, want: Box, size: int, max_request: int) -> _Unit | None:
    """The one unit of a target that is a whole tensor stored as one piece (most tensors of a one-process or
    replicated save), in constant time; None for any other target. Equal to what _units_for_target yields."""
    pieces = entry.pieces
    if pieces.count != 1 or entry.layout != "box" or any(want.offsets) or want.shape != entry.shape:
        return None
    file, offset, start, length = pieces.small_arrays()
    nbytes = want.volume * size
    if any(start[0]) or tuple(length[0]) != entry.shape or not 0 < nbytes <= max_request:
        return None
    return _Unit(file[0], entry.name, 0, offset[0], nbytes, Copy(index, offset[0], 0, (nbytes,), (), ()))


def _units_for_target(entry: TensorEntry, index: int, want: Box, max_gap: int, max_request: int) -> Iterator[_Unit]:
    if want.volume == 0:
        return
    size = itemsize(entry.dtype)
    want_strides = row_major_strides(want.shape)
    for box, base, strides, piece, file, piece_offset, piece_size in _stored_boxes(entry, want):
        overlap = intersect(want, box)
        if overlap is None:
            continue
        src = base + sum((o - b) * s for o, b, s in zip(overlap.offsets, box.offsets, strides)) * size
        dst = sum((o - w) * s for o, w, s in zip(overlap.offsets, want.offsets, want_strides)) * size
        dims = [(n, s * size, d * size) for n, s, d in zip(overlap.shape, strides, want_strides) if n > 1]
        run = size
        # Fold inner dimensions into one byte run while they are contiguous in both source and destination.
        while dims and dims[-1][1] == run and dims[-1][2] == run:
            run *= dims.pop()[0]
        for copy in _split(index, src, dst, dims, run, max_gap, max_request):
            yield _Unit(file, entry.name, piece, piece_offset, piece_size, copy)


def _split(
    target: int, src: int, dst: int, dims: list[tuple[int, int, int]], run: int, max_gap: int, max_request: int
) -> Iterator[Copy]:
    """Cut one strided copy into units whose source span is dense (gaps <= max_gap) and <= max_request."""
    if run > max_request:
        # One run bigger than a request: every run goes as byte chunks.
        for index in itertools.product(*(range(n) for n, _, _ in dims)):
            s0 = src + sum(i * s for i, (_, s, _) in zip(index, dims))
            d0 = dst + sum(i * d for i, (_, _, d) in zip(index, dims))
            for pos in range(0, run, max_request):
                yield Copy(target, s0 + pos, d0 + pos, (min(max_request, run - pos),), (), ())
        return
    inner: list[tuple[int, int, int]] = []  # dims (innermost last) that one unit spans whole
    span, chunk, keep = run, 0, len(dims)
    while keep:
        n, s, d = dims[keep - 1]
        if s - span > max_gap:
            break
        full = (n - 1) * s + span
        if full <= max_request:
            inner.insert(0, (n, s, d))
            span, keep = full, keep - 1
            continue
        chunk = max(1, (max_request - span) // s + 1)
        break
    outer = dims[:keep]
    n = s = d = 0
    if chunk:
        n, s, d = outer.pop()
    for position in itertools.product(*(range(n) for n, _, _ in outer)):
        s0 = src + sum(i * s for i, (_, s, _) in zip(position, outer))
        d0 = dst + sum(i * d for i, (_, _, d) in zip(position, outer))
        shape = tuple(n for n, _, _ in inner) + (run,)
        src_strides = tuple(s for _, s, _ in inner)
        dst_strides = tuple(d for _, _, d in inner)
        if not chunk:
            yield Copy(target, s0, d0, shape, src_strides, dst_strides)
            continue
        for first in range(0, n, chunk):
            count = min(chunk, n - first)
            yield Copy(target, s0 + first * s, d0 + first * d, (count, *shape), (s, *src_strides), (d, *dst_strides))


def _coalesce(file: int, units: list[_Unit], block: int, max_gap: int, max_request: int) -> Iterator[ReadRequest]:
    rounded = []
    for unit in units:
        rel_lo = unit.copy.src - unit.piece_offset
        rel_hi = unit.copy.src_end - unit.piece_offset
        lo = unit.piece_offset + (rel_lo // block) * block
        hi = unit.piece_offset + min(-(-rel_hi // block) * block, unit.piece_size)
        rounded.append((lo, hi, unit))
    rounded.sort(key=lambda item: (item[0], item[1]))
    group: list[tuple[int, int, _Unit]] = []
    start = end = 0
    for lo, hi, unit in rounded:
        if group and lo - end <= max_gap and max(end, hi) - start <= max_request:
            group.append((lo, hi, unit))
            end = max(end, hi)
            continue
        if group:
            yield _request(file, start, end, group)
        group, start, end = [(lo, hi, unit)], lo, hi
    if group:
        yield _request(file, start, end, group)


def _request(file: int, start: int, end: int, group: list[tuple[int, int, _Unit]]) -> ReadRequest:
    # One span per piece, not per offset: a hostile manifest may point two pieces at one offset, and each piece's
    # identity must be checked against the file's local manifest (SPEC 8 step 4).
    spans: dict[tuple[str, int], tuple[int, int, _Unit]] = {}
    for lo, hi, unit in group:
        key = (unit.tensor, unit.piece)
        seen = spans.get(key)
        spans[key] = (lo, hi, unit) if seen is None else (min(seen[0], lo), max(seen[1], hi), unit)
    verify = tuple(
        VerifySpan(unit.tensor, unit.piece, unit.piece_offset, unit.piece_size, lo, hi)
        for lo, hi, unit in spans.values()
    )
    return ReadRequest(file, start, end, verify, tuple(unit.copy for _, _, unit in group))
