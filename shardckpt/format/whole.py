"""Deciding in one pass which one-piece tensors of a global manifest hold their whole tensor (a load of many
small tensors): each offset column inflated once, the shared columns from a cache, the bounds checked in numpy.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

from shardckpt.format.columns import DELTA_ZLIB, SMALL_COLUMN, column_values, small_column_values
from shardckpt.format.dtypes import DTYPE_SIZES
from shardckpt.format.manifest import PieceTable, TensorEntry


def whole_pieces(entries: Sequence[TensorEntry]) -> list[bool]:
    """is_whole of each entry, deciding the one-piece tables not decoded yet in one pass: each offset column
    inflated once, the shared columns from a cache, the bounds of all of them checked at once in numpy. A table
    that fails a check, or is not written as a writer writes it, is left as it is (False) for the per-table path,
    which decodes it or raises the error, with the same message as ever."""
    verdicts = [False] * len(entries)
    batch: list[tuple[int, PieceTable, tuple[int, int, tuple[int, ...], tuple[int, ...]], int]] = []
    file_sizes: list[int] | None = None  # of the first table's manifest: one batch checks one file table
    for number, entry in enumerate(entries):
        table = entry.pieces
        if table.count != 1:
            continue
        if table._encoded is None or table._check is None:  # decoded already, or built in memory: cheap
            verdicts[number] = table.is_whole(entry.shape, entry.layout)
            continue
        raw = table._encoded
        try:
            file, offset, start, length = raw["file"], raw["offset"], raw["start"], raw["length"]
            encodings = file["enc"], offset["enc"], start["enc"], length["enc"]
            counts = file["n"], offset["n"], start["n"], length["n"]
            data = file["data"], offset["data"], start["data"], length["data"]
        except (KeyError, TypeError):  # not maps, or a key missing: the per-table path names the fault
            continue
        if encodings != _FOUR_DELTA_ZLIB_T or counts != (1, 1, table.k, table.k):
            continue
        if not type(counts[0]) is type(counts[1]) is type(counts[2]) is type(counts[3]) is int:  # not True for 1
            continue
        if not type(data[0]) is type(data[1]) is type(data[2]) is type(data[3]) is bytes:
            continue
        if file_sizes is None:
            file_sizes = table._check.file_sizes
        if table._check.file_sizes is not file_sizes or table.k > SMALL_COLUMN:
            continue
        whole = _whole_columns(data[0], data[2], data[3], entry.shape, entry.layout, entry.dtype)
        at = None if whole is None else column_values(data[1], 1)
        if whole is not None and at is not None:
            batch.append((number, table, whole, at[0]))
    if not batch:
        return verdicts
    assert file_sizes is not None
    files = np.array([item[2][0] for item in batch], dtype=np.int64)
    nbytes = np.array([item[2][1] for item in batch], dtype=np.int64)
    offsets = np.array([item[3] for item in batch], dtype=np.int64)
    sizes = np.array(file_sizes, dtype=np.int64)
    known = (files >= 0) & (files < sizes.size)
    held = sizes[np.where(known, files, 0)] if sizes.size else np.zeros_like(files)
    # _check_one's bounds: start and length fit the shape (they are the shape itself) and the bytes lie inside
    # the data file; held - nbytes rather than offsets + nbytes, which a hostile offset near 2^63 would overflow.
    known &= (offsets >= 0) & (offsets <= held) & (offsets <= held - nbytes)
    for (number, table, (file, _, start, length), offset), ok in zip(batch, known.tolist()):
        if ok:
            table._lists, table._encoded = ((file,), (offset,), [list(start)], [list(length)]), None
            verdicts[number] = True
    return verdicts


_FOUR_DELTA_ZLIB_T = (DELTA_ZLIB,) * 4


@functools.lru_cache(maxsize=4096)
def _whole_columns(
    file: bytes, start: bytes, length: bytes, shape: tuple[int, ...], layout: str, dtype: str
) -> tuple[int, int, tuple[int, ...], tuple[int, ...]] | None:
    """(file, nbytes, start, length) when the columns hold one piece that is the whole tensor, else None."""
    whole = shape if layout == "box" else (math.prod(shape),)
    k = len(whole)
    values = small_column_values(file, 1), small_column_values(start, k), small_column_values(length, k)
    if values[0] is None or values[1] is None or values[2] != whole or any(values[1]) or math.prod(shape) == 0:
        return None
    return values[0][0], math.prod(shape) * DTYPE_SIZES[dtype], values[1], values[2]
