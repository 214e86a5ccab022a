"""Hostile manifests through the whole open+read path of a real checkpoint, and the decoders' time and memory bounds.

A hostile writer rewrites COMMITTED, the global manifest or a local manifest and fixes the size/CRC32C chain above
it, so that the decoders (not a checksum) face the edit. Whatever the edit, opening and reading every tensor either
returns the original bytes or raises FormatError, CoverageError, IntegrityError or NotFoundError; only files the
layout names inside the checkpoint are touched, and only read. (tests/format/test_format_codecs.py feeds the decoders
mutated documents on their own; tests/fuzz.py is the long-running fuzzer, smoke-tested here.)
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tracemalloc
import zlib
from pathlib import Path
from typing import Any

import crc32c
import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import shardckpt
from shardckpt.errors import CoverageError, FormatError, IntegrityError, NotFoundError
from shardckpt.format import columns, layout
from shardckpt.format.local_manifest import decode_local_manifest
from shardckpt.format.manifest import decode_commit_marker, decode_global_manifest
from shardckpt.ops.verify import verify
from shardckpt.planner import check_cover
from shardckpt.storage import LocalStorage
from shardckpt.testing.faults import FaultyStorage
from tests.helpers.checkpoints import sample_state, save_sharded

ALLOWED = (FormatError, CoverageError, IntegrityError, NotFoundError)
READ_ONLY = {"read_range", "size", "exists", "list", "modified"}
ATTEMPT = "hostile1"
INTS = [-1, 0, 1, 3, 2**31, 2**32, 2**26, 2**26 + 1, 2**40, 2**62 - 1, 2**62, 2**63 - 1, -(2**63), 2**64 - 1]
PATHS = [
    "../x",
    "../../../etc/passwd",
    "/etc/passwd",
    "s3://bucket/key",
    "file:///etc/passwd",
    "data/../../x",
    "data/./00000-hostile1.safetensors",
    f"data/00000-{ATTEMPT}.safetensors\x00.txt",
    "C:\\Windows\\x",
    "..",
    "",
    "x" * 600,
    f"data/00001-{ATTEMPT}.safetensors",  # another rank's file
    f"ranks/00000-{ATTEMPT}.msgpack",  # a file of another kind
    "data/00000-other.safetensors",  # another attempt's
]
SHAPES = [[2**62 - 1, 2**62 - 1], [2**31] * 3, [-1], [2**63 - 1], [0, 2**62 - 1], [1] * 65, ["1"], [1.5], [True], []]
NAMES = ["a\x00b", "", "x" * 1025, "w", b"\xff\xfe", 7]


def _pack(document: Any) -> bytes:
    return bytes(msgpack.packb(document, use_bin_type=True))


def _unpack(raw: bytes) -> Any:
    return msgpack.unpackb(raw, raw=False, strict_map_key=False, ext_hook=msgpack.ExtType)


def _column(values: list[int], n: int | None = None) -> dict[str, Any]:
    array = np.array([v - 2**64 if v >= 2**63 else v for v in values], dtype=np.int64)  # 2**64-1 wraps to -1
    deltas = np.diff(array, prepend=np.int64(0)) if array.size else array
    data = zlib.compress(deltas.astype("<i8").tobytes())
    return {"enc": "delta-zlib", "n": len(values) if n is None else n, "data": data}


class Chain:
    """A checkpoint whose documents are rewritten with the size/CRC32C chain above each one fixed."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.global_path = root / layout.global_manifest_path(ATTEMPT)

    def local(self, rank: int) -> Any:
        return _unpack((self.root / layout.local_manifest_path(rank, ATTEMPT)).read_bytes())

    def global_(self) -> Any:
        return _unpack(self.global_path.read_bytes())

    def committed(self) -> Any:
        return json.loads((self.root / layout.COMMITTED).read_text())

    def write_local(self, rank: int, document: Any) -> None:
        raw = _pack(document)
        (self.root / layout.local_manifest_path(rank, ATTEMPT)).write_bytes(raw)
        manifest = self.global_()
        for entry in manifest["files"]:
            if isinstance(entry, dict) and entry.get("rank") == rank:
                entry["index_size"], entry["index_crc32c"] = len(raw), crc32c.crc32c(raw)
        self.write_global(manifest)

    def write_global(self, document: Any) -> None:
        raw = _pack(document)
        self.global_path.write_bytes(raw)
        marker = self.committed()
        marker["manifest_size"], marker["manifest_crc32c"] = len(raw), crc32c.crc32c(raw)
        self.write_committed(marker)

    def write_committed(self, document: Any) -> None:
        (self.root / layout.COMMITTED).write_text(json.dumps(document))


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hostile") / "ck"
    save_sharded(sample_state(), str(root), 2, attempt=ATTEMPT, block_size=4096, flat=("i",))
    return root


