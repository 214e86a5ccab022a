"""Boxes: an n-dimensional region of a tensor given by offsets and lengths, and the arithmetic on them.

A flat element range of a row-major tensor decomposes into at most 2*ndim-1 boxes (linear_range_boxes).
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from shardckpt.errors import ShardckptUsageError


def indices(values: Iterable[object], what: str) -> tuple[int, ...]:
    """`values` (offsets or a shape a caller gave) as ints: Python, numpy or torch integers, taken through
    operator.index. A float is refused, not truncated (n / 2 for n // 2 would be a silently wrong box), and so is a
    bool; `what` names them in the ShardckptUsageError ("tensor 'w': offsets")."""
    try:
        if isinstance(values, (str, bytes)):
            raise TypeError
        items = tuple(values)
        if any(isinstance(v, bool) for v in items):
            raise TypeError
        return tuple(operator.index(v) for v in items)  # type: ignore[arg-type]
    except TypeError:
        raise ShardckptUsageError(f"{what} must be integers, got {values!r}") from None


@dataclass(frozen=True)
class Box:
    """offsets[i] .. offsets[i] + shape[i] in every dimension i."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.shape):
            raise ShardckptUsageError(f"box offsets {self.offsets} and shape {self.shape} differ in rank")
        if min(self.offsets, default=0) < 0 or min(self.shape, default=0) < 0:  # one C call each: a Box per tensor
            raise ShardckptUsageError(f"box offsets {self.offsets} and shape {self.shape} must be non-negative")

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def volume(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.shape))

    def within(self, shape: tuple[int, ...]) -> bool:
        if self.shape == shape and not any(self.offsets):  # the whole tensor (most loads): no tuple built
            return True
        return len(shape) == self.ndim and all(e <= s for e, s in zip(self.end, shape))

    @classmethod
    def full(cls, shape: tuple[int, ...]) -> Box:
        if cls is Box:
            return _full_box(tuple(shape))
        return cls((0,) * len(shape), tuple(shape))

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.shape)) + "]"


@functools.lru_cache(maxsize=1024)
def _full_box(shape: tuple[int, ...]) -> Box:
    """Box.full, one (immutable) Box per distinct shape: a load of a MoE model asks for the same few 10^5 times."""
    return Box((0,) * len(shape), shape)


def intersect(a: Box, b: Box) -> Box | None:
    """The common region of two boxes of the same rank, or None when it holds no element."""
    starts = tuple(max(x, y) for x, y in zip(a.offsets, b.offsets))
    ends = tuple(min(x, y) for x, y in zip(a.end, b.end))
    if any(e <= s for s, e in zip(starts, ends)):
        return None
    return Box(starts, tuple(e - s for s, e in zip(starts, ends)))


def row_major_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a C-contiguous array of this shape."""
    strides = [1] * len(shape)
    for dim in range(len(shape) - 2, -1, -1):
        strides[dim] = strides[dim + 1] * shape[dim + 1]
    return tuple(strides)


def linear_index(shape: tuple[int, ...], offsets: tuple[int, ...]) -> int:
    return sum(o * s for o, s in zip(offsets, row_major_strides(shape)))


def linear_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> Iterator[Box]:
    """Boxes whose union is the row-major element range [start, stop) of a tensor of this shape.

    Worked example: shape (3, 4), range [2, 11) -> [0:1, 2:4] (rest of row 0), [1:2, 0:4] (row 1),
    [2:3, 0:3] (head of row 2).
    """
    if start >= stop:
        return
    if not shape:
        yield Box((), ())
        return
    inner = math.prod(shape[1:])
    rest = tuple(shape[1:])
    first_row, first_col = divmod(start, inner)
    last_row, last_col = divmod(stop, inner)
    if first_row == last_row:
        for box in linear_range_boxes(rest, first_col, last_col):
            yield Box((first_row, *box.offsets), (1, *box.shape))
        return
    if first_col:
        for box in linear_range_boxes(rest, first_col, inner):
            yield Box((first_row, *box.offsets), (1, *box.shape))
        first_row += 1
    if last_row > first_row:
        yield Box((first_row,) + (0,) * len(rest), (last_row - first_row, *rest))
    if last_col:
        for box in linear_range_boxes(rest, 0, last_col):
            yield Box((last_row, *box.offsets), (1, *box.shape))


def box_as_flat_range(
    shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...]
) -> tuple[int, int] | None:
    """(start, count) of the row-major element range a box covers, or None when the box is not one range."""
    outer = next((d for d, n in enumerate(lengths) if n > 1), len(shape))
    if not all(offsets[d] == 0 and lengths[d] == shape[d] for d in range(outer + 1, len(shape))):
        return None
    return linear_index(shape, offsets), math.prod(lengths)
