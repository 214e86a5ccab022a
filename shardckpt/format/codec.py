"""The per-block lossless codec of format 1.2 (SPEC 4.1): byte grouping by element width, then zstd per group.

Pure: bytes in, bytes out, no I/O. A block that does not shrink is stored raw, so stored size <= logical size.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import zstandard

from shardckpt.errors import IntegrityError, ShardckptUsageError
from shardckpt.format.dtypes import itemsize

try:  # zlib-ng writes the same Huffman-only streams (equal sizes) 1.35x faster than zlib 1.2 (whole encoder, MiniLM)
    from zlib_ng import zlib_ng as _deflate
except ImportError:  # pragma: no cover - a platform without its wheel: the stdlib's zlib, slower
    _deflate = zlib  # type: ignore[misc]

CODECS = ("zstd",)  # the names save(compression=) accepts, and what a 1.2 local manifest's `compression.codec` holds
# Level 1 with zstd's minimum match raised to 7 bytes: on grouped exponent bytes (MiniLM-like bf16/f32) this
# gave both the best ratio and the fastest encoder of levels -5..3 and matches 4..7 (measured, 64 KiB blocks).
DEFAULT_LEVEL = 1
_MIN_MATCH = 7
# A 64-entry match table: grouped float bytes hold few long matches, and a small table stays in L1, which made the
# zstd groups both smaller and 1.3-2.5x faster to encode than level 1's own table (benchmarks.compression_codecs).
_HASH_LOG = 6
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
    # One shift and one narrowing copy per group, straight from the elements: no rotated copy of the block and no
    # transposing copy (1.4-1.9x faster than rotate, view as bytes, transpose; measured on MiniLM blocks).
    kind = _UINT[width].type
    values = np.frombuffer(raw, dtype=_UINT[width])
    if transform == ROTATE:  # byte k of the rotated element is bits 8k-1 .. 8k+6 of the element
        low = (values << kind(1)) | (values >> kind(8 * width - 1))
        groups = [low.astype(np.uint8)]
        groups += [(values >> kind(8 * k - 1)).astype(np.uint8) for k in range(1, width)]
    else:
        groups = [values.astype(np.uint8)] + [(values >> kind(8 * k)).astype(np.uint8) for k in range(1, width)]
    return [memoryview(group) for group in groups]


def _join_into(groups: list[bytes | memoryview], transform: int, width: int, out: np.ndarray[Any, Any]) -> None:
    """Write the elements the groups hold into `out` (uint8, exactly their bytes, any alignment). Every group is read
    before `out` is written, so a group may be a view of bytes that `out` overlaps (a stored block read in place)."""
    if transform == PLAIN:
        out[:] = np.frombuffer(groups[0], dtype=np.uint8)  # numpy copies through a buffer when the two overlap
        return
    kind, element = _UINT[width].type, _UINT[width]
    # Widened and or-ed per group, then written once: faster than strided byte writes into `out` (1.7-2.4 GiB/s
    # against 0.4-0.6 for stack + transpose + tobytes), and unaligned destinations cost nothing extra.
    values = np.frombuffer(groups[0], dtype=np.uint8).astype(element)
    for k in range(1, width):
        part = np.frombuffer(groups[k], dtype=np.uint8).astype(element)
        part <<= kind(8 * k)
        values |= part
    if transform == ROTATE:
        low = values >> kind(1)
        values <<= kind(8 * width - 1)
        values |= low
    out.view(element)[:] = values


class BlockEncoder:
    """Encodes blocks at one zstd level; not thread-safe: give every worker thread its own."""

    def __init__(self, level: int = DEFAULT_LEVEL) -> None:
        self.level = level
        # No checksum (CRC32C of both forms is in the manifest), content size on (the decoder's exact bound).
        params = zstandard.ZstdCompressionParameters.from_level(
            level, min_match=_MIN_MATCH, hash_log=_HASH_LOG, write_checksum=0, write_content_size=1, write_dict_id=0
        )
        self._zstd = zstandard.ZstdCompressor(compression_params=params)

    def encode(self, raw: bytes | memoryview, dtype: str) -> bytes | memoryview:
        """The stored form of one block: compressed when that is strictly smaller, else `raw` itself."""
        if len(raw) == 0:
            return raw
        transform, width = plan_transform(dtype, len(raw))
        groups = _split(raw, transform, width)
        frames = [self._zstd.compress(group) for k, group in enumerate(groups) if not _deflated(transform, width, k)]
        return _assemble(raw, transform, width, groups, iter(frames))

    def encode_run(self, run: bytes | memoryview, dtype: str, block_size: int) -> list[bytes | memoryview]:
        """The stored forms of the blocks `run` is cut into (`block_size` bytes each, the last maybe shorter): exactly
        what encode() gives block by block, with the run's byte grouping done in one pass (fewer, longer numpy calls:
        611 -> 623 MiB/s of MiniLM fp32 per core; one zstd call for all the run's groups, multi_compress_to_buffer,
        was slower at 560)."""
        view = memoryview(run).cast("B")
        blocks = [view[at : at + block_size] for at in range(0, len(view), block_size)]
        transform, width = plan_transform(dtype, len(view))
        if len(blocks) < 2 or any(plan_transform(dtype, len(block)) != (transform, width) for block in blocks):
            return [self.encode(block, dtype) for block in blocks]
        # Grouping is per element, so block i's group k is a slice of the run's group k.
        groups, part = _split(view, transform, width), block_size // width
        out: list[bytes | memoryview] = []
        for block, at in zip(blocks, range(0, len(groups[0]), part)):
            mine = [group[at : at + part] for group in groups]
            frames = [self._zstd.compress(g) for k, g in enumerate(mine) if not _deflated(transform, width, k)]
            out.append(_assemble(block, transform, width, mine, iter(frames)))
        return out


def _deflated(transform: int, width: int, k: int) -> bool:
    """Whether group k is written as Huffman-only deflate (a rotated float's exponent byte), not zstd."""
    return transform == ROTATE and k == width - 1


def _assemble(
    raw: bytes | memoryview, transform: int, width: int, groups: list[bytes | memoryview], frames: Iterator[Any]
) -> bytes | memoryview:
    """One block's stored form from its groups and their zstd frames (taken in order from `frames`): compressed when
    that is strictly smaller than `raw`, else `raw` itself (stored == logical means raw: the one rule marking it)."""
    parts: list[Any] = [bytes((transform, width))]
    total = 2
    for k, group in enumerate(groups):
        if _deflated(transform, width, k):
            # memLevel 8: a Huffman code per 16 K symbols. A 32 KiB window although no match is searched: a smaller
            # one slides every few bytes (5x slower); reusing a template by copy() was no faster.
            coder = _deflate.compressobj(1, _deflate.DEFLATED, -15, 8, _deflate.Z_HUFFMAN_ONLY)
            frame, kind = coder.compress(group) + coder.flush(), DEFLATE_STREAM
        else:
            frame, kind = next(frames), ZSTD_STREAM
        mode, body = (kind, frame) if len(frame) < len(group) else (RAW_STREAM, group)
        parts.append(_STREAM_HEAD.pack(mode, len(body)))
        parts.append(body)
        total += _STREAM_HEAD.size + len(body)
    return raw if total >= len(raw) else b"".join(parts)


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
    return BlockDecoder().decode(stored, logical_size, where)


class BlockDecoder:
    """Decodes blocks with one zstd context, made once: a new context per group cost 2.6x the decompression itself
    (931 against 2398 MiB/s on grouped MiniLM bytes). Not thread-safe: give every worker thread its own."""

    def __init__(self) -> None:
        self._zstd = zstandard.ZstdDecompressor(max_window_size=_MAX_WINDOW)

    def decode(self, stored: bytes | memoryview, logical_size: int, where: BlockPlace | str) -> bytes | memoryview:
        """The logical bytes of one stored block (`stored` itself when stored raw), as decode_block."""
        if len(stored) == logical_size:
            return stored
        out = np.empty(logical_size, dtype=np.uint8)
        self.decode_into(stored, out, where)
        return out.data

    def decode_into(self, stored: bytes | memoryview, out: np.ndarray[Any, Any], where: BlockPlace | str) -> None:
        """Decode one stored block into `out` (uint8, exactly its logical size), which the stored bytes may overlap
        (a block decoded where it was read): nothing is written to `out` before every stored byte has been read."""
        size, logical_size = len(stored), out.size
        if size == logical_size:
            out[:] = np.frombuffer(stored, dtype=np.uint8)  # stored raw (numpy buffers an overlapping copy)
            return
        if size > logical_size or size < 2:
            raise IntegrityError(f"{where}: compressed block of {size} bytes for {logical_size} logical bytes")
        transform, width = stored[0], stored[1]
        if transform not in (PLAIN, GROUP, ROTATE) or width not in _WIDTHS or (transform == PLAIN) != (width == 1):
            raise IntegrityError(f"{where}: compressed block has unknown transform {transform} / width {width}")
        if logical_size % width:
            raise IntegrityError(f"{where}: width {width} does not divide the block's {logical_size} logical bytes")
        group_size = logical_size // width
        view, pos = memoryview(stored), 2
        groups: list[bytes | memoryview] = []
        for k in range(width):
            if pos + _STREAM_HEAD.size > size:
                raise IntegrityError(f"{where}: compressed block is truncated in the header of group {k}")
            mode, length = _STREAM_HEAD.unpack_from(view, pos)
            pos += _STREAM_HEAD.size
            body = view[pos : pos + length]
            pos += length
            if len(body) != length:
                raise IntegrityError(f"{where}: compressed block is truncated in group {k}")
            groups.append(_decode_stream(self._zstd, mode, body, group_size, f"{where}, group {k}"))
        if pos != size:
            raise IntegrityError(f"{where}: {size - pos} bytes after the last group of a compressed block")
        _join_into(groups, transform, width, out)


def _decode_stream(
    zstd: zstandard.ZstdDecompressor, mode: int, body: memoryview, size: int, where: str
) -> bytes | memoryview:
    if mode == RAW_STREAM:
        if len(body) != size:
            raise IntegrityError(f"{where}: raw group of {len(body)} bytes, expected {size}")
        return body  # a view: _join_into reads it before it writes anything
    if mode == DEFLATE_STREAM:
        return _inflate(body, size, where)
    if mode != ZSTD_STREAM:
        raise IntegrityError(f"{where}: unknown group mode {mode}")
    try:
        frame = zstandard.get_frame_parameters(body)
        if frame.content_size != size:
            raise IntegrityError(f"{where}: zstd frame claims {frame.content_size} bytes, the block needs {size}")
        if frame.window_size > _MAX_WINDOW:
            raise IntegrityError(f"{where}: zstd frame asks for a window of {frame.window_size} bytes")
        # One-shot into a buffer of the declared content size: zstd refuses a frame that decodes to more or fewer
        # bytes than it declares, and allow_extra_data=False refuses anything after the frame.
        out = zstd.decompress(body, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise IntegrityError(
            f"{where}: corrupt zstd frame, not exactly one complete frame of {size} bytes ({exc})"
        ) from None
    if len(out) != size:
        raise IntegrityError(f"{where}: zstd frame is not exactly one complete frame of {size} bytes")
    return out


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