# -------------------------------------------------------------------------------------- hostile edits

ints = st.sampled_from(INTS)


def _pick(draw: Any, items: list[Any]) -> Any:
    return items[draw(st.integers(0, len(items) - 1))] if items else None


def edit_global(doc: Any, draw: Any) -> None:
    kind = draw(st.sampled_from(["path", "file_int", "shape", "count", "column", "name", "dup", "top", "meta"]))
    tensor = _pick(draw, doc["tensors"])
    entry = _pick(draw, doc["files"])
    if kind == "path":
        entry[draw(st.sampled_from(["data", "index"]))] = draw(st.sampled_from(PATHS))
    elif kind == "file_int":
        entry[draw(st.sampled_from(["data_size", "index_size", "rank"]))] = draw(ints)
    elif kind == "shape":
        tensor["shape"] = draw(st.sampled_from(SHAPES))
    elif kind == "count":
        tensor["pieces"]["count"] = draw(ints)
    elif kind == "column":
        count, k = tensor["pieces"]["count"], 1 if tensor["layout"] == "flat" else len(tensor["shape"])
        field = draw(st.sampled_from(["file", "offset", "start", "length"]))
        n = count if field in ("file", "offset") else count * k
        values = draw(st.lists(ints, min_size=n, max_size=n)) if n < 64 else [draw(ints)] * n
        tensor["pieces"][field] = _column(values, draw(st.sampled_from([n, n, n + 1, 2**28, 2**28 + 1])))
    elif kind == "name":
        tensor["name"] = draw(st.sampled_from(NAMES))
    elif kind == "dup":
        key = draw(st.sampled_from(["tensors", "files", "objects"]))
        doc[key].append(copy.deepcopy(_pick(draw, doc[key])))
    elif kind == "top":
        key = draw(st.sampled_from(["world_size", "block_size", "step", "version", "must_understand", "attempt"]))
        doc[key] = draw(st.one_of(ints, st.sampled_from([[2, 0], [1, 65536], ["x"], "../x", [[1]], None])))
    else:
        nested: Any = 1
        for _ in range(draw(st.sampled_from([60, 64, 65, 500]))):
            nested = [nested]
        doc[draw(st.sampled_from(["metadata", "objects"]))] = {"deep": nested} if draw(st.booleans()) else nested


def edit_local(doc: Any, draw: Any) -> None:
    kind = draw(st.sampled_from(["path", "int", "table", "pieces", "crc"]))
    if kind == "path":
        doc["data"] = draw(st.sampled_from(PATHS))
    elif kind == "int":
        doc[draw(st.sampled_from(["data_size", "header_size", "block_size", "rank", "world_size"]))] = draw(ints)
    elif kind == "table":
        table = doc["tensors"]
        field = draw(st.sampled_from(["count", "names", "ndim", "shape"]))
        if field == "count":
            table["count"] = draw(ints)
        elif field == "names":
            table["names"] = draw(st.sampled_from(["a\x00a" + "\x00x" * (table["count"] - 2), "\x00" * 3, "a"]))
        else:
            n = table[field]["n"]
            table[field] = _column([draw(ints) for _ in range(min(n, 8))] + [0] * max(0, n - 8))
    elif kind == "pieces":
        pieces = doc["pieces"]
        field = draw(st.sampled_from(["count", "tensor", "offset", "start", "length"]))
        if field == "count":
            pieces["count"] = draw(ints)
        else:
            n = pieces[field]["n"]
            values = [draw(ints) for _ in range(min(n, 8))] + [0] * max(0, n - 8)
            pieces[field] = _column(values)
    else:
        n = draw(ints)
        doc["crc32c"] = {"enc": "u32le", "n": n, "data": bytes(4 * max(0, min(n, 64)))}


