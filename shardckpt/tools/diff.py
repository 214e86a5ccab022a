"""Comparing two checkpoints tensor by tensor and object by object, streaming both under one memory bound.

Per tensor: bitwise equal, or how many elements differ and the largest absolute difference; shape/dtype changes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from shardckpt import knobs
from shardckpt.format.dtypes import itemsize
from shardckpt.read.checkpoint import Checkpoint
from shardckpt.read.streaming import arena_view, chunk_arena, chunk_elements, open_streaming, read_chunks
from shardckpt.storage import Storage
from shardckpt.torch_bytes import torch_dtype

DEFAULT_MEMORY_LIMIT = knobs.MEMORY_LIMIT
_SAME_SIZE_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# Statuses: the first three compare values, the rest describe what could not be compared element by element.
EQUAL, CLOSE, DIFFERENT, DTYPE_CHANGED, SHAPE_CHANGED, ONLY_A, ONLY_B = (
    "equal",
    "close",
    "different",
    "dtype changed",
    "shape changed",
    "only in A",
    "only in B",
)


@dataclass(frozen=True)
class TensorDiff:
    name: str
    status: str
    dtype_a: str | None = None
    dtype_b: str | None = None
    shape_a: tuple[int, ...] | None = None
    shape_b: tuple[int, ...] | None = None
    mismatched: int = 0  # elements whose bits differ (values, when the dtype changed)
    max_abs_diff: float | None = None  # over the mismatched elements, in float64 (NaN when a NaN is involved)

    @property
    def same(self) -> bool:
        return self.status in (EQUAL, CLOSE)


@dataclass(frozen=True)
class ObjectDiff:
    name: str
    rank: int | None  # None: shared by all ranks
    status: str  # "changed", "only in A", "only in B"
    value_a: Any = None
    value_b: Any = None


@dataclass
class DiffReport:
    a: str
    b: str
    step_a: int | None = None
    step_b: int | None = None
    tensors: list[TensorDiff] = field(default_factory=list)
    objects: list[ObjectDiff] = field(default_factory=list)
    bytes_compared: int = 0

    @property
    def identical(self) -> bool:
        return all(t.same for t in self.tensors) and not self.objects


def diff(
    a: str | Storage,
    b: str | Storage,
    *,
    atol: float | None = None,
    memory_limit: int = DEFAULT_MEMORY_LIMIT,
    storage_options: dict[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> DiffReport:
    """Compare checkpoints `a` and `b`. Tensors whose largest difference is at most `atol` count as close.

    Tensor data in memory stays under `memory_limit` bytes; `progress(nbytes, total)` follows the bytes of A read.
    """
    left = open_streaming(a, memory_limit, storage_options=storage_options)
    right = open_streaming(b, memory_limit, storage_options=storage_options)
    report = DiffReport(left.url, right.url, left.manifest.step, right.manifest.step)
    entries_a, entries_b = left.manifest.tensor_index(), right.manifest.tensor_index()
    common = [name for name in entries_a if name in entries_b]
    total = sum(entries_a[n].nbytes for n in common if entries_a[n].shape == entries_b[n].shape)
    arena = chunk_arena(memory_limit)
    for name in sorted(set(entries_a) | set(entries_b)):
        ea, eb = entries_a.get(name), entries_b.get(name)
        if ea is None or eb is None:
            if eb is None and ea is not None:
                report.tensors.append(TensorDiff(name, ONLY_A, dtype_a=ea.dtype, shape_a=ea.shape))
            elif eb is not None:
                report.tensors.append(TensorDiff(name, ONLY_B, dtype_b=eb.dtype, shape_b=eb.shape))
            continue
        if ea.shape != eb.shape:
            report.tensors.append(TensorDiff(name, SHAPE_CHANGED, ea.dtype, eb.dtype, ea.shape, eb.shape))
            continue
        mismatched, largest = _compare(left, right, name, arena, total, progress)
        report.bytes_compared += ea.nbytes
        if ea.dtype != eb.dtype:
            status = DTYPE_CHANGED
        elif not mismatched:
            status = EQUAL
        elif atol is not None and largest is not None and largest <= atol:
            status = CLOSE
        else:
            status = DIFFERENT
        largest = largest if mismatched else None
        report.tensors.append(TensorDiff(name, status, ea.dtype, eb.dtype, ea.shape, eb.shape, mismatched, largest))
    report.objects = _object_diffs(left, right)
    return report


def _compare(
    left: Checkpoint,
    right: Checkpoint,
    name: str,
    arena: torch.Tensor,
    total: int,
    progress: Callable[[int, int], None] | None,
) -> tuple[int, float | None]:
    """(elements that differ, largest absolute difference among them) of tensor `name`, chunk by chunk."""
    dtype_a, dtype_b = left.entry(name).dtype, right.entry(name).dtype
    size_a, size_b = itemsize(dtype_a), itemsize(dtype_b)
    wide = torch.complex128 if torch_dtype(dtype_a).is_complex or torch_dtype(dtype_b).is_complex else torch.float64
    # Per element: both chunks, two wide copies, the absolute difference (complex only) and a mask.
    per_element = size_a + size_b + 2 * wide.itemsize + (8 if wide.is_complex else 0) + 1
    elements = chunk_elements(left, arena, per_element)
    offset_b = -(-elements * size_a // 8) * 8
    wide_a, offset = arena_view(arena, offset_b + elements * size_b, elements, wide)
    wide_b, offset = arena_view(arena, offset, elements, wide)
    absolute = None
    if wide.is_complex:  # |a - b| of complex values is real: it needs a buffer of its own
        absolute, offset = arena_view(arena, offset, elements, torch.float64)
    mask, _ = arena_view(arena, offset, elements, torch.bool)
    mismatched, largest = 0, 0.0
    chunks = zip(read_chunks(left, name, elements, arena), read_chunks(right, name, elements, arena, offset_b))
    for chunk_a, chunk_b in chunks:
        n = chunk_a.numel()
        if dtype_a == dtype_b:  # bits: NaN equals the same NaN, -0.0 differs from 0.0
            bits = _SAME_SIZE_INTS[size_a]
            torch.ne(chunk_a.view(bits), chunk_b.view(bits), out=mask[:n])
        else:  # values, once both are widened
            torch.ne(wide_a[:n].copy_(chunk_a), wide_b[:n].copy_(chunk_b), out=mask[:n])
        count = int(mask[:n].sum())
        if count:
            da, db = wide_a[:n].copy_(chunk_a), wide_b[:n].copy_(chunk_b)
            da.sub_(db)
            diff_abs = da.abs_() if absolute is None else torch.abs(da, out=absolute[:n])
            diff_abs.masked_fill_(mask[:n].logical_not_(), 0.0)  # equal elements add nothing
            value = float(diff_abs.max())
            largest = largest if math.isnan(largest) else value if math.isnan(value) else max(largest, value)
            mismatched += count
        if progress is not None:
            progress(n * size_a, total)
    return mismatched, largest


def _object_diffs(left: Checkpoint, right: Checkpoint) -> list[ObjectDiff]:
    values_a = {(o.name, o.rank): o.value for o in left.manifest.objects}
    values_b = {(o.name, o.rank): o.value for o in right.manifest.objects}
    diffs = []
    for key in sorted(set(values_a) | set(values_b), key=lambda k: (k[0], -1 if k[1] is None else k[1])):
        if key not in values_b:
            diffs.append(ObjectDiff(*key, ONLY_A, value_a=values_a[key]))
        elif key not in values_a:
            diffs.append(ObjectDiff(*key, ONLY_B, value_b=values_b[key]))
        elif values_a[key] != values_b[key]:
            diffs.append(ObjectDiff(*key, "changed", values_a[key], values_b[key]))
    return diffs
