"""Element types of the format: the safetensors dtype names and their sizes in bytes.

The names are exactly those safetensors writes in its headers, so a data file opens with stock tools.
"""

from __future__ import annotations

from shardckpt.errors import FormatError

DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "I16": 2,
    "U16": 2,
    "I32": 4,
    "U32": 4,
    "I64": 8,
    "U64": 8,
    "F16": 2,
    "BF16": 2,
    "F32": 4,
    "F64": 8,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2FNUZ": 1,
    "F8_E8M0": 1,
    "C64": 8,
}


def itemsize(dtype: str) -> int:
    """Bytes per element of a format dtype name; FormatError for an unknown name."""
    try:
        return DTYPE_SIZES[dtype]
    except KeyError:
        raise FormatError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_SIZES)}") from None
