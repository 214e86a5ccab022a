"""The per-block codec of format 1.2 on its own (SPEC 4.1): round trips for every dtype width and length, the size
bound, and a decoder that meets only typed errors on mutated, truncated and hostile blocks (never a crash or a bomb).
"""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from shardckpt.errors import IntegrityError, ShardckptUsageError
from shardckpt.format.codec import (
    CODECS,
    BlockDecoder,
    BlockEncoder,
    BlockPlace,
    check_codec,
    decode_block,
    plan_transform,
)
from shardckpt.format.dtypes import DTYPE_SIZES

ENCODER = BlockEncoder()
WHERE = BlockPlace("data/00000-a.safetensors", "w", 3)


def _weights(dtype: str, count: int, seed: int) -> bytes:
    """Bytes that look like trained weights (small normal floats), so the grouped streams really compress."""
    values = np.random.default_rng(seed).normal(0, 0.02, count)
    if dtype == "BF16":
        return (values.astype(np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
    kind = {"F16": "<f2", "F32": "<f4", "F64": "<f8", "C64": "<f4"}[dtype]
    return values.astype(kind).tobytes() * (2 if dtype == "C64" else 1)


@settings(max_examples=300, deadline=None)
@given(dtype=st.sampled_from(sorted(DTYPE_SIZES)), data=st.binary(min_size=0, max_size=3000))
def test_round_trip_any_dtype_any_length(dtype: str, data: bytes) -> None:
    stored = ENCODER.encode(data, dtype)
    assert len(stored) <= len(data)  # raw when it does not shrink: never larger, not even by a header
    assert bytes(decode_block(stored, len(data), WHERE)) == data


@settings(max_examples=200, deadline=None)
@given(
    dtype=st.sampled_from(sorted(DTYPE_SIZES)),
    elements=st.integers(0, 3000),
    block_size=st.sampled_from([8, 24, 96, 1000, 1024, 4096]),
    seed=st.integers(0, 2**16),
    weights=st.booleans(),
)
def test_a_run_encodes_to_exactly_its_blocks_encoded_one_by_one(
    dtype: str, elements: int, block_size: int, seed: int, weights: bool
) -> None:
    """encode_run (one grouping pass and one zstd call for many blocks) is only a faster way to the same bytes."""
    width = DTYPE_SIZES[dtype]
    if weights and dtype in ("BF16", "F16", "F32", "F64", "C64"):
        data = _weights(dtype, elements, seed)[: elements * width]
    else:
        data = np.random.default_rng(seed).integers(0, 4, elements * width, dtype=np.uint8).tobytes()
    one_by_one = [bytes(ENCODER.encode(data[at : at + block_size], dtype)) for at in range(0, len(data), block_size)]
    assert [bytes(block) for block in ENCODER.encode_run(data, dtype, block_size)] == one_by_one


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32", "F64", "C64"])
def test_float_weights_shrink_and_round_trip(dtype: str) -> None:
    data = _weights(dtype, 16384, seed=1)[:65536]
    stored = ENCODER.encode(data, dtype)
    assert len(stored) < 0.95 * len(data), (dtype, len(stored))
    assert bytes(decode_block(stored, len(data), WHERE)) == data


def test_byte_grouping_beats_plain_zstd_on_bf16() -> None:
    data = _weights("BF16", 1 << 16, seed=2)
    ours = sum(len(ENCODER.encode(data[i : i + 65536], "BF16")) for i in range(0, len(data), 65536))
    plain = sum(
        len(zstandard.ZstdCompressor(level=3).compress(data[i : i + 65536])) for i in range(0, len(data), 65536)
    )
    assert ours < 0.93 * plain, (ours, plain)


@pytest.mark.parametrize("dtype", ["BF16", "F32", "F64", "I32", "U8"])
def test_decode_into_a_buffer_that_holds_the_stored_bytes_at_its_end(dtype: str) -> None:
    """The readers put a request's stored blocks at the end of its slot and decode into the slot from the start."""
    data = _weights(dtype if dtype in ("BF16", "F32", "F64") else "F32", 8192, seed=4)[:20000]
    for raw in (data, bytes(20000), np.random.default_rng(5).bytes(20000)):  # compressed, tiny, stored raw
        stored = ENCODER.encode(raw, dtype)
        slot = np.zeros(len(raw), dtype=np.uint8)
        slot[len(raw) - len(stored) :] = np.frombuffer(stored, dtype=np.uint8)
        BlockDecoder().decode_into(memoryview(slot)[len(raw) - len(stored) :], slot, WHERE)
        assert slot.tobytes() == raw, dtype


def test_odd_tail_and_empty() -> None:
    assert plan_transform("F32", 10) == (0, 1)  # a length the width does not divide is not grouped
    assert plan_transform("BF16", 10) == (2, 2)
    assert plan_transform("I32", 8) == (1, 4)
    assert ENCODER.encode(b"", "F32") == b""
    assert bytes(decode_block(b"", 0, WHERE)) == b""


def test_codec_names() -> None:
    assert check_codec(None) is None and check_codec("zstd") == "zstd" and CODECS == ("zstd",)
    with pytest.raises(ShardckptUsageError, match="unknown compression 'zstandard'.*zstd"):
        check_codec("zstandard")


@settings(max_examples=250, deadline=None)
@given(
    dtype=st.sampled_from(["BF16", "F32", "I64", "U8"]),
    seed=st.integers(0, 3),
    edits=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=4),
    cut=st.integers(0, 64),
)
def test_decoder_fuzz_mutated_blocks(dtype: str, seed: int, edits: list[tuple[int, int]], cut: int) -> None:
    """Mutated or truncated blocks: the logical bytes or an IntegrityError naming the block, never anything else."""
    data = _weights("BF16" if dtype != "F32" else "F32", 2048, seed)[:4096]
    stored = bytearray(ENCODER.encode(data, dtype))
    for at, value in edits:
        stored[at % len(stored)] = value
    if cut:
        stored = stored[: max(0, len(stored) - cut)]
    try:
        out = decode_block(bytes(stored), len(data), WHERE)
    except IntegrityError as exc:
        assert "tensor 'w', block 3" in str(exc)
    else:
        assert len(out) == len(data)  # wrong bytes are the logical CRC's to catch (SPEC 4.1), never a wrong size


def _block(frame: bytes, width: int = 1) -> bytes:
    return bytes((0, 1)) + struct.pack("<BI", 1, len(frame)) + frame


def test_hostile_frames_are_integrity_errors() -> None:
    bomb = zstandard.ZstdCompressor().compress(bytes(1 << 24))  # 16 MiB of zeros in a few hundred bytes
    with pytest.raises(IntegrityError, match="claims 16777216 bytes, the block needs 4096"):
        decode_block(_block(bomb), 4096, WHERE)
    unknown_size = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    frame = unknown_size.compress(bytes(1000)) + unknown_size.flush()
    with pytest.raises(IntegrityError, match="zstd frame claims 18446744073709551615 bytes"):
        decode_block(_block(frame), 4096, WHERE)
    good = zstandard.ZstdCompressor().compress(bytes(4096))
    with pytest.raises(IntegrityError, match="not exactly one complete frame"):
        decode_block(_block(good + b"\0"), 4096, WHERE)
    with pytest.raises(IntegrityError, match="2 bytes after the last group"):
        decode_block(_block(good) + b"xy", 4096, WHERE)
    with pytest.raises(IntegrityError, match="unknown transform 7"):
        decode_block(bytes((7, 1)) + bytes(10), 4096, WHERE)
    with pytest.raises(IntegrityError, match="5000 bytes for 4096"):
        decode_block(bytes(5000), 4096, WHERE)
    lying = bytearray(zstandard.ZstdCompressor().compress(bytes(range(256)) * 64))
    assert lying[4] == 0x60  # single segment, a 2-byte content size field holding size - 256
    lying[5:7] = struct.pack("<H", 4096 - 256)  # the frame now claims 4096 bytes but holds 16384
    with pytest.raises(IntegrityError, match="corrupt zstd frame"):
        decode_block(_block(bytes(lying)), 4096, WHERE)


def test_hostile_deflate_groups_are_integrity_errors() -> None:
    def deflate(data: bytes) -> bytes:
        coder = zlib.compressobj(1, zlib.DEFLATED, -15, 8, zlib.Z_HUFFMAN_ONLY)
        return coder.compress(data) + coder.flush()

    def block(stream: bytes) -> bytes:  # one rotated BF16 block of 4096 bytes: mantissa raw, exponents deflated
        return bytes((2, 2)) + struct.pack("<BI", 0, 2048) + bytes(2048) + struct.pack("<BI", 2, len(stream)) + stream

    good = deflate(bytes((0, 1, 2, 3)) * 512)
    assert len(decode_block(block(good), 4096, WHERE)) == 4096
    bomb = zlib.compressobj(9, zlib.DEFLATED, -15)
    with pytest.raises(IntegrityError, match="not exactly one complete stream of 2048 bytes"):
        decode_block(block(bomb.compress(bytes(1 << 20)) + bomb.flush()), 4096, WHERE)  # 1 MiB in ~1 KiB: not inflated
    with pytest.raises(IntegrityError, match="not exactly one complete stream"):
        decode_block(block(good[:-3]), 4096, WHERE)
    with pytest.raises(IntegrityError, match="not exactly one complete stream"):
        decode_block(block(good + b"\0\0"), 4096, WHERE)
    with pytest.raises(IntegrityError, match="corrupt deflate stream|not exactly one complete"):
        decode_block(block(b"\xff" * len(good)), 4096, WHERE)
    with pytest.raises(IntegrityError, match="unknown group mode 3"):
        decode_block(
            bytes((2, 2)) + struct.pack("<BI", 3, 2048) + bytes(2048) + struct.pack("<BI", 0, 2048), 4096, WHERE
        )
