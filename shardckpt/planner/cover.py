"""Exact-cover validation: the stored pieces of a tensor hold every element exactly once.

Fast paths: row slabs and the cells of one grid (every FSDP/TP tiling) in O(n log n); any other box set by
cancelling signed corners (_check_corners), O(2^c n log n) with c the dimensions a piece is cut in.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from shardckpt.errors import CoverageError, FormatError
from shardckpt.format import limits
from shardckpt.planner.box import Box, intersect

Int64Array = npt.NDArray[np.int64]
_MAX_COUNTED_CELLS = 1 << 24
# Up to this many pieces, row slabs are checked in plain Python: a tensor of an MoE state has a handful of pieces,
# and the fixed cost of a dozen numpy calls (~30 us) would dominate a commit of 100,000+ such tensors.
_SMALL = 16


def check_cover(name: str, shape: tuple[int, ...], layout: str, start: Int64Array, length: Int64Array) -> None:
    """Raise CoverageError naming the tensor and the boxes unless the pieces cover `shape` exactly once.

    start/length: (n, k) integer arrays, k = len(shape) for layout "box", 1 for "flat" (element ranges).
    Callers have already checked that every piece lies inside the tensor and holds >= 1 element.
    """
    numel = math.prod(shape)
    count = int(start.shape[0])
    if layout == "flat":
        _check_intervals(name, numel, start.reshape(-1), length.reshape(-1), "elements")
        return
    if numel == 0 or not shape:
        if count != (0 if numel == 0 else 1):
            kind = "no elements" if numel == 0 else "one element (a scalar)"
            raise CoverageError(f"tensor {name!r}: has {kind} but {count} stored pieces")
        return
    if count == 0:
        raise CoverageError(f"tensor {name!r}: no stored piece covers {Box.full(shape)} (gap)")
    if count <= _SMALL and _few_row_slabs_cover(shape, start, length):
        return
    # Fast paths for the layouts nearly every tensor has (callers checked that pieces lie inside the tensor):
    # one whole piece, or row slabs that each span every other dimension (FSDP's Shard(0)), which cover the
    # tensor exactly when their rows cover dimension 0 exactly.
    if count == 1 and not start.any() and length[0].tolist() == list(shape):
        return
    if len(shape) > 1 and not start[:, 1:].any() and bool((length[:, 1:] == shape[1:]).all()):
        if not _row_slabs_tile(shape[0], start[:, 0], length[:, 0]):
            _check_intervals(name, shape[0], start[:, 0], length[:, 0], "rows")
        return
    # A float total guards the exact int64 sum below against overflow on hostile input.
    volumes = np.prod(length, axis=1, dtype=np.int64)
    if float(np.prod(length.astype(np.float64), axis=1).sum()) > numel * 1.001 + 1:
        _report_overlap(name, start, length, shape)
    total = int(volumes.sum())
    if len(shape) == 1:
        _check_intervals(name, numel, start[:, 0], length[:, 0], "rows")
        return
    if _check_grid(name, shape, start, length, total, numel):
        return
    _check_corners(name, shape, start, length)


def _few_row_slabs_cover(shape: tuple[int, ...], start: Int64Array, length: Int64Array) -> bool:
    """True when the pieces are row slabs (each spans every dimension but the first) covering the rows exactly
    once. False says nothing: the general checks below give the verdict and name the defect."""
    rest = list(shape[1:])
    rows = []
    for first, extent in zip(start.tolist(), length.tolist()):
        if extent[1:] != rest or any(first[1:]):
            return False
        rows.append((first[0], extent[0]))
    rows.sort()
    reach = 0
    for lo, n in rows:
        if lo != reach:
            return False
        reach = lo + n
    return reach == shape[0]


def _row_slabs_tile(rows: int, start: Int64Array, length: Int64Array) -> bool:
    """True when the intervals [start, start + length) tile 0:rows back to back (the common verdict, in few numpy
    calls); False leaves the verdict and the message to _check_intervals."""
    order = np.argsort(start)
    lo = start[order]
    hi = lo + length[order]
    return bool(lo[0] == 0 and hi[-1] == rows and (lo[1:] == hi[:-1]).all())


def _box(start: Int64Array, length: Int64Array, index: int) -> Box:
    return Box(tuple(int(x) for x in start[index]), tuple(int(x) for x in length[index]))


def _check_intervals(name: str, extent: int, start: Int64Array, length: Int64Array, unit: str) -> None:
    if extent == 0:
        if start.size:
            raise CoverageError(f"tensor {name!r}: has no elements but {start.size} stored pieces")
        return
    order = np.argsort(start, kind="stable")
    lo, hi = start[order], start[order] + length[order]
    if lo.size == 0 or lo[0] > 0:
        end = int(lo[0]) if lo.size else extent
        raise CoverageError(f"tensor {name!r}: {unit} 0:{end} are covered by no piece (gap)")
    if hi[-1] < extent and (np.maximum.accumulate(hi)[-1] < extent):
        raise CoverageError(f"tensor {name!r}: {unit} {int(np.max(hi))}:{extent} are covered by no piece (gap)")
    if lo.size > 1:
        reach = np.maximum.accumulate(hi)[:-1]
        overlap = np.nonzero(lo[1:] < reach)[0]
        if overlap.size:
            i = int(overlap[0]) + 1
            prev = int(np.nonzero(hi[:i] > lo[i])[0][0])
            a, b = int(order[prev]), int(order[i])
            end = min(int(hi[prev]), int(hi[i]))
            raise CoverageError(f"tensor {name!r}: pieces {a} and {b} both cover {unit} {int(lo[i])}:{end} (overlap)")
        gap = np.nonzero(lo[1:] > reach)[0]
        if gap.size:
            i = int(gap[0]) + 1
            raise CoverageError(
                f"tensor {name!r}: {unit} {int(reach[i - 1])}:{int(lo[i])} are covered by no piece (gap)"
            )
    if int(hi.max()) != extent:
        raise CoverageError(f"tensor {name!r}: {unit} {int(hi.max())}:{extent} are covered by no piece (gap)")


def _check_grid(
    name: str, shape: tuple[int, ...], start: Int64Array, length: Int64Array, total: int, numel: int
) -> bool:
    """True when the pieces are exactly the cells of the grid of all their boundaries (then checked)."""
    end = start + length
    cell_index = []
    grid: list[int] = []
    for dim in range(len(shape)):
        bounds = _distinct(np.concatenate([start[:, dim], end[:, dim]]))
        lo = np.searchsorted(bounds, start[:, dim])
        hi = np.searchsorted(bounds, end[:, dim])
        if (hi - lo != 1).any():
            return False
        if bounds[0] != 0 or bounds[-1] != shape[dim]:
            edge = 0 if bounds[0] != 0 else int(bounds[-1])
            stop = int(bounds[0]) if bounds[0] != 0 else shape[dim]
            raise CoverageError(f"tensor {name!r}: dimension {dim} indices {edge}:{stop} are covered by no piece (gap)")
        cell_index.append(lo)
        grid.append(int(bounds.size - 1))
    cells = np.ravel_multi_index(tuple(cell_index), tuple(grid))
    order = np.argsort(cells, kind="stable")
    sorted_cells = cells[order]
    duplicate = np.nonzero(sorted_cells[1:] == sorted_cells[:-1])[0]
    if duplicate.size:
        a, b = int(order[duplicate[0]]), int(order[duplicate[0] + 1])
        raise CoverageError(f"tensor {name!r}: pieces {a} and {b} both cover {_box(start, length, a)} (overlap)")
    if total != numel:
        present = np.zeros(math.prod(grid), dtype=bool) if math.prod(grid) <= _MAX_COUNTED_CELLS else None
        if present is not None:
            present[cells] = True
            missing = np.unravel_index(int(np.argmin(present)), tuple(grid))
            raise CoverageError(f"tensor {name!r}: grid cell {tuple(int(i) for i in missing)} is covered by no piece")
        raise CoverageError(f"tensor {name!r}: pieces hold {total} of {numel} elements (gap)")
    return True


def _check_corners(name: str, shape: tuple[int, ...], start: Int64Array, length: Int64Array) -> None:
    """Exact cover of any box set in O(2^c n log n), c the dimensions a piece ends before the tensor's end.

    The indicator of a box [a, b) is a signed sum of orthant indicators [x >= corner] over its corners (sign
    (-1)^(upper coordinates taken)); inside the tensor an orthant at a corner with a coordinate at the shape is
    empty, so those corners are dropped. The representation is unique, so the pieces cover the tensor exactly once
    iff their signed corners, plus the tensor's own corner 0 with sign -1, cancel at every point. If not, the
    lexicographically first point p that is left holds 1 + (what is left there) pieces: 0 is a gap, 2+ an overlap.
    """
    end = start + length
    extent = np.asarray(shape, dtype=np.int64)
    # Dimensions every piece spans whole add nothing to the count function: leave them out.
    dims = np.nonzero(~((start == 0).all(axis=0) & (end == extent).all(axis=0)))[0]
    low, high, extent = start[:, dims], end[:, dims], extent[dims]
    cut = high < extent  # (n, d): the piece's upper corner in that dimension lies inside the tensor
    cuts = cut.sum(axis=1)
    points = float(np.ldexp(1.0, cuts).sum())
    if points > limits.MAX_COVER_CORNERS:
        raise FormatError(
            f"tensor {name!r}: {start.shape[0]} irregular pieces need {points:.0f} corner points to check their cover, "
            f"over the limit of {limits.MAX_COVER_CORNERS}"
        )
    groups = [(int(c), np.nonzero(cuts == c)[0]) for c in np.unique(cuts).tolist()]
    # Per piece, which bit of the corner number picks the upper coordinate in each dimension (-1: never).
    bit = np.where(cut, np.cumsum(cut, axis=1) - 1, -1)
    signs = np.concatenate([_corner_signs(c, ids.size) for c, ids in groups] + [np.array([-1], np.int64)])
    key = np.zeros(signs.size, dtype=np.int64)
    for d in range(len(dims)):
        bounds = _distinct(np.concatenate([[0], low[:, d], high[cut[:, d], d]]))
        corners = [_corner_coordinates(c, ids, low[:, d], high[:, d], bit[:, d]) for c, ids in groups]
        column = np.concatenate([*corners, np.zeros(1, np.int64)])  # the last: the tensor's own corner 0
        rank = np.searchsorted(bounds, column)
        if int(key.max(initial=0)) >= (1 << 62) // bounds.size:  # keep the key exact: renumber it densely first
            key = np.unique(key, return_inverse=True)[1].reshape(-1).astype(np.int64)
        key = key * bounds.size + rank
    if int(key.max(initial=0)) >= 1 << 61:
        key = np.unique(key, return_inverse=True)[1].reshape(-1).astype(np.int64)
    # One sort of key * 2 + (sign > 0) groups equal points; each point's total is (#positive - #negative).
    ordered = np.sort(key * 2 + (signs > 0))
    point = ordered >> 1
    first = np.concatenate([[0], np.nonzero(point[1:] != point[:-1])[0] + 1])
    total = np.add.reduceat(2 * (ordered & 1) - 1, first)
    left = np.nonzero(total)[0]
    if not left.size:
        return
    where = int(np.nonzero(key == point[first[left[0]]])[0][0])
    found = np.zeros(len(shape), dtype=np.int64)
    found[dims] = _corner_at(where, groups, low, high, bit)
    element = Box(tuple(int(x) for x in found), (1,) * len(shape))
    if 1 + int(total[left[0]]) <= 0:
        raise CoverageError(f"tensor {name!r}: elements {element} are covered by no piece (gap)")
    hit = np.nonzero(((start <= found) & (end > found)).all(axis=1))[0]
    if hit.size < 2:  # cannot happen for a consistent count; still an error, never a silent pass
        raise CoverageError(f"tensor {name!r}: element {element} is covered inconsistently (overlap)")
    a, b = int(hit[0]), int(hit[1])
    region = intersect(_box(start, length, a), _box(start, length, b))
    raise CoverageError(f"tensor {name!r}: pieces {a} and {b} both cover {region or element} (overlap)")


def _distinct(values: Int64Array) -> Int64Array:
    """Sorted distinct values (np.unique, without its hashing pass, which is slower on these arrays)."""
    ordered = np.sort(values)
    return ordered[np.concatenate([[True], ordered[1:] != ordered[:-1]])] if ordered.size else ordered


def _corner_signs(cuts: int, pieces: int) -> Int64Array:
    """Signs of the 2^cuts corners (corner-major) of `pieces` pieces: -1 per upper coordinate taken."""
    numbers = np.arange(1 << cuts, dtype=np.int64)
    parity = np.zeros(numbers.size, dtype=np.int64)
    for b in range(cuts):
        parity ^= (numbers >> b) & 1
    return np.repeat(1 - 2 * parity, pieces)


def _corner_coordinates(cuts: int, ids: Int64Array, low: Int64Array, high: Int64Array, bit: Int64Array) -> Int64Array:
    """One dimension's coordinate of every corner of the pieces `ids` (corner-major, as _corner_signs)."""
    numbers = np.arange(1 << cuts, dtype=np.int64)[:, None]
    own = bit[ids][None, :]
    upper = (own >= 0) & (((numbers >> np.maximum(own, 0)) & 1) == 1)
    return np.where(upper, high[ids][None, :], low[ids][None, :]).reshape(-1)


