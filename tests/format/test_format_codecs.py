"""Codecs of format v1 on their own: integer columns, plain values, manifests (global, local, COMMITTED) and
layout names. Everything a reader decodes is hostile: malformed input may only ever raise FormatError.
"""

from __future__ import annotations

import contextlib
import copy
import math
import zlib
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardckpt.errors import CoverageError, FormatError
from shardckpt.format import columns, layout, piece_columns
from shardckpt.format import manifest as manifest_module
from shardckpt.format.columns import decode_int_column, decode_u32_column, encode_int_column, encode_u32_column
from shardckpt.format.limits import MAX_DEPTH
from shardckpt.format.local_manifest import (
    LocalManifest,
    LocalPieces,
    TensorSpec,
    decode_local_manifest,
    encode_local_manifest,
)
from shardckpt.format.manifest import (
    CommitMarker,
    FileEntry,
    GlobalManifest,
    PieceTable,
    TensorEntry,
    decode_commit_marker,
    decode_global_manifest,
    encode_commit_marker,
    encode_global_manifest,
    tensor_entry,
)
from shardckpt.format.strict import ObjectEntry
from shardckpt.format.values import check_plain, pack_value, unpack_value

I64_MIN, I64_MAX, U64_MAX = -(1 << 63), (1 << 63) - 1, (1 << 64) - 1

# =========================================================================================== columns


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.integers(I64_MIN, I64_MAX), max_size=300))
def test_int_column_round_trip(values: list[int]) -> None:
    column = encode_int_column(values)
    assert column["enc"] == "delta-zlib"
    assert column["n"] == len(values)
    decoded = decode_int_column(column, "col", len(values))
    assert decoded.dtype == np.int64
    assert decoded.tolist() == values


def test_int_column_extremes_and_empty() -> None:
    # Deltas between the extremes overflow int64; they must wrap and unwrap exactly.
    values = [I64_MIN, I64_MAX, I64_MIN, 0, -1, I64_MAX, I64_MAX, 1]
    assert decode_int_column(encode_int_column(values), "col").tolist() == values
    assert decode_int_column(encode_int_column(np.array(values)), "col", 8).tolist() == values
    assert decode_int_column(encode_int_column([]), "col", 0).tolist() == []
    regular = np.arange(0, 1 << 20, 4096, dtype=np.int64)
    column = encode_int_column(regular)
    assert len(column["data"]) < 64  # regular offsets compress to a few bytes
    np.testing.assert_array_equal(decode_int_column(column, "col"), regular)


def _good_column() -> dict[str, Any]:
    return encode_int_column([5, 7, 11])


@pytest.mark.parametrize(
    "change",
    [
        {"enc": "u32le"},
        {"enc": "zlib"},
        {"enc": None},
        {"enc": 1},
        {"n": 2},
        {"n": 4},
        {"n": -1},
        {"n": True},
        {"n": 3.0},
        {"n": "3"},
        {"n": 1 << 40},
        {"data": "abc"},
        {"data": [1, 2]},
        {"data": None},
        {"data": bytearray(zlib.compress(np.zeros(3, "<i8").tobytes()))},
        {"data": b"not zlib at all"},
        {"data": zlib.compress(np.zeros(3, "<i8").tobytes())[:-3]},  # truncated stream
        {"data": zlib.compress(np.zeros(3, "<i8").tobytes()) + b"trailing"},
        {"data": zlib.compress(np.zeros(3, "<i8").tobytes()[:-1])},  # 23 bytes, not 24
        {"data": zlib.compress(np.zeros(4, "<i8").tobytes())},  # 32 bytes, not 24
        {"data": b""},
    ],
)
def test_int_column_rejects_malformed(change: dict[str, Any]) -> None:
    column = {**_good_column(), **change}
    with pytest.raises(FormatError, match="col"):
        decode_int_column(column, "col")


def test_int_column_rejects_wrong_expected_count_and_non_maps() -> None:
    with pytest.raises(FormatError, match="expected 4"):
        decode_int_column(_good_column(), "col", 4)
    for column in [None, [], "x", b"x", {"enc": "delta-zlib"}, {}]:
        with pytest.raises(FormatError):
            decode_int_column(column, "col")


def test_zlib_bomb_is_refused_without_inflating_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # 100 MB of zeros compress to ~100 KB; the column claims 10 values (80 bytes).
    packer = zlib.compressobj(9)
    chunk = bytes(1 << 20)
    bomb = b"".join(packer.compress(chunk) for _ in range(100)) + packer.flush()
    assert len(bomb) < 200_000
    calls: list[tuple[int, int]] = []
    real = zlib.decompressobj

    class Spy:
        def __init__(self) -> None:
            self._inner = real()

        def decompress(self, data: bytes, max_length: int = 0) -> bytes:
            out = self._inner.decompress(data, max_length)
            calls.append((max_length, len(out)))
            return out

        def __getattr__(self, name: str) -> Any:
            return getattr(self._inner, name)

    monkeypatch.setattr(columns.zlib, "decompressobj", Spy)
    with pytest.raises(FormatError, match="bomb"):
        decode_int_column({"enc": "delta-zlib", "n": 10, "data": bomb}, "bomb")
    assert calls
    for max_length, produced in calls:
        assert 0 < max_length <= 8 * 10 + 1  # 0 would mean "unbounded"
        assert produced <= max_length


