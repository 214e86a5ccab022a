"""Shared piece columns (format/piece_columns.py): the search for overlapping pieces against a scan of every piece,
and a manifest's tables decoding each distinct column once (a loading rank's metadata cost at 4,096+ ranks)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardckpt.format import columns
from shardckpt.format.layout import data_path, local_manifest_path
from shardckpt.format.manifest import (
    FileEntry,
    GlobalManifest,
    PieceTable,
    TensorEntry,
    decode_global_manifest,
    encode_global_manifest,
)
from shardckpt.format.piece_columns import Geometry

pytestmark = pytest.mark.unit


def _scan(start: np.ndarray, length: np.ndarray, lo: list[int], hi: list[int]) -> list[int]:
    """The reference: every piece compared, as the planner did before the search."""
    end = start + length
    return [i for i in range(start.shape[0]) if all(start[i] < hi) and all(end[i] > lo)]


@st.composite
def tables(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    """Row tilings (ordered, maybe uneven, maybe several columns), flat ranges, or boxes in any order."""
    k = draw(st.integers(0, 3))
    count = draw(st.integers(1, 60))
    kind = draw(st.sampled_from(["rows", "shuffled", "random"]))
    if kind == "random" or k == 0:
        start = np.array(draw(st.lists(st.lists(st.integers(0, 30), min_size=k, max_size=k), min_size=count,
                                       max_size=count)), dtype=np.int64).reshape(count, k)  # fmt: skip
        length = np.array(draw(st.lists(st.lists(st.integers(1, 10), min_size=k, max_size=k), min_size=count,
                                        max_size=count)), dtype=np.int64).reshape(count, k)  # fmt: skip
        return start, length
    rows = draw(st.lists(st.integers(1, 5), min_size=count, max_size=count))
    cols = draw(st.integers(1, 3))  # pieces per row slab: a 2-D grid when > 1
    start, length = [], []
    at = 0
    for height in rows:
        for c in range(cols if k > 1 else 1):
            start.append([at] + [c * 4] + [0] * max(k - 2, 0))
            length.append([height] + [4] + [7] * max(k - 2, 0))
        at += height
    start_a = np.array(start, dtype=np.int64)[:, :k]
    length_a = np.array(length, dtype=np.int64)[:, :k]
    if kind == "shuffled":
        order = np.array(draw(st.permutations(range(start_a.shape[0]))), dtype=np.int64)
        start_a, length_a = start_a[order], length_a[order]
    return start_a, length_a


@settings(max_examples=300, deadline=None)
@given(table=tables(), data=st.data())
def test_overlapping_finds_exactly_the_pieces_a_scan_finds(table, data) -> None:
    start, length = table
    k = start.shape[1]
    geometry = Geometry(start, length)
    for _ in range(4):
        lo = [data.draw(st.integers(-2, 40)) for _ in range(k)]
        hi = [a + data.draw(st.integers(0, 30)) for a in lo]
        assert geometry.overlapping(lo, hi).tolist() == _scan(start, length, lo, hi)
    piece = data.draw(st.integers(0, start.shape[0] - 1))
    same = [i for i in range(start.shape[0]) if (start[i] == start[piece]).all() and (length[i] == length[piece]).all()]
    assert geometry.matching(start[piece].tolist(), length[piece].tolist()).tolist() == same


def test_a_row_tiling_is_searched_along_its_rows() -> None:
    rows = np.arange(0, 4096 * 3, 3, dtype=np.int64)
    start = np.stack([rows, np.zeros_like(rows)], axis=1)
    length = np.stack([np.full_like(rows, 3), np.full_like(rows, 10)], axis=1)
    geometry = Geometry(start, length)
    assert geometry.axis() == 0
    assert geometry.overlapping([5, 0], [7, 10]).tolist() == [1, 2]
    shard1 = Geometry(start[:, ::-1].copy(), length[:, ::-1].copy())  # Shard(1): the columns are the ordered dim
    assert shard1.axis() == 1


def _fsdp_manifest(tensors: int, ranks: int) -> bytes:
    """`tensors` tensors of one shape, each split by rows over `ranks` files, as FSDP2 saves them."""
    rows, cols = 2 * ranks, 4
    piece = 2 * cols * 4
    entries = tuple(
        TensorEntry(
            f"t{t:03d}",
            "F32",
            (rows, cols),
            "box",
            PieceTable(
                np.arange(ranks, dtype=np.int64),
                np.full(ranks, 8 + t * piece, dtype=np.int64),
                np.stack([np.arange(0, rows, 2), np.zeros(ranks, np.int64)], axis=1),
                np.tile(np.array([[2, cols]], dtype=np.int64), (ranks, 1)),
            ),
        )
        for t in range(tensors)
    )
    size = 8 + tensors * piece
    files = tuple(FileEntry(r, data_path(r, "a"), size, local_manifest_path(r, "a"), 10, 0) for r in range(ranks))
    return encode_global_manifest(GlobalManifest("a", ranks, 64 << 10, files, entries))


def test_a_manifest_decodes_each_distinct_column_once(monkeypatch) -> None:
    """Same-shaped FSDP tensors share their file, start and length columns: inflated once for all of them (only
    each tensor's offsets are its own), and their boxes are one object, checked once."""
    manifest = decode_global_manifest(_fsdp_manifest(40, 32))
    inflated = []
    real = columns._inflate

    def counting(column, where, expected_n):
        inflated.append(where)
        return real(column, where, expected_n)

    monkeypatch.setattr(columns, "_inflate", counting)
    for entry in manifest.tensors:
        entry.pieces.arrays()
    assert len(inflated) == 40 + 3, sorted(set(w.rsplit(".", 1)[1] for w in inflated))
    first, *others = (entry.pieces.geometry() for entry in manifest.tensors)
    assert all(other is first for other in others)
    with pytest.raises(ValueError):  # shared: read-only, so no table can change another's
        manifest.tensors[0].pieces.start[0, 0] = 1


def test_a_shared_column_still_refuses_a_tensor_it_does_not_fit() -> None:
    """The checks of a shared column are per tensor where they depend on it: the same boxes, another shape."""
    raw = _fsdp_manifest(2, 32)
    manifest = decode_global_manifest(raw)
    for entry in manifest.tensors:
        entry.pieces.arrays()
    smaller = raw.replace(b"t001\xa5dtype\xa3F32\xa5shape\x92\x40\x04", b"t001\xa5dtype\xa3F32\xa5shape\x92\x3f\x04")
    assert smaller != raw
    broken = decode_global_manifest(smaller)
    broken.tensors[0].pieces.arrays()
    with pytest.raises(Exception, match="extends past shape"):
        broken.tensors[1].pieces.arrays()


def test_boxes_of_a_table_built_in_memory_leave_its_arrays_writable() -> None:
    start = np.arange(0, 60, 3, dtype=np.int64).reshape(-1, 1)
    length = np.full((20, 1), 3, dtype=np.int64)
    table = PieceTable(np.zeros(20, np.int64), np.arange(20, dtype=np.int64) * 12 + 8, start, length)
    assert table.overlapping((4,), (7,)).tolist() == [1, 2]
    start[0, 0] = 0  # the caller's array: still its own to write
    with pytest.raises(ValueError):
        table.geometry().start[0, 0] = 1
