"""The format 1.2 piece index codec (SPEC 11.1): fence round trips, lookups, and hostile fences and blocks."""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardckpt
from shardckpt import knobs
from shardckpt.errors import FormatError, IntegrityError
from shardckpt.format.columns import encode_int_column
from shardckpt.format.manifest import (
    decode_commit_marker,
    decode_global_manifest,
    decode_index_blocks,
    encode_commit_marker,
    encode_global_manifest,
    manifest_head_size,
)
from shardckpt.format.piece_index import PieceIndex, build_index, decode_piece_index, encode_piece_index

NAMES = st.lists(
    st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), min_size=1, max_size=12),
    min_size=0,
    max_size=60,
    unique=True,
).map(sorted)


@settings(max_examples=60, deadline=None)
@given(names=NAMES, sizes=st.data(), block_bytes=st.integers(1, 200))
def test_any_sorted_names_round_trip_and_lookups_find_exactly_their_blocks(
    names: list[str], sizes: st.DataObject, block_bytes: int
) -> None:
    # Stand-ins for packed entries, each holding its name as a real one does.
    entries = [(name, name.encode() + bytes(sizes.draw(st.integers(0, 40)))) for name in names]
    region, index = build_index(entries, block_bytes=block_bytes)
    assert index.tensors == len(names) and index.region_size == len(region)
    decoded = decode_piece_index(encode_piece_index(index), "m")
    assert decoded == index
    holder = {}  # the truth: which block each name went into
    at = 0
    for number, count in enumerate(index.count):
        for name, _ in entries[at : at + count]:
            holder[name] = number
        at += count
    asked = sizes.draw(st.lists(st.sampled_from(names), max_size=8)) if names else []
    assert decoded.blocks_for(asked) == sorted({holder[name] for name in asked})
    runs = decoded.runs(decoded.blocks_for(asked))
    for begin, end, offset, size in runs:
        assert offset == sum(index.size[:begin]) and size == sum(index.size[begin:end])


def _fence(**changes: object) -> dict[str, object]:
    index = PieceIndex(("a", "b", "c"), (10, 10, 10), (1, 2, 3), (2, 1, 1))
    return {**encode_piece_index(index), **changes}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"tensors": 5}, "the field 'tensors' says 5"),
        ({"blocks": 4}, "column has 3 values, expected 4"),
        ({"first": {"enc": "nul-zlib", "n": 3, "data": zlib.compress(b"a\x00c\x00b\x00")}}, "increase strictly"),
        ({"first": {"enc": "nul-zlib", "n": 3, "data": zlib.compress(b"a\x00b\x00c")}}, "not ended by NUL"),
        ({"first": {"enc": "nul-zlib", "n": 3, "data": b"junk"}}, "not valid zlib"),
        ({"first": {"enc": "nul-zlib", "n": 3, "data": zlib.compress(b"\x00" * 20_000)}}, "names"),
        ({"size": encode_int_column([10, 0, 10])}, "block 1 size 0"),
        ({"count": encode_int_column([2, 0, 2])}, "block 1 count 0"),
        ({"crc32c": encode_int_column([1, 2, 3])}, "encoding must be 'u32le'"),
        ({"extra": 1}, "unknown field 'extra'"),
        ({"blocks": 1 << 40}, "outside"),
    ],
)
def test_a_hostile_fence_is_a_format_error_naming_the_field(changes: dict[str, object], message: str) -> None:
    with pytest.raises(FormatError, match="m piece_index") as caught:
        decode_piece_index(_fence(**changes), "m")
    assert message in str(caught.value)


def _indexed(tmp_path: object, count: int = 40) -> tuple[shardckpt.format.manifest.GlobalManifest, bytes]:
    state = {f"layer.{i:02d}.w": torch.full((3,), float(i)) for i in range(count)}
    manifest = shardckpt.save(state, f"{tmp_path}/ck", step=1)
    indexed = dataclasses.replace(manifest, version=(1, 2), index_block=100)
    return indexed, encode_global_manifest(indexed)


def test_the_head_and_some_blocks_decode_to_exactly_the_entries_asked_for(tmp_path: object) -> None:
    manifest, encoded = _indexed(tmp_path)
    whole = decode_global_manifest(encoded)
    assert not whole.partial and [t.name for t in whole.tensors] == sorted(t.name for t in manifest.tensors)
    assert encode_global_manifest(whole) == encoded  # a decoded manifest keeps its blocks
    head = manifest_head_size(encoded)
    partial = decode_global_manifest(encoded[:head], head_only=True)
    assert partial.partial and partial.tensors == ()
    index = partial.piece_index
    assert index is not None and index.blocks > 4
    wanted = ["layer.07.w", "layer.31.w", "not.there"]
    numbers = index.blocks_for(wanted)
    offsets = index.offsets()
    blocks = {n: encoded[head + offsets[n] : head + offsets[n] + index.size[n]] for n in numbers}
    some = decode_index_blocks(partial, blocks, "m")
    names = {t.name for t in some.tensors}
    assert {"layer.07.w", "layer.31.w"} <= names and len(names) < 40 and some.partial
    with pytest.raises(FormatError, match="cannot be encoded|not one decoded in part"):
        encode_global_manifest(some)


def test_a_flipped_block_byte_is_an_integrity_error_naming_the_block(tmp_path: object) -> None:
    _, encoded = _indexed(tmp_path)
    head = manifest_head_size(encoded)
    flipped = bytearray(encoded)
    flipped[head + 3] ^= 0x40
    with pytest.raises(IntegrityError, match=r"piece index block 0 \(tensors from 'layer.00.w'\)"):
        decode_global_manifest(bytes(flipped), "m")


def test_the_marker_carries_the_head_and_is_refused_without_its_entry() -> None:
    marker = decode_commit_marker(
        encode_commit_marker(
            shardckpt.format.manifest.CommitMarker(
                "a1", "manifest-a1.msgpack", 100, 5, 1, 0, version=(1, 2), head=(40, 7)
            )
        )
    )
    assert marker.head == (40, 7)
    raw = encode_commit_marker(dataclasses.replace(marker, version=(1, 1)))
    with pytest.raises(FormatError, match="needs format 1.2"):
        decode_commit_marker(raw)
    raw = raw.replace(b'"must_understand": [\n  "piece_index"\n ]', b'"must_understand": []')
    with pytest.raises(FormatError, match="if and only if"):
        decode_commit_marker(raw)


def test_commit_writes_a_piece_index_from_the_tensor_count(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    state = {f"t{i}": torch.ones(2) for i in range(5)}
    small = shardckpt.save(state, f"{tmp_path}/small", step=1)
    assert small.version == (1, 0) and small.piece_index is None and not small.index_block
    monkeypatch.setattr(knobs, "PIECE_INDEX_MIN_TENSORS", 5)
    shardckpt.save(state, f"{tmp_path}/large", step=1)
    opened = shardckpt.open(f"{tmp_path}/large")
    assert opened.manifest.version == (1, 2) and opened.manifest.piece_index is not None
    assert opened.marker.head is not None and sorted(opened.tensors) == sorted(state)