@settings(max_examples=100, deadline=None)
@given(values=st.lists(st.integers(0, (1 << 32) - 1), max_size=200))
def test_u32_column_round_trip(values: list[int]) -> None:
    column = encode_u32_column(values)
    assert column["enc"] == "u32le"
    assert len(column["data"]) == 4 * len(values)
    decoded = decode_u32_column(column, "crc", len(values))
    assert decoded.dtype == np.uint32
    assert decoded.tolist() == values


def test_u32_column_rejects_malformed() -> None:
    good = encode_u32_column([1, 2, 3])
    for change in [
        {"data": good["data"][:-1]},
        {"data": good["data"] + b"\x00"},
        {"n": 4},
        {"enc": "delta-zlib"},
        {"data": "abcdabcdabcd"},
    ]:
        with pytest.raises(FormatError, match="crc"):
            decode_u32_column({**good, **change}, "crc")
    with pytest.raises(FormatError, match="crc"):
        decode_u32_column(good, "crc", 2)
    # A delta-zlib column is not a checksum column, and the reverse.
    with pytest.raises(FormatError):
        decode_int_column(good, "col")


# ============================================================================================ values


def same(a: object, b: object) -> bool:
    """Equality that also compares types (tuple vs list, bool vs int) and treats NaN as equal to NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        assert isinstance(b, float)
        if math.isnan(a):
            return math.isnan(b)
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    if isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple))
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        assert isinstance(b, dict)
        # Keys are str or int only, so equal key sets also have equal key types.
        return set(a) == set(b) and all(same(a[k], b[k]) for k in a)
    return a == b


keys = st.one_of(st.text(max_size=4), st.integers(I64_MIN, U64_MAX))
leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(I64_MIN, U64_MAX),
    st.sampled_from([I64_MIN, U64_MAX, 0, -1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.binary(max_size=8),
)
plain_values = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(keys, children, max_size=4),
    ),
    max_leaves=24,
)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(value=plain_values)
def test_plain_values_round_trip(value: object) -> None:
    check_plain(value, "v")
    back = unpack_value(pack_value(value), "v")
    assert same(back, value), (back, value)


def test_tuples_stay_tuples_and_lists_stay_lists() -> None:
    value = {"t": (1, [2, (3,)], ()), "l": [(), [], {}], 7: b"\x00\xff", "f": (math.inf, -math.inf, -0.0)}
    back = unpack_value(pack_value(value), "v")
    assert same(back, value)
    assert type(back["t"]) is tuple
    assert type(back["t"][1]) is list
    assert type(back["t"][1][1]) is tuple
    assert back[7] == b"\x00\xff"
    nan = unpack_value(pack_value(math.nan), "v")
    assert isinstance(nan, float)
    assert math.isnan(nan)


def _nest(depth: int, kind: type, leaf: object = 0) -> object:
    value = leaf
    for _ in range(depth):
        value = kind([value]) if kind is not dict else {"k": value}
    return value


@pytest.mark.parametrize("kind", [list, tuple, dict])
def test_nesting_up_to_the_limit_round_trips_and_beyond_is_refused(kind: type) -> None:
    # The leaf of `depth` nested containers sits at depth `depth`.
    deepest = _nest(MAX_DEPTH, kind)
    check_plain(deepest, "v")
    assert same(unpack_value(pack_value(deepest), "v"), deepest)
    too_deep = _nest(MAX_DEPTH + 1, kind)
    with pytest.raises(FormatError, match="deeper"):
        check_plain(too_deep, "v")
    with pytest.raises(FormatError):
        unpack_value(pack_value(too_deep), "v")


@pytest.mark.parametrize(
    "value",
    [
        object(),
        {1, 2},
        frozenset(),
        np.zeros(3),
        1 << 64,
        -(1 << 63) - 1,
        {1.5: 1},
        {(1,): 2},
        {True: 1},
        {None: 1},
        {b"k": 1},
        {1 << 64: 1},  # an int key msgpack cannot hold
        {-(1 << 63) - 1: 1},
        [1, [2, object()]],
        (1, {"a": {2, 3}}),
    ],
)
def test_check_plain_rejects(value: object) -> None:
    with pytest.raises(FormatError):
        check_plain(value, "obj")


@settings(max_examples=200, deadline=None)
@given(
    value=st.recursive(
        st.one_of(leaves, st.integers(-(1 << 70), 1 << 70)),
        lambda children: st.one_of(
            st.lists(children, max_size=3),
            st.lists(children, max_size=3).map(tuple),
            st.dictionaries(st.one_of(keys, st.integers(-(1 << 70), 1 << 70)), children, max_size=3),
        ),
        max_leaves=12,
    ),
    depth=st.integers(0, MAX_DEPTH + 2),
    kind=st.sampled_from([list, tuple, dict]),
)
def test_whatever_check_plain_accepts_round_trips(value: object, depth: int, kind: type) -> None:
    value = _nest(depth, kind, value)
    try:
        check_plain(value, "v")
    except FormatError:
        return
    assert same(unpack_value(pack_value(value), "v"), value)


def test_unpack_refuses_hostile_nesting() -> None:
    with pytest.raises(FormatError):
        unpack_value(b"\x91" * 100_000 + b"\xc0", "v")
    # Tuples inside tuples (extension payloads are decoded recursively) must stop at the depth limit too.
    data = pack_value(0)
    for _ in range(200):
        data = msgpack.packb(msgpack.ExtType(1, b"\x91" + data))
    with pytest.raises(FormatError):
        unpack_value(data, "v")
    # An extension whose payload is itself an extension, not an array.
    data = msgpack.packb(0)
    for _ in range(5000):
        data = msgpack.packb(msgpack.ExtType(1, data))
    with pytest.raises(FormatError):
        unpack_value(data, "v")


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # never used
        b"\x92\x01",  # truncated array
        b"\x01\x02",  # trailing data
        msgpack.packb(msgpack.ExtType(5, b"\x90")),  # unknown extension
        msgpack.packb(msgpack.ExtType(1, b"\x01")),  # tuple that does not hold an array
        msgpack.packb(msgpack.ExtType(1, b"\x92\x01")),  # tuple with a truncated array
        msgpack.packb(msgpack.Timestamp(1, 0)),
        b"\x81\x91\x01\x02",  # map with an array key
        b"\x81\xc4\x01k\x01",  # map with a bytes key
        b"\x81\xcb" + np.float64(1.5).tobytes()[::-1] + b"\x01",  # map with a float key
        b"\x81\xc3\x01",  # map with a bool key
        b"\xa2\xff\xfe",  # invalid UTF-8 string
    ],
)
def test_unpack_rejects_malformed(data: bytes) -> None:
    with pytest.raises(FormatError, match="where"):
        unpack_value(data, "where")


@settings(max_examples=500, deadline=None)
@given(data=st.binary(max_size=64))
def test_random_bytes_only_ever_raise_format_error(data: bytes) -> None:
    with contextlib.suppress(FormatError):
        unpack_value(data, "v")


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(value=plain_values, data=st.data())
def test_corrupted_values_only_ever_raise_format_error(value: object, data: st.DataObject) -> None:
    packed = bytearray(pack_value(value))
    for _ in range(data.draw(st.integers(1, 3))):
        if packed:
            packed[data.draw(st.integers(0, len(packed) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(packed)))
    with contextlib.suppress(FormatError):
        unpack_value(bytes(packed[:cut]), "v")


# ========================================================================================= manifests

ATTEMPT = "0123abcd"


def _table(file: list[int], offset: list[int], start: list[list[int]], length: list[list[int]], k: int) -> PieceTable:
    n = len(file)
    return PieceTable(
        np.array(file, dtype=np.int64),
        np.array(offset, dtype=np.int64),
        np.array(start, dtype=np.int64).reshape(n, k),
        np.array(length, dtype=np.int64).reshape(n, k),
    )


def sample_global_manifest() -> GlobalManifest:
    files = tuple(
        FileEntry(
            rank=r,
            data=layout.data_path(r, ATTEMPT),
            data_size=4096,
            index=layout.local_manifest_path(r, ATTEMPT),
            index_size=300 + r,
            index_crc32c=0xDEADBEEF - r,
        )
        for r in range(2)
    )
    tensors = (
        tensor_entry("w", "F32", (4, 3), "box", _table([0, 1], [64, 64], [[0, 0], [2, 0]], [[2, 3], [2, 3]], 2)),
        tensor_entry("z.flat", "I64", (10,), "flat", _table([1, 0], [200, 500], [[0], [4]], [[4], [6]], 1)),
        tensor_entry("s", "F64", (), "box", _table([0], [1000], [[]], [[]], 0)),
        tensor_entry("e", "BF16", (0, 4), "box", _table([], [], [], [], 2)),
        tensor_entry("t/3d", "U8", (2, 1, 5), "box", _table([1], [3000], [[0, 0, 0]], [[2, 1, 5]], 3)),
    )
    objects = (
        ObjectEntry("trainer", None, {"lr": 0.5, "betas": (0.9, 0.999), "sched": [1, (2, 3)]}),
        ObjectEntry("rng", 1, b"\x00\x01\x02"),
        ObjectEntry("rng", 0, b"\x03"),
    )
    return GlobalManifest(
        attempt=ATTEMPT,
        world_size=2,
        block_size=4096,
        files=files,
        tensors=tensors,
        objects=objects,
        step=1234,
        created=1.7e9 + 0.25,
        metadata={"user": {"run": "x", 3: [1.5, None]}},
    )


def assert_same_tensors(got: tuple[TensorEntry, ...], want: tuple[TensorEntry, ...]) -> None:
    assert [t.name for t in got] == [t.name for t in want]
    for a, b in zip(got, want):
        assert (a.dtype, a.shape, a.layout, a.pieces.count, a.pieces.k) == (
            b.dtype,
            b.shape,
            b.layout,
            b.pieces.count,
            b.pieces.k,
        )
        for x, y in zip(a.pieces.arrays(), b.pieces.arrays()):
            assert x.dtype == np.int64
            assert x.shape == y.shape
            np.testing.assert_array_equal(x, y)


def test_global_manifest_round_trip() -> None:
    manifest = sample_global_manifest()
    back = decode_global_manifest(encode_global_manifest(manifest))
    assert back.attempt == manifest.attempt
    assert back.world_size == manifest.world_size
    assert back.block_size == manifest.block_size
    assert back.files == manifest.files
    assert back.objects == manifest.objects
    assert type(back.objects[0].value["betas"]) is tuple
    assert back.step == manifest.step
    assert back.created == manifest.created
    assert back.metadata == manifest.metadata
    assert back.version == (1, 0)
    assert back.total_bytes == 2 * 4096
    assert_same_tensors(back.tensors, manifest.tensors)
    assert back.tensor("z.flat") is back.tensors[1]
    assert back.tensor("nope") is None
    # Re-encoding a decoded manifest gives the same bytes (lazy tables re-encode as they were stored).
    assert encode_global_manifest(back) == encode_global_manifest(manifest)


def sample_local_manifest() -> LocalManifest:
    specs = (
        TensorSpec("w", "F32", (2, 3), "box"),
        TensorSpec("s", "I64", (), "box"),
        TensorSpec("z", "U8", (5,), "flat"),
    )
    tensor = np.array([0, 1, 0, 2], dtype=np.int64)
    start = np.array([0, 0, 1, 0, 0], dtype=np.int64)  # k values per piece, back to back: 2, 0, 2, 1
    length = np.array([1, 3, 1, 3, 5], dtype=np.int64)
    nbytes = [12, 8, 12, 5]
    header = 16
    offset = np.array(np.cumsum([header, *nbytes])[:-1], dtype=np.int64)
    pieces = LocalPieces(specs, tensor, offset, start, length)
    block = 4096
    blocks = sum(-(-n // block) for n in nbytes)
    return LocalManifest(
        attempt=ATTEMPT,
        rank=1,
        world_size=3,
        data=layout.data_path(1, ATTEMPT),
        data_size=header + sum(nbytes),
        header_size=header,
        header_crc32c=12345,
        block_size=block,
        tensors=specs,
        pieces=pieces,
        crc32c=np.arange(blocks, dtype=np.uint32) * 7919,
        objects=(ObjectEntry("rng", 1, (1, 2)), ObjectEntry("cfg", None, {"a": [1]})),
        step=9,
    )


def test_local_manifest_round_trip() -> None:
    manifest = sample_local_manifest()
    back = decode_local_manifest(encode_local_manifest(manifest))
    for field in ["attempt", "rank", "world_size", "data", "data_size", "header_size", "header_crc32c"]:
        assert getattr(back, field) == getattr(manifest, field)
    assert back.block_size == manifest.block_size
    assert back.tensors == manifest.tensors
    assert back.objects == manifest.objects
    assert back.step == manifest.step
    assert back.version == (1, 0)
    np.testing.assert_array_equal(back.crc32c, manifest.crc32c)
    assert back.crc32c.dtype == np.uint32
    for field in ["tensor", "offset", "start", "length", "nbytes", "k", "position"]:
        np.testing.assert_array_equal(getattr(back.pieces, field), getattr(manifest.pieces, field))
    np.testing.assert_array_equal(back.pieces.nbytes, [12, 8, 12, 5])
    offset, start, length = back.pieces.of_tensor(0, 2)
    np.testing.assert_array_equal(offset, [16, 36])
    np.testing.assert_array_equal(start, [[0, 0], [1, 0]])
    np.testing.assert_array_equal(length, [[1, 3], [1, 3]])


@pytest.mark.parametrize("kind", [list, tuple, dict])
def test_object_values_as_deep_as_check_plain_allows_survive_both_manifests(kind: type) -> None:
    # check_plain is the writer's gate; a value it accepts must not make the manifest unreadable, although the
    # value sits a few levels down inside the manifest document.
    value = _nest(MAX_DEPTH, kind, (1, "x"))
    with pytest.raises(FormatError):
        check_plain(value, "v")
    value = _nest(MAX_DEPTH, kind)
    check_plain(value, "v")
    manifest = sample_global_manifest()
    manifest = GlobalManifest(
        attempt=manifest.attempt,
        world_size=manifest.world_size,
        block_size=manifest.block_size,
        files=manifest.files,
        tensors=manifest.tensors,
        objects=(ObjectEntry("deep", None, value),),
    )
    (entry,) = decode_global_manifest(encode_global_manifest(manifest)).objects
    assert same(entry.value, value)
    local = sample_local_manifest()
    local = LocalManifest(
        **{**{f: getattr(local, f) for f in local.__dataclass_fields__}, "objects": (ObjectEntry("deep", 1, value),)}
    )
    (entry,) = decode_local_manifest(encode_local_manifest(local)).objects
    assert same(entry.value, value)
    # One level more is refused by the reader as well.
    too_deep = ObjectEntry("deep", None, [value])
    with pytest.raises(FormatError, match="deeper"):
        decode_global_manifest(
            encode_global_manifest(
                GlobalManifest(manifest.attempt, 2, manifest.block_size, manifest.files, (), (too_deep,))
            )
        )


def test_commit_marker_round_trip_and_rejections() -> None:
    marker = CommitMarker(ATTEMPT, layout.global_manifest_path(ATTEMPT), 999, 42, 2, 8192, step=None, created=3.5)
    assert decode_commit_marker(encode_commit_marker(marker)) == marker
    good = encode_commit_marker(marker).decode()
    for bad in [
        good.replace('"manifest_size": 999', '"manifest_size": NaN'),
        good.replace(f"manifest-{ATTEMPT}", "manifest-other"),
        good.replace(f"manifest-{ATTEMPT}.msgpack", "../manifest.msgpack"),
        good.replace('"version": [\n  1,\n  0\n ]', '"version": [2, 0]'),
        good.replace('"world_size": 2', '"world_size": 0'),
        "[" * 100_000,
        "\xff",
        "",
        good.replace('"format"', '"must_understand": null, "format"'),
    ]:
        assert bad != good
        with pytest.raises(FormatError):
            decode_commit_marker(bad.encode("utf-8", "surrogatepass"))


# ------------------------------------------------------------------------------ mutated manifest documents

BAD_VALUES: list[Any] = [
    -1,
    0,
    1,
    7,
    I64_MIN,
    I64_MAX,
    U64_MAX,  # msgpack holds at most 64-bit ints, so 2**70 cannot even be encoded; these are the extremes
    1.5,
    math.nan,
    math.inf,
    True,
    False,
    None,
    "",
    "12",
    "x",
    "box",
    "F32",
    "../x",
    "/etc/passwd",
    "s3://b/k",
    "data/00000-abc.safetensors\x00",
    f"data/00000-{ATTEMPT}.safetensors",
    f"data/000000-{ATTEMPT}.safetensors",
    f"ranks/00001-{ATTEMPT}.msgpack",
    b"",
    b"\x00" * 9,
    [],
    [1],
    [2, 0],
    [1, 0],
    [1, 1],
    ["x"],
    [[1]],
    [{}],
    [-1, 5],
    [1 << 62, 4],
    {},
    {"x": 1},
    {"enc": "delta-zlib", "n": 1, "data": b"x"},
    {"enc": "delta-zlib", "n": 3, "data": zlib.compress(b"\xff" * 24)},
    {"enc": ["x"], "n": 1, "data": b""},
    {"enc": "u32le", "n": 1, "data": b"\x00" * 4},
    msgpack.ExtType(1, b"\x90"),
]

bad_values = st.one_of(
    st.sampled_from(BAD_VALUES).map(copy.deepcopy),  # fresh objects: edits must never alias each other
    st.integers(I64_MIN, U64_MAX),
    st.text(max_size=6),
    st.lists(st.integers(-3, 3), max_size=3),
)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix] if prefix else []
    if isinstance(node, dict):
        for key, child in node.items():
            found += _paths(child, (*prefix, key))
    elif isinstance(node, list):
        for index, child in enumerate(node):
            found += _paths(child, (*prefix, index))
    return found


def _parent(doc: Any, path: tuple[Any, ...]) -> Any:
    node = doc
    for key in path[:-1]:
        node = node[key]
    return node


@st.composite
def mutated(draw: st.DrawFn, document: dict[str, Any], list_keys: tuple[str, ...]) -> bytes:
    """A valid document with one to three hostile edits, re-encoded with plain msgpack."""
    doc = copy.deepcopy(document)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["replace", "replace", "replace", "delete", "insert", "duplicate"]))
        paths = _paths(doc)
        if kind == "replace" and paths:
            path = draw(st.sampled_from(paths))
            _parent(doc, path)[path[-1]] = draw(bad_values)
        elif kind == "delete" and paths:
            path = draw(st.sampled_from(paths))
            parent = _parent(doc, path)
            del parent[path[-1]]
        elif kind == "insert":
            key = draw(st.sampled_from(["must_understand", "metadata", "objects", "step", "created", "unknown"]))
            doc[key] = draw(st.one_of(bad_values, st.lists(bad_values, max_size=2)))
        elif kind == "duplicate":
            key = draw(st.sampled_from(list_keys))
            if isinstance(doc.get(key), list) and doc[key]:
                doc[key].append(copy.deepcopy(doc[key][draw(st.integers(0, len(doc[key]) - 1))]))
    return msgpack.packb(doc, use_bin_type=True)


def _raw(data: bytes) -> dict[str, Any]:
    document: dict[str, Any] = msgpack.unpackb(data, raw=False, strict_map_key=False)
    return document


GLOBAL_DOC = _raw(encode_global_manifest(sample_global_manifest()))
LOCAL_DOC = _raw(encode_local_manifest(sample_local_manifest()))


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(data=mutated(GLOBAL_DOC, ("tensors", "files", "objects")))
def test_mutated_global_manifests_only_raise_format_error(data: bytes) -> None:
    try:
        manifest = decode_global_manifest(data)
    except FormatError:
        return
    for entry in manifest.tensors:  # piece columns are decoded lazily: force them
        try:
            entry.pieces.arrays()
        except (FormatError, CoverageError) as error:  # CoverageError: more pieces claimed than elements
            assert repr(entry.name) in str(error)


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(data=mutated(LOCAL_DOC, ("objects",)))
def test_mutated_local_manifests_only_raise_format_error(data: bytes) -> None:
    with contextlib.suppress(FormatError):
        decode_local_manifest(data)


def _global_with(**changes: Any) -> bytes:
    doc = copy.deepcopy(GLOBAL_DOC)
    for key, value in changes.items():
        doc[key] = value
    return msgpack.packb(doc, use_bin_type=True)


def _file_with(field: str, value: Any) -> bytes:
    doc = copy.deepcopy(GLOBAL_DOC)
    doc["files"][0][field] = value
    return msgpack.packb(doc, use_bin_type=True)


def test_specific_global_manifest_mutations_are_refused() -> None:
    assert decode_global_manifest(_global_with()).attempt == ATTEMPT
    with pytest.raises(FormatError, match="not supported"):
        decode_global_manifest(_global_with(version=[2, 0]))
    assert decode_global_manifest(_global_with(version=[1, 7])).version == (1, 7)  # newer minor: readable
    with pytest.raises(FormatError, match="understand"):
        decode_global_manifest(_global_with(must_understand=["x"]))
    with pytest.raises(FormatError):
        decode_global_manifest(_global_with(must_understand=[[1]]))
    assert decode_global_manifest(_global_with(must_understand=[], unknown_key={"x": 1})).world_size == 2
    with pytest.raises(FormatError, match="must_understand"):  # SPEC 2: an array of strings, nil is not one
        decode_global_manifest(_global_with(must_understand=None))
    for bad in ["../x", "/etc/passwd", "s3://b/k", f"data/00000-{ATTEMPT}.safetensors\x00", "data/../data/x"]:
        with pytest.raises(FormatError):
            decode_global_manifest(_file_with("data", bad))
        with pytest.raises(FormatError):
            decode_global_manifest(_file_with("index", bad))
    with pytest.raises(FormatError):  # another rank's file
        decode_global_manifest(_file_with("data", layout.data_path(1, ATTEMPT)))
    with pytest.raises(FormatError):  # another attempt's file
        decode_global_manifest(_file_with("data", layout.data_path(0, "other")))
    for field, value in [("data_size", -1), ("data_size", 1 << 62), ("index_size", 0), ("index_crc32c", 1 << 32)]:
        with pytest.raises(FormatError, match=field):
            decode_global_manifest(_file_with(field, value))
    for key, value in [
        ("world_size", 0),
        ("world_size", 3),  # files list ranks 0, 1 only
        ("block_size", 4097),
        ("block_size", 1024),
        ("block_size", 1 << 30),
        ("attempt", "UPPER"),
        ("attempt", "other"),  # file names belong to another attempt
        ("step", 1 << 63),
        ("step", "7"),
        ("created", "yesterday"),
        ("created", True),
        ("metadata", [1]),
        ("format", "safetensors"),
        ("kind", "local"),
        ("objects", [{"name": "a", "rank": 5, "value": 1}]),
        ("objects", [{"name": "a", "value": 1}, {"name": "a", "rank": None, "value": 2}]),
        ("tensors", [GLOBAL_DOC["tensors"][0], GLOBAL_DOC["tensors"][0]]),  # duplicate names
    ]:
        with pytest.raises(FormatError):
            decode_global_manifest(_global_with(**{key: value}))


def _global_with_pieces(table: PieceTable, shape: tuple[int, ...] = (4, 3), layout_name: str = "box") -> GlobalManifest:
    manifest = sample_global_manifest()
    entry = TensorEntry("bad.tensor", "F32", shape, layout_name, table)
    return decode_global_manifest(
        encode_global_manifest(
            GlobalManifest(
                attempt=manifest.attempt,
                world_size=manifest.world_size,
                block_size=manifest.block_size,
                files=manifest.files,
                tensors=(*manifest.tensors, entry),
            )
        )
    )


@pytest.mark.parametrize(
    ("table", "shape", "layout_name"),
    [
        (_table([0], [0], [[0, 1]], [[4, 3]], 2), (4, 3), "box"),  # past the shape in dim 1
        (_table([0], [0], [[4, 0]], [[1, 3]], 2), (4, 3), "box"),  # starts at the end
        (_table([0], [0], [[-1, 0]], [[1, 3]], 2), (4, 3), "box"),  # negative start
        (_table([0], [0], [[0, 0]], [[0, 3]], 2), (4, 3), "box"),  # empty piece
        (_table([0], [0], [[0, 0]], [[1 << 62, 3]], 2), (4, 3), "box"),  # huge length
        (_table([0], [4096 - 47], [[0, 0]], [[4, 3]], 2), (4, 3), "box"),  # 48 bytes past the file end by 1
        (_table([0], [-8], [[0, 0]], [[4, 3]], 2), (4, 3), "box"),  # negative offset
        (_table([0], [1 << 62], [[0, 0]], [[4, 3]], 2), (4, 3), "box"),  # offset far past the file
        (_table([2], [0], [[0, 0]], [[4, 3]], 2), (4, 3), "box"),  # no file 2
        (_table([-1], [0], [[0, 0]], [[4, 3]], 2), (4, 3), "box"),  # negative file index
        (_table([0], [0], [[0]], [[13]], 1), (4, 3), "flat"),  # past numel
        (_table([0], [0], [[12]], [[1]], 1), (4, 3), "flat"),
    ],
)
def test_lazy_piece_columns_are_range_checked_on_first_use(
    table: PieceTable, shape: tuple[int, ...], layout_name: str
) -> None:
    manifest = _global_with_pieces(table, shape, layout_name)  # decoding itself is lazy: no error yet
    entry = manifest.tensor("bad.tensor")
    assert entry is not None
    with pytest.raises(FormatError, match="'bad.tensor'"):
        entry.pieces.arrays()
    # The good tensors of the same manifest still decode.
    assert_same_tensors(manifest.tensors[:-1], sample_global_manifest().tensors)


def test_lazy_piece_columns_with_a_wrong_count() -> None:
    doc = copy.deepcopy(GLOBAL_DOC)
    doc["tensors"][0]["pieces"]["count"] = 3
    manifest = decode_global_manifest(msgpack.packb(doc, use_bin_type=True))
    with pytest.raises(FormatError, match="'w'"):
        manifest.tensors[0].pieces.arrays()
    doc["tensors"][3]["pieces"]["count"] = 1  # a tensor without elements cannot hold pieces
    with pytest.raises(FormatError, match="'e'"):
        decode_global_manifest(msgpack.packb(doc, use_bin_type=True))


def test_manifests_of_the_wrong_kind_or_too_big_are_refused() -> None:
    with pytest.raises(FormatError):
        decode_global_manifest(encode_local_manifest(sample_local_manifest()))
    with pytest.raises(FormatError):
        decode_local_manifest(encode_global_manifest(sample_global_manifest()))
    with pytest.raises(FormatError):
        decode_global_manifest(msgpack.packb([1, 2]))
    with pytest.raises(FormatError):
        decode_global_manifest(b"\x00" * 10)


# ============================================================================================ layout


def test_layout_names_round_trip() -> None:
    for rank in [0, 7, 99999, 123456, (1 << 24) - 1]:
        assert layout.parse_data_path(layout.data_path(rank, ATTEMPT)) == (rank, ATTEMPT)
        assert layout.parse_local_manifest_path(layout.local_manifest_path(rank, ATTEMPT)) == (rank, ATTEMPT)
    assert layout.data_path(3, "abc") == "data/00003-abc.safetensors"
    assert layout.local_manifest_path(3, "abc") == "ranks/00003-abc.msgpack"
    assert layout.global_manifest_path("abc") == "manifest-abc.msgpack"
    assert layout.parse_global_manifest_path("manifest-abc.msgpack") == "abc"
    attempt = layout.new_attempt()
    assert layout.validate_attempt(attempt) == attempt
    assert attempt != layout.new_attempt()


PARSERS = {
    "data": (layout.parse_data_path, lambda r, a: layout.data_path(r, a)),
    "local": (layout.parse_local_manifest_path, lambda r, a: layout.local_manifest_path(r, a)),
    "global": (layout.parse_global_manifest_path, lambda r, a: layout.global_manifest_path(a)),
}


@pytest.mark.parametrize("kind", sorted(PARSERS))
def test_layout_parsers_accept_only_their_own_names(kind: str) -> None:
    parse, make = PARSERS[kind]
    parse(make(1, ATTEMPT))
    for other, (_, other_make) in PARSERS.items():
        if other != kind:
            with pytest.raises(FormatError):
                parse(other_make(1, ATTEMPT))
    own = make(1, ATTEMPT)
    for bad in [
        "",
        "../" + own,
        "/" + own,
        "./" + own,
        "s3://bucket/" + own,
        own + "\x00",
        own + "\n",
        own + "/",
        own.upper(),
        own.replace("/", "\\"),
        own.replace("/", "//"),
        own.replace(ATTEMPT, ATTEMPT.upper()),
        own.replace(ATTEMPT, "a" * 33),
        own.replace(ATTEMPT, ""),
        own.replace(ATTEMPT, "ab-c"),
        own.replace("00001", "\u0661" * 5),  # Arabic-Indic digits are not ASCII digits
        own.replace("00001", "000001"),  # rank not written as {rank:05d}
        own.replace("00001", "1"),
        None,
        1,
        b"data/00001-x.safetensors",
        "x" * 600,
    ]:
        if bad == own:
            continue
        with pytest.raises(FormatError):
            parse(bad)


@settings(max_examples=300, deadline=None)
@given(
    path=st.one_of(
        st.from_regex(r"(data|ranks)/[0-9\u0660-\u0669]{4,9}-[0-9a-zA-Z.]{0,4}\.(safetensors|msgpack)", fullmatch=True),
        st.from_regex(r"manifest-[0-9a-z/.]{0,5}\.msgpack", fullmatch=True),
        st.text(max_size=40),
    )
)
def test_every_accepted_path_is_exactly_the_name_the_writer_would_produce(path: str) -> None:
    for parse, make in PARSERS.values():
        try:
            parsed = parse(path)
        except FormatError:
            continue
        rank, attempt = parsed if isinstance(parsed, tuple) else (0, parsed)
        assert make(rank, attempt) == path


@pytest.mark.parametrize("attempt", ["", "A", "a" * 33, "ab-c", "ab/c", "..", "a b", None, 5, "\u00e9"])
def test_validate_attempt_rejects(attempt: object) -> None:
    with pytest.raises(FormatError):
        layout.validate_attempt(attempt)
    if isinstance(attempt, str):
        with pytest.raises(FormatError):
            layout.data_path(0, attempt)


def _outcome(run) -> tuple[str, str] | None:
    try:
        run()
    except Exception as exc:  # the comparison is of whatever either path raises
        return type(exc).__name__, str(exc)
    return None


@pytest.mark.slow
@settings(max_examples=600, deadline=None)
@given(data=st.data())
def test_piece_range_checks_for_few_pieces_match_the_array_path(data) -> None:
    """The plain-integer checks used for a handful of pieces accept and refuse exactly what the numpy checks do,
    with the same message. Tables are drawn valid, at their edges, then maybe broken in one value."""
    layout = data.draw(st.sampled_from(["box", "flat"]))
    shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=0, max_size=3)))
    extents = [math.prod(shape)] if layout == "flat" else list(shape)
    count = data.draw(st.integers(1, 5))
    file_sizes = data.draw(st.lists(st.integers(0, 300), min_size=1, max_size=3))
    file, offset, start, length = [], [], [], []
    for _ in range(count):
        starts = [data.draw(st.integers(0, extent - 1)) for extent in extents]
        lengths = [data.draw(st.integers(1, extent - at)) for at, extent in zip(starts, extents)]
        index = data.draw(st.integers(0, len(file_sizes) - 1))
        room = file_sizes[index] - math.prod(lengths) * 4
        file.append(index)
        offset.append(data.draw(st.sampled_from([0, room, room + 1, max(room - 1, 0)])))
        start.append(starts)
        length.append(lengths)
    columns_ = {"file": file, "offset": offset, "start": start, "length": length}
    if data.draw(st.booleans()):  # break one value
        name = data.draw(st.sampled_from(sorted(columns_)))
        piece = data.draw(st.integers(0, count - 1))
        value = data.draw(st.integers(-2, 320))
        if name in ("start", "length"):
            if extents:
                columns_[name][piece][data.draw(st.integers(0, len(extents) - 1))] = value
        else:
            columns_[name][piece] = value
    k = len(extents)
    arrays = (
        np.array(columns_["file"], dtype=np.int64),
        np.array(columns_["offset"], dtype=np.int64),
        np.array(columns_["start"], dtype=np.int64).reshape(count, k),
        np.array(columns_["length"], dtype=np.int64).reshape(count, k),
    )
    check = manifest_module._PieceCheck("t", shape, layout, 4, file_sizes)
    few = _outcome(lambda: check._check_few(*(a.tolist() for a in arrays)))
    saved = piece_columns.SCAN_PIECES
    piece_columns.SCAN_PIECES = -1  # every table through the numpy path
    try:
        many = _outcome(lambda: check(*arrays))
    finally:
        piece_columns.SCAN_PIECES = saved
    assert few == many
    # A decoded manifest's path: columns shared between its tables, checks made once per distinct column. Twice,
    # so the second table of the same columns takes the shared verdicts (a refusal is never remembered as a pass).
    encoded = {
        "file": encode_int_column(arrays[0]),
        "offset": encode_int_column(arrays[1]),
        "start": encode_int_column(arrays[2].T.reshape(-1)),
        "length": encode_int_column(arrays[3].T.reshape(-1)),
    }
    shared = piece_columns.SharedColumns(file_sizes)
    for _ in range(2):
        table = piece_columns.PieceCheck("t", shape, layout, 4, shared)
        assert _outcome(lambda table=table: table.decode(encoded, count, k)) == few


def test_a_value_of_shared_lists_is_refused_without_walking_every_path(monkeypatch) -> None:
    """x = [y, y] nested 60 deep is 2^60 items as a tree: refused after the item budget, not walked."""
    from shardckpt.format import values
    from shardckpt.format.values import check_plain

    MAX_VALUE_ITEMS = 100_000  # the real bound (2^24) behaves the same, in seconds rather than milliseconds
    monkeypatch.setattr(values, "MAX_VALUE_ITEMS", MAX_VALUE_ITEMS)

    shared: list[object] = [0]
    for _ in range(60):
        shared = [shared, shared]
    with pytest.raises(FormatError, match=f"more than {MAX_VALUE_ITEMS} items"):
        check_plain(shared, "trainer")
    small: list[object] = [0]
    for _ in range(10):
        small = [small, small]
    check_plain(small, "trainer")  # 2^11 items: fine


_PLAIN_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 63), (1 << 64) - 1),
    st.floats(allow_nan=False),
    st.text(max_size=4),
    st.binary(max_size=4),
)
_PLAIN_VALUES = st.recursive(
    _PLAIN_LEAVES,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.one_of(st.text(max_size=3), st.integers(-3, 3)), inner, max_size=4),
    ),
    max_leaves=20,
)


def _decoded(data: bytes, proving: bool) -> tuple[str, Any]:
    from shardckpt.format import values

    try:
        return "value", values._unpack(data, "v", 0, None, proving=proving)
    except FormatError as exc:
        return "error", str(exc)


@settings(max_examples=150, deadline=None)
@given(value=_PLAIN_VALUES, cut=st.integers(0, 64), byte=st.integers(0, 255))
def test_repeated_key_proof_and_map_by_map_decoding_agree(value: Any, cut: int, byte: int) -> None:
    """The decoding that proves "no repeated key" by packing back (no Python call per map) gives the value or the
    error the map-by-map decoding gives, on writer output and on that output with one byte changed."""
    data = pack_value(value)
    assert same(_decoded(data, True)[1], value)
    changed = data[:cut] + bytes([byte]) + data[cut + 1 :] if cut < len(data) else data + bytes([byte])
    proven, checked = _decoded(changed, True), _decoded(changed, False)
    assert proven[0] == checked[0] and (same(proven[1], checked[1]) if proven[0] == "value" else proven == checked)


@pytest.mark.parametrize(
    "data",
    [
        b"\x82\xa1a\x01\xa1a\x02",  # {"a": 1, "a": 2}: packs back shorter
        b"\x82\xd9\x01a\x01\xa1a\x02",  # the same with a non-canonical str8 key: the proof fails, maps are checked
        b"\x91\x82\xa1k\xc0\xa1k\xc0",  # a repeated key one level down
        b"\xc7\x06\x01\x91\x82\x01\x01\x01\x02",  # inside a tuple extension: [{1: 1, 1: 2}] as a tuple
    ],
)
def test_a_repeated_key_is_refused_whatever_its_encoding(data: bytes) -> None:
    """By the proving decoding (whose proof fails) and by the map-by-map one alike, with the same message."""
    proven, checked = _decoded(data, True), _decoded(data, False)
    assert proven == checked and proven[0] == "error" and "appears twice" in proven[1]


def test_a_non_canonical_encoding_without_repeated_keys_decodes() -> None:
    """Another writer's encoding (str8 for a short text, int64 for a small int) fails the proof, decodes map by map."""
    data = b"\x81\xd9\x01a\xd3\x00\x00\x00\x00\x00\x00\x00\x07"
    assert _decoded(data, True) == _decoded(data, False) == ("value", {"a": 7})