def edit_committed(doc: Any, draw: Any) -> None:
    key = draw(st.sampled_from(["manifest", "manifest_size", "attempt", "version", "world_size", "step"]))
    if key == "manifest":
        doc[key] = draw(st.sampled_from(PATHS + [layout.global_manifest_path("other")]))
    else:
        doc[key] = draw(st.one_of(ints, st.sampled_from([[2, 0], "x", None, [1, 0, 0], "../x"])))


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    target=st.sampled_from(["local0", "local1", "global", "committed"]),
    edits=st.data(),
)
def test_hostile_documents_through_open_and_read(original: Path, tmp_path_factory, target: str, edits) -> None:
    root = tmp_path_factory.mktemp("case") / "ck"
    shutil.copytree(original, root)
    outside = root.parent / "outside.txt"
    outside.write_text("must stay as it is")
    chain = Chain(root)
    if target.startswith("local"):
        rank = int(target[-1])
        document = chain.local(rank)
        edit_local(document, edits.draw)
        chain.write_local(rank, document)
    elif target == "global":
        document = chain.global_()
        edit_global(document, edits.draw)
        chain.write_global(document)
    else:
        document = chain.committed()
        edit_committed(document, edits.draw)
        chain.write_committed(document)

    storage = FaultyStorage(LocalStorage(str(root)))
    failed = None
    try:
        checkpoint = shardckpt.open(storage)
        expected = sample_state()
        for name in checkpoint.tensors:
            assert torch.equal(checkpoint.read(name), expected[name]), f"{name} read back other bytes"
    except ALLOWED as exc:
        failed = exc
    event(f"{target}: {type(failed).__name__ if failed else 'read back intact'}")
    for op, path in storage.calls:
        assert op in READ_ONLY, (op, path)
        _assert_layout_path(root, path)
    report = verify(storage)  # verify collects problems; it must not raise either
    if failed is not None:
        assert not report.ok, f"load failed ({failed}) but verify found nothing"
    for op, path in storage.calls:
        assert op in READ_ONLY, (op, path)
        _assert_layout_path(root, path)
    assert outside.read_text() == "must stay as it is"


def _assert_layout_path(root: Path, path: str) -> None:
    """`path` is a name the layout gives (any attempt, any rank, a successor marker of SPEC 14.2) and resolves inside
    the checkpoint."""
    if path not in ("", layout.RANKS_DIR, layout.DATA_DIR) and layout.marker_generation(path) is None:
        parsers = (layout.parse_data_path, layout.parse_local_manifest_path, layout.parse_global_manifest_path)
        for parse in parsers:
            try:
                parse(path)
                break
            except FormatError:
                continue
        else:
            raise AssertionError(f"touched {path!r}, which the layout does not name")
    resolved = os.path.realpath(os.path.join(root, path))
    assert os.path.commonpath([resolved, os.path.realpath(root)]) == os.path.realpath(root), path


# ----------------------------------------------------------------------------- claims that must cost nothing


def _bounded(call: Any, *, mib: float = 32) -> BaseException:
    """Run `call`, which must raise an allowed error within `mib` of Python/numpy allocations (a bound on work
    that, unlike a time limit, does not depend on the machine's load)."""
    tracemalloc.start()
    try:
        call()
    except ALLOWED as exc:
        error: BaseException = exc
    else:
        raise AssertionError("no error raised")
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < mib * 2**20, f"peak {peak / 2**20:.0f} MiB"
    return error


def _global_doc(original: Path) -> Any:
    return Chain(original).global_()


