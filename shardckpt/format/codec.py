"""The per-block lossless codec of format 1.2 (SPEC 4.1): byte grouping by element width, then zstd per group.

Pure: bytes in, bytes out, no I/O. A block that does not shrink is stored raw, so stored size <= logical size.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import zstandard

from shardckpt.errors import IntegrityError, ShardckptUsageError
from shardckpt.format.dtypes import itemsize

CODECS = ("zstd",)  # the names save(compression=) accepts, and what a 1.2 local manifest's `compression.codec` holds
# Level 1 with zstd's minimum match raised to 7 bytes: on grouped exponent bytes (MiniLM-like bf16/f32) this
# gave both the best ratio and the fastest encoder of levels -5..3 and matches 4..7 (measured, 64 KiB blocks).
DEFAULT_LEVEL = 1
_MIN_MATCH = 7
# Transforms (byte 0 of a compressed block). ROTATE first rotates each element left by one bit, so the sign
# bit moves to the bottom and the top byte holds eight exponent bits (all of BF16's, F32's; ZipNN's trick):
# that byte stream is highly repetitive and zstd shrinks it well, while the mantissa bytes stay near random.
PLAIN, GROUP, ROTATE = 0, 1, 2
# Group streams: raw, one zstd frame, or one raw deflate stream (RFC 1951). The exponent stream of a rotated float
# is written as Huffman-only deflate: an order-0 Huffman code per ~16 K symbols fits its few distinct values closer
# than zstd's matches do (MiniLM BF16 exponents: 0.329 of raw against 0.355 for zstd -1..4 and 0.332 for zstd -19,
# at about 150 MB/s per core), which is what brings the whole at or below ZipNN's size. Other groups go to zstd.
RAW_STREAM, ZSTD_STREAM, DEFLATE_STREAM = 0, 1, 2
_ROTATED = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "C64": 4}  # C64 is two F32s: group as F32
_WIDTHS = (1, 2, 4, 8)
_UINT: dict[int, np.dtype[Any]] = {1: np.dtype("u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}
_STREAM_HEAD = struct.Struct("<BI")  # per group: mode, stored length
# A hostile frame may ask for a huge window; a block is at most 64 MiB (SPEC 8), so no honest frame needs more.
_MAX_WINDOW = 1 << 27


def check_codec(name: str | None) -> str | None:
    """The codec name save(compression=) was given, or ShardckptUsageError naming the valid ones."""
    if name is None or name in CODECS:
        return name
    raise ShardckptUsageError(f"unknown compression {name!r}: valid are None (no compression) and {', '.join(CODECS)}")


def plan_transform(dtype: str, size: int) -> tuple[int, int]:
    """(transform, width) the writer uses for a block of `size` bytes of `dtype` (any length is legal)."""
    width = _ROTATED.get(dtype, itemsize(dtype))
    if width == 1 or size % width:
        return PLAIN, 1
    return (ROTATE if dtype in _ROTATED else GROUP), width


def _split(raw: bytes | memoryview, transform: int, width: int) -> list[bytes | memoryview]:
    if transform == PLAIN:
        return [raw]
    values = np.frombuffer(raw, dtype=_UINT[width])
    if transform == ROTATE:
        bits = _UINT[width].type(8 * width - 1)
        values = (values << _UINT[width].type(1)) | (values >> bits)
    grouped = np.ascontiguousarray(values.view(np.uint8).reshape(-1, width).T)
    return [memoryview(grouped[k]) for k in range(width)]


def _join(groups: list[bytes], transform: int, width: int) -> bytes:
    if transform == PLAIN:
        return bytes(groups[0])
    rows = np.stack([np.frombuffer(group, dtype=np.uint8) for group in groups])
    values = np.ascontiguousarray(rows.T).view(_UINT[width]).reshape(-1)
    if transform == ROTATE:
        bits = _UINT[width].type(8 * width - 1)
        values = (values >> _UINT[width].type(1)) | (values << bits)
    return values.tobytes()


class BlockEncoder:
    """Encodes blocks at one zstd level; not thread-safe: give every worker thread its own."""

    def __init__(self, level: int = DEFAULT_LEVEL) -> None:
        self.level = level
        # No checksum (CRC32C of both forms is in the manifest), content size on (the decoder's exact bound).
        params = zstandard.ZstdCompressionParameters.from_level(
            level, min_match=_MIN_MATCH, write_checksum=0, write_content_size=1, write_dict_id=0
        )
        self._zstd = zstandard.ZstdCompressor(compression_params=params)

    def encode(self, raw: bytes | memoryview, dtype: str) -> bytes | memoryview:
        """The stored form of one block: compressed when that is strictly smaller, else `raw` itself."""
        size = len(raw)
        if size == 0:
            return raw
        transform, width = plan_transform(dtype, size)
        parts: list[bytes | memoryview] = [bytes((transform, width))]
        total = 2
        for k, group in enumerate(_split(raw, transform, width)):
            if transform == ROTATE and k == width - 1:
                coder = zlib.compressobj(1, zlib.DEFLATED, -15, 8, zlib.Z_HUFFMAN_ONLY)  # 16 K symbols per code
                frame, kind = coder.compress(group) + coder.flush(), DEFLATE_STREAM
            else:
                frame, kind = self._zstd.compress(group), ZSTD_STREAM
            mode, body = (kind, frame) if len(frame) < len(group) else (RAW_STREAM, group)
            parts.append(_STREAM_HEAD.pack(mode, len(body)))
            parts.append(body)
            total += _STREAM_HEAD.size + len(body)
            if total >= size:
                return raw  # stored == logical means raw: the one rule that marks a raw block
        return b"".join(parts)


@dataclass(frozen=True)
class BlockPlace:
    """Where a block lives, for error messages: file, tensor, block index."""

    file: str
    tensor: str
    block: int

    def __str__(self) -> str:
        return f"{self.file}: tensor {self.tensor!r}, block {self.block}"


def decode_block(stored: bytes | memoryview, logical_size: int, where: BlockPlace | str) -> bytes | memoryview:
    """The logical bytes of one stored block; never more than `logical_size` bytes, IntegrityError otherwise."""
    size = len(stored)
    if size == logical_size:
        return stored
    if size > logical_size or size < 2:
        raise IntegrityError(f"{where}: compressed block of {size} bytes for {logical_size} logical bytes")
    transform, width = stored[0], stored[1]
    if transform not in (PLAIN, GROUP, ROTATE) or width not in _WIDTHS or (transform == PLAIN) != (width == 1):
        raise IntegrityError(f"{where}: compressed block has unknown transform {transform} / width {width}")
    if logical_size % width:
        raise IntegrityError(f"{where}: width {width} does not divide the block's {logical_size} logical bytes")
    group_size = logical_size // width
    view, pos = memoryview(stored), 2
    groups: list[bytes] = []
    for k in range(width):
        if pos + _STREAM_HEAD.size > size:
            raise IntegrityError(f"{where}: compressed block is truncated in the header of group {k}")
        mode, length = _STREAM_HEAD.unpack_from(view, pos)
        pos += _STREAM_HEAD.size
        body = view[pos : pos + length]
        pos += length
        if len(body) != length:
            raise IntegrityError(f"{where}: compressed block is truncated in group {k}")
        groups.append(_decode_stream(mode, body, group_size, f"{where}, group {k}"))
    if pos != size:
        raise IntegrityError(f"{where}: {size - pos} bytes after the last group of a compressed block")
    return _join(groups, transform, width)


def _decode_stream(mode: int, body: memoryview, size: int, where: str) -> bytes:
    if mode == RAW_STREAM:
        if len(body) != size:
            raise IntegrityError(f"{where}: raw group of {len(body)} bytes, expected {size}")
        return bytes(body)
    if mode == DEFLATE_STREAM:
        return _inflate(body, size, where)
    if mode != ZSTD_STREAM:
        raise IntegrityError(f"{where}: unknown group mode {mode}")
    try:
        claimed = zstandard.get_frame_parameters(body).content_size
        if claimed != size:
            raise IntegrityError(f"{where}: zstd frame claims {claimed} bytes, the block needs {size}")
        # The frame's content size bounds the output: zstd refuses a frame that decodes to more than it claims.
        reader = zstandard.ZstdDecompressor(max_window_size=_MAX_WINDOW).decompressobj()
        out = reader.decompress(body)
        done, rest = reader.eof, reader.unused_data
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"{where}: corrupt zstd frame ({exc})") from None
    if not done or rest or len(out) != size:
        raise IntegrityError(f"{where}: zstd frame is not exactly one complete frame of {size} bytes")
    return bytes(out)


def _inflate(body: memoryview, size: int, where: str) -> bytes:
    """Exactly one raw deflate stream of exactly `size` bytes; never more than size + 1 bytes of output."""
    inflater = zlib.decompressobj(-15)
    try:
        out = inflater.decompress(body, size + 1)
    except zlib.error as exc:
        raise IntegrityError(f"{where}: corrupt deflate stream ({exc})") from None
    if not inflater.eof or inflater.unused_data or inflater.unconsumed_tail or len(out) != size:
        raise IntegrityError(f"{where}: deflate stream is not exactly one complete stream of {size} bytes")
    return out