def _corner_at(
    where: int, groups: list[tuple[int, Int64Array]], low: Int64Array, high: Int64Array, bit: Int64Array
) -> Int64Array:
    """The coordinates of corner number `where` in the order the corners were generated (the last: origin)."""
    for cuts, ids in groups:
        size = ids.size << cuts
        if where < size:
            number, piece = divmod(where, ids.size)
            own = bit[ids[piece]]
            upper = (own >= 0) & (((number >> np.maximum(own, 0)) & 1) == 1)
            corner: Int64Array = np.where(upper, high[ids[piece]], low[ids[piece]])
            return corner
        where -= size
    return np.zeros(low.shape[1], dtype=np.int64)


def _report_overlap(
    name: str, start: Int64Array, length: Int64Array, shape: tuple[int, ...], region: Box | None = None
) -> None:
    end = start + length
    if region is not None:
        hit = np.nonzero(((start < np.array(region.end)) & (end > np.array(region.offsets))).all(axis=1))[0]
        if hit.size >= 2:
            a, b = int(hit[0]), int(hit[1])
            raise CoverageError(f"tensor {name!r}: pieces {a} and {b} both cover {region} (overlap)")
    raise CoverageError(f"tensor {name!r}: stored pieces hold more elements than shape {list(shape)} has (overlap)")
