"""Integer columns of the manifests: delta-encoded, zlib-compressed int64 arrays, or raw uint32 checksums.

Regular shardings (FSDP chunks, equal offsets on every rank) compress to a few bytes per tensor, which keeps
the global manifest of a 100B-parameter model on thousands of ranks in the low megabytes.
"""

from __future__ import annotations

import functools
import itertools
import struct
import zlib
from typing import Any

import numpy as np
import numpy.typing as npt

from shardckpt.errors import FormatError

Int64Array = npt.NDArray[np.int64]
UInt32Array = npt.NDArray[np.uint32]

DELTA_ZLIB = "delta-zlib"
U32LE = "u32le"
# 2^28 values decode to 2 GiB at most, whatever a hostile column claims.
MAX_COLUMN_VALUES = 1 << 28
# Columns this short (a tensor with a piece or two) skip numpy: its per-call cost is most of a small column's.
SMALL_COLUMN = 8
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def encode_int_column(values: npt.ArrayLike) -> dict[str, Any]:
    if isinstance(values, (list, tuple)) and len(values) <= SMALL_COLUMN:
        return encode_small_int_column(values)
    array = np.ascontiguousarray(values, dtype=np.int64).reshape(-1)
    if array.size <= SMALL_COLUMN:
        return encode_small_int_column(array.tolist())
    deltas = np.empty_like(array)
    deltas[0] = array[0]
    np.subtract(array[1:], array[:-1], out=deltas[1:])
    return {"enc": DELTA_ZLIB, "n": int(array.size), "data": _compress(deltas.astype("<i8").tobytes())}


def encode_small_int_column(values: list[int] | tuple[int, ...]) -> dict[str, Any]:
    """encode_int_column of a few Python ints, byte for byte, without numpy (deltas wrap in int64 as numpy's)."""
    key = tuple(values)
    return {"enc": DELTA_ZLIB, "n": len(key), "data": _small_column_data(key)}


@functools.lru_cache(maxsize=4096)
def _small_column_data(values: tuple[int, ...]) -> bytes:
    # Cached by value: most tensors share their file, start and length columns (one piece, the same shapes).
    previous, deltas = 0, []
    for value in values:
        delta = (int(value) - previous + (1 << 63)) % (1 << 64) - (1 << 63)
        deltas.append(delta)
        previous = int(value)
    return _compress(struct.pack(f"<{len(deltas)}q", *deltas))


@functools.lru_cache(maxsize=4096)
def _compress(raw: bytes) -> bytes:
    # Columns repeat across tensors (file 0, start 0 0, the same shapes): compress each distinct one once.
    return zlib.compress(raw, 6)


def encode_u32_column(values: npt.ArrayLike) -> dict[str, Any]:
    array = np.ascontiguousarray(values, dtype="<u4").reshape(-1)
    return {"enc": U32LE, "n": int(array.size), "data": array.tobytes()}


def _header(column: object, where: str, expected_enc: str, expected_n: int | None) -> tuple[int, bytes]:
    if not isinstance(column, dict):
        raise FormatError(f"{where}: column must be a map, got {type(column).__name__}")
    enc, n, data = column.get("enc"), column.get("n"), column.get("data")
    if enc != expected_enc:
        raise FormatError(f"{where}: column encoding must be {expected_enc!r}, got {enc!r}")
    if type(n) is not int or not 0 <= n <= MAX_COLUMN_VALUES:
        raise FormatError(f"{where}: column length must be an integer in 0..{MAX_COLUMN_VALUES}, got {n!r}")
    if expected_n is not None and n != expected_n:
        raise FormatError(f"{where}: column has {n} values, expected {expected_n}")
    if not isinstance(data, bytes):
        raise FormatError(f"{where}: column data must be binary, got {type(data).__name__}")
    return n, data


def column_data(column: object, where: str, n: int) -> bytes:
    """The data of a delta-zlib column of `n` values, its header checked as decode_int_column checks it."""
    return _header(column, where, DELTA_ZLIB, n)[1]


def decode_int_column(column: object, where: str, expected_n: int | None = None) -> Int64Array:
    """Decode a delta-zlib column; the output is bounded by the declared length, never by the input."""
    n, raw = _inflate(column, where, expected_n)
    # Overflow wraps silently in numpy's integer cumsum (no warning); every caller range-checks the decoded values,
    # which catches it. cumsum makes a new array, so the result never aliases `raw`.
    if n <= SMALL_COLUMN:
        values = list(itertools.accumulate(struct.unpack(f"<{n}q", raw)))
        if all(_INT64_MIN <= value <= _INT64_MAX for value in values):
            return np.array(values, dtype=np.int64)
    return np.cumsum(np.frombuffer(raw, dtype="<i8"), dtype=np.int64)


def decode_int_list(column: object, where: str, expected_n: int | None = None) -> tuple[int, ...]:
    """decode_int_column as Python ints (the same values, int64 wrap-around included): for short columns."""
    n, data = _header(column, where, DELTA_ZLIB, expected_n)
    if n <= SMALL_COLUMN:
        known = small_column_values(data, n)
        if known is not None:
            return known
    n, raw = _inflate(column, where, expected_n)  # raises the error, naming `where`, or decodes a longer column
    values = tuple(itertools.accumulate(struct.unpack(f"<{n}q", raw)))
    if all(_INT64_MIN <= value <= _INT64_MAX for value in values):
        return values
    return tuple(np.cumsum(np.frombuffer(raw, dtype="<i8"), dtype=np.int64).tolist())


def column_values(data: bytes, n: int) -> tuple[int, ...] | None:
    """The values of a short column, or None when it is not exactly n int64 values without wrap-around."""
    inflater = zlib.decompressobj()
    try:
        raw = inflater.decompress(data, 8 * n + 1)
    except zlib.error:
        return None
    if len(raw) != 8 * n or inflater.unconsumed_tail or inflater.unused_data or not inflater.eof:
        return None
    values = tuple(itertools.accumulate(struct.unpack(f"<{n}q", raw)))
    return values if all(_INT64_MIN <= value <= _INT64_MAX for value in values) else None


# Cached: most tensors share their file, start and length columns (same shape, one piece), only offsets differ
# (those go to column_values: each is distinct, and would only push the shared ones out).
small_column_values = functools.lru_cache(maxsize=4096)(column_values)


def _inflate(column: object, where: str, expected_n: int | None) -> tuple[int, bytes]:
    n, data = _header(column, where, DELTA_ZLIB, expected_n)
    inflater = zlib.decompressobj()
    try:
        raw = inflater.decompress(data, 8 * n + 1)
    except zlib.error as exc:
        raise FormatError(f"{where}: column data is not valid zlib ({exc})") from None
    if len(raw) != 8 * n or inflater.unconsumed_tail or inflater.unused_data or not inflater.eof:
        raise FormatError(f"{where}: column data does not decode to exactly {n} int64 values")
    return n, raw


def decode_u32_column(column: object, where: str, expected_n: int | None = None) -> UInt32Array:
    n, data = _header(column, where, U32LE, expected_n)
    if len(data) != 4 * n:
        raise FormatError(f"{where}: checksum column holds {len(data)} bytes, expected {4 * n}")
    return np.frombuffer(data, dtype="<u4").astype(np.uint32)