def test_a_billion_pieces_claimed_is_refused_before_anything_is_inflated(original: Path) -> None:
    for count in (2**26 + 1, 2**30, 2**40, 2**63 - 1):
        doc = _global_doc(original)
        doc["tensors"][0]["pieces"]["count"] = count
        _bounded(lambda doc=doc: decode_global_manifest(_pack(doc)))
    # Within the limit but more pieces than elements: refused before any column is decoded (they would overlap).
    doc = _global_doc(original)
    entry = next(t for t in doc["tensors"] if t["name"] == "w")  # 37 x 11 = 407 elements
    bomb = zlib.compress(bytes(8 * 2**22), 9)  # 4 Mi zero deltas: 32 MiB inflated, 32 KiB stored
    claimed = {"count": 2**22}
    claimed.update({f: {"enc": "delta-zlib", "n": 2**22, "data": bomb} for f in ("file", "offset")})
    claimed.update({f: {"enc": "delta-zlib", "n": 2**23, "data": bomb} for f in ("start", "length")})
    entry["pieces"] = claimed
    manifest = decode_global_manifest(_pack(doc))
    tensor = manifest.tensor("w")
    assert tensor is not None
    error = _bounded(lambda: tensor.pieces.arrays(), mib=4)
    assert isinstance(error, CoverageError) and "4194304 pieces for 407" in str(error)


def test_a_local_manifest_cannot_claim_more_pieces_than_it_stores_checksums_for(original: Path) -> None:
    document = Chain(original).local(0)
    bomb = zlib.compress(bytes(8 * 2**24), 9)  # 128 MiB of zeros in 128 KiB
    claimed: dict[str, Any] = {"count": 2**24}
    claimed.update({f: {"enc": "delta-zlib", "n": 2**24, "data": bomb} for f in ("tensor", "offset")})
    document["pieces"] = claimed
    error = _bounded(lambda: decode_local_manifest(_pack(document)), mib=8)
    assert "block checksums" in str(error)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("shape", [2**62 - 1, 2**62 - 1]),  # the product overflows int64
        ("shape", [2**31, 2**31, 2**31]),
        ("shape", [2**61, 4]),  # numel fits, numel * itemsize (F32) does not
        ("shape", [-1, 11]),
        ("shape", [1] * 65),
        ("name", "w\x00x"),
        ("name", "x" * 1025),
        ("dtype", "F128"),
        ("layout", "../box"),
    ],
)
def test_hostile_tensor_entries_are_refused_cheaply(original: Path, field: str, value: Any) -> None:
    doc = _global_doc(original)
    doc["tensors"][0][field] = value
    error = _bounded(lambda: decode_global_manifest(_pack(doc)))
    assert isinstance(error, FormatError)


def test_offsets_and_strides_that_would_overflow_are_refused(original: Path) -> None:
    """A piece at the far end of a huge tensor: start + length and offset + bytes must not wrap around int64."""
    doc = _global_doc(original)
    entry = next(t for t in doc["tensors"] if t["name"] == "w")
    entry["shape"] = [2**59, 1]  # F32: 2**61 bytes, under the 2**62 - 1 limit
    entry["pieces"] = {
        "count": 1,
        "file": _column([0]),
        "offset": _column([2**63 - 8]),
        "start": _column([2**59 - 1, 0]),
        "length": _column([1, 1]),
    }
    manifest = decode_global_manifest(_pack(doc))
    tensor = manifest.tensor("w")
    assert tensor is not None
    error = _bounded(lambda: tensor.pieces.arrays())
    assert isinstance(error, FormatError) and "outside its data file" in str(error)
    entry["pieces"]["offset"] = _column([8])
    entry["pieces"]["length"] = _column([2**62, 1])  # past the shape, and its byte size would overflow
    tensor = decode_global_manifest(_pack(doc)).tensor("w")
    assert tensor is not None
    assert isinstance(_bounded(lambda: tensor.pieces.arrays()), FormatError)


