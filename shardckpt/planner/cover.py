"""Exact-cover validation: the stored pieces of a tensor hold every element exactly once.

Fast path: pieces that are the cells of one grid (every FSDP/TP tiling) are checked in O(n log n) with
numpy; other box sets fall back to counting over the grid of all piece boundaries, then to slab sweeps.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from shardckpt.errors import CoverageError
from shardckpt.planner.box import Box

Int64Array = npt.NDArray[np.int64]
_MAX_COUNTED_CELLS = 1 << 24


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
    # Fast paths for the layouts nearly every tensor has (callers checked that pieces lie inside the tensor):
    # one whole piece, or row slabs that each span every other dimension (FSDP's Shard(0)), which cover the
    # tensor exactly when their rows cover dimension 0 exactly.
    if count == 1 and not start.any() and length[0].tolist() == list(shape):
        return
    if len(shape) > 1 and not start[:, 1:].any() and bool((length[:, 1:] == np.asarray(shape[1:])).all()):
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
    _check_general(name, shape, start, length)


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
        bounds = np.unique(np.concatenate([start[:, dim], end[:, dim]]))
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


def _check_general(name: str, shape: tuple[int, ...], start: Int64Array, length: Int64Array) -> None:
    """Count coverage per cell of the boundary grid; beyond a size bound, sweep slabs along dimension 0."""
    end = start + length
    bounds = [np.unique(np.concatenate([[0, shape[d]], start[:, d], end[:, d]])) for d in range(len(shape))]
    grid = tuple(int(b.size - 1) for b in bounds)
    if math.prod(grid) <= _MAX_COUNTED_CELLS:
        covered = np.zeros(grid, dtype=bool)
        lo = [np.searchsorted(bounds[d], start[:, d]) for d in range(len(shape))]
        hi = [np.searchsorted(bounds[d], end[:, d]) for d in range(len(shape))]
        for i in range(start.shape[0]):
            cells = covered[tuple(slice(int(lo[d][i]), int(hi[d][i])) for d in range(len(shape)))]
            # Stop at the first piece that covers a covered cell: every cell is marked at most once before that,
            # so the loop costs O(pieces + cells), not O(pieces * cells) for many pieces over one big region.
            if cells.any():
                first = np.argwhere(cells)[0]
                cell = tuple(int(lo[d][i] + first[d]) for d in range(len(shape)))
                _report_overlap(name, start, length, shape, _cell_box(bounds, cell))
            cells[...] = True
        if not covered.all():
            cell = tuple(int(x) for x in np.argwhere(~covered)[0])
            raise CoverageError(f"tensor {name!r}: elements {_cell_box(bounds, cell)} are covered by no piece (gap)")
        return
    _sweep(name, shape, start, length, np.arange(start.shape[0]), 0)


def _cell_box(bounds: list[Int64Array], cell: tuple[int, ...]) -> Box:
    return Box(
        tuple(int(bounds[d][c]) for d, c in enumerate(cell)),
        tuple(int(bounds[d][c + 1] - bounds[d][c]) for d, c in enumerate(cell)),
    )


def _sweep(name: str, shape: tuple[int, ...], start: Int64Array, length: Int64Array, ids: Int64Array, dim: int) -> None:
    # Slabs between consecutive dim-`dim` boundaries must each be covered exactly by the pieces crossing them.
    sub_start, sub_end = start[ids, dim], start[ids, dim] + length[ids, dim]
    if dim == len(shape) - 1:
        # The pieces crossing this slab must tile the last dimension: sorted, each starts where the last one ended.
        order = np.argsort(sub_start, kind="stable")
        lo, hi = sub_start[order], sub_end[order]
        expected = np.concatenate([[0], hi[:-1]]).astype(np.int64)
        wrong = np.nonzero(lo != expected)[0]
        if not wrong.size and lo.size and hi[-1] == shape[dim]:
            return
        if not wrong.size:
            gap = (int(hi[-1]) if lo.size else 0, shape[dim])
        elif lo[wrong[0]] > expected[wrong[0]]:
            gap = (int(expected[wrong[0]]), int(lo[wrong[0]]))
        else:
            i = int(wrong[0])
            a, b = int(ids[order[i - 1]]), int(ids[order[i]])
            region = f"{int(lo[i])}:{int(min(expected[i], hi[i]))}"
            raise CoverageError(
                f"tensor {name!r}: pieces {a} and {b} both cover dimension {dim} indices {region} (overlap)"
            )
        raise CoverageError(f"tensor {name!r}: dimension {dim} indices {gap[0]}:{gap[1]} are covered by no piece (gap)")
        return
    bounds = np.unique(np.concatenate([[0, shape[dim]], sub_start, sub_end]))
    for lo_bound, hi_bound in zip(bounds[:-1], bounds[1:]):
        active = ids[(sub_start <= lo_bound) & (sub_end >= hi_bound)]
        _sweep(name, shape, start, length, active, dim + 1)


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