def test_hostile_commit_markers(original: Path) -> None:
    good = json.loads((original / layout.COMMITTED).read_text())
    for key, value in [
        ("manifest", "../manifest-hostile1.msgpack"),
        ("manifest", "/tmp/manifest-hostile1.msgpack"),
        ("manifest", "s3://b/manifest-hostile1.msgpack"),
        ("manifest", "manifest-hostile1.msgpack\x00"),
        ("manifest_size", 2**30 + 1),
        ("manifest_size", -1),
        ("version", [2, 0]),
        ("version", [1, 65536]),
        ("world_size", 2**24 + 1),
        ("must_understand", ["x"]),
    ]:
        raw = json.dumps({**good, key: value}).encode()
        _bounded(lambda raw=raw: decode_commit_marker(raw))
    _bounded(lambda: decode_commit_marker(b"[" * 60_000))
    _bounded(lambda: decode_commit_marker(b'{"a": ' * 10_000))


def test_overlapping_pieces_are_refused_in_time_proportional_to_the_grid_not_pieces_times_grid() -> None:
    """20,000 copies of one 1024 x 1024-cell region over a diagonal: counting every piece's cells took 6 s."""
    side, copies = 1024, 20_000
    diagonal = np.arange(side, dtype=np.int64)
    start = np.concatenate([np.zeros((copies, 2), np.int64), np.stack([diagonal, diagonal], 1)])
    length = np.concatenate([np.full((copies, 2), side, np.int64), np.ones((side, 2), np.int64)])
    with pytest.raises(CoverageError, match="overlap"):
        check_cover("t", (2**30, 2**30), "box", start, length)


def test_an_irregular_tiling_beyond_the_counting_bound_is_checked_in_bounded_time() -> None:
    """5,000 columns, each cut at its own row: a valid cover of 10,000 pieces whose boundary grid has 25 M cells."""
    columns_, side = 5000, 2**20
    cuts = np.random.default_rng(0).choice(np.arange(1, side), columns_, replace=False)
    edges = np.linspace(0, side, columns_ + 1).astype(np.int64)
    start, length = [], []
    for c in range(columns_):
        width = int(edges[c + 1] - edges[c])
        start += [(0, edges[c]), (cuts[c], edges[c])]
        length += [(cuts[c], width), (side - cuts[c], width)]
    start_array, length_array = np.array(start, np.int64), np.array(length, np.int64)
    check_cover("t", (side, side), "box", start_array, length_array)
    length_array[7, 0] -= 1  # a one-row gap under piece 7
    with pytest.raises(CoverageError, match=r"elements \[\d+:\d+, \d+:\d+\] are covered by no piece \(gap\)"):
        check_cover("t", (side, side), "box", start_array, length_array)


def test_the_zlib_bound_holds_for_columns_in_a_real_manifest(original: Path, monkeypatch) -> None:
    calls: list[int] = []
    real = columns.zlib.decompressobj

    class Spy:
        def __init__(self) -> None:
            self.inner = real()

        def decompress(self, data: bytes, max_length: int = 0) -> bytes:
            calls.append(max_length)
            return self.inner.decompress(data, max_length)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    monkeypatch.setattr(columns.zlib, "decompressobj", Spy)
    shardckpt.open(str(original)).read("w")
    assert calls and all(0 < limit < 2**20 for limit in calls)  # never unbounded (0), never the claimed maximum


@pytest.mark.slow
def test_the_fuzzer_runs_and_finds_nothing(tmp_path) -> None:
    from fuzz import main as fuzz_main

    assert fuzz_main(["--seconds", "4", "--crash-dir", str(tmp_path / "crashes"), "--memory-mib", "0"]) == 0
    assert not (tmp_path / "crashes").exists()


def test_an_empty_tensor_whose_global_entry_disagrees_with_its_declaration_is_refused(original: Path, tmp_path) -> None:
    """Found by the test above: an empty tensor has no piece to cross-check, so its declaring rank is checked."""
    root = tmp_path / "ck"
    shutil.copytree(original, root)
    chain = Chain(root)
    document = chain.global_()
    (empty,) = [t for t in document["tensors"] if t["name"] == "e"]
    empty["shape"] = [0, 2**62 - 1]
    chain.write_global(document)
    with pytest.raises(IntegrityError, match=r"tensor 'e' is F32 \[0, 4\] \(box\) there"):
        shardckpt.open(str(root)).read("e")
    assert not verify(str(root)).ok
