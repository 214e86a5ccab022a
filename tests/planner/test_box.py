"""Box arithmetic (linear_range_boxes, intersect, row_major_strides) and hand-computed resharding plans."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardckpt.format.manifest import PieceTable, tensor_entry
from shardckpt.planner.box import (
    Box,
    box_as_flat_range,
    intersect,
    linear_index,
    linear_range_boxes,
    row_major_strides,
)
from shardckpt.planner.execute import apply_copies, apply_copy
from shardckpt.planner.plan import Copy, ReadRequest, Target, VerifySpan, plan_reads
from tests.helpers.strategies import boxes_in, shapes

# ----------------------------------------------------------------------------------- linear_range_boxes


@st.composite
def shape_and_range(draw: st.DrawFn) -> tuple[tuple[int, ...], int, int]:
    shape = draw(shapes(max_dims=5, max_side=6))
    numel = math.prod(shape)
    a, b = sorted(draw(st.tuples(st.integers(0, numel), st.integers(0, numel))))
    return shape, a, b


def _indices(shape: tuple[int, ...], box: Box) -> np.ndarray:
    linear = np.arange(math.prod(shape), dtype=np.int64).reshape(shape)
    return linear[tuple(slice(o, e) for o, e in zip(box.offsets, box.end))].reshape(-1)


@settings(max_examples=300, deadline=None)
@given(case=shape_and_range())
def test_linear_range_boxes_tile_the_range_in_row_major_order(case: tuple[tuple[int, ...], int, int]) -> None:
    shape, start, stop = case
    boxes = list(linear_range_boxes(shape, start, stop))
    for box in boxes:
        assert box.within(shape)
        assert box.volume >= 1
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            assert intersect(a, b) is None
    # Concatenating the boxes, each row-major, gives exactly start, start + 1, ..., stop - 1.
    got = np.concatenate([_indices(shape, box) for box in boxes]) if boxes else np.zeros(0, dtype=np.int64)
    np.testing.assert_array_equal(got, np.arange(start, stop, dtype=np.int64))


def test_linear_range_boxes_docstring_example() -> None:
    assert list(linear_range_boxes((3, 4), 2, 11)) == [
        Box((0, 2), (1, 2)),
        Box((1, 0), (1, 4)),
        Box((2, 0), (1, 3)),
    ]


def test_linear_range_boxes_edge_cases() -> None:
    assert list(linear_range_boxes((3, 4), 0, 12)) == [Box((0, 0), (3, 4))]
    assert list(linear_range_boxes((3, 4), 4, 8)) == [Box((1, 0), (1, 4))]
    assert list(linear_range_boxes((3, 4), 5, 5)) == []
    assert list(linear_range_boxes((3, 4), 7, 3)) == []
    assert list(linear_range_boxes((), 0, 1)) == [Box((), ())]
    assert list(linear_range_boxes((5,), 1, 4)) == [Box((1,), (3,))]
    # Middle of a 3-d tensor: tail of a row, rest of a plane, whole planes, head of a plane, head of a row.
    assert list(linear_range_boxes((4, 3, 2), 3, 21)) == [
        Box((0, 1, 1), (1, 1, 1)),
        Box((0, 2, 0), (1, 1, 2)),
        Box((1, 0, 0), (2, 3, 2)),
        Box((3, 0, 0), (1, 1, 2)),
        Box((3, 1, 0), (1, 1, 1)),
    ]


@settings(max_examples=300, deadline=None)
@given(data=st.data(), shape=shapes(max_dims=4, max_side=5))
def test_box_as_flat_range_exactly_when_the_box_is_contiguous(data: st.DataObject, shape: tuple[int, ...]) -> None:
    box = data.draw(boxes_in(shape))
    indices = _indices(shape, box)
    contiguous = indices.size == 0 or bool((np.diff(indices) == 1).all())
    found = box_as_flat_range(shape, box.offsets, box.shape)
    if found is None:
        assert not contiguous or box.volume == 0
        return
    start, count = found
    assert count == box.volume
    if count:
        np.testing.assert_array_equal(indices, np.arange(start, start + count))
    # A range found for a box must turn back into the same box (for non-empty boxes).
    if count:
        assert list(linear_range_boxes(shape, start, start + count)) == [box]


def test_box_as_flat_range_examples() -> None:
    assert box_as_flat_range((3, 4), (1, 0), (2, 4)) == (4, 8)
    assert box_as_flat_range((3, 4), (1, 1), (1, 2)) == (5, 2)
    assert box_as_flat_range((3, 4), (0, 1), (2, 2)) is None
    assert box_as_flat_range((2, 3, 4), (1, 2, 0), (1, 1, 4)) == (20, 4)
    assert box_as_flat_range((), (), ()) == (0, 1)


# ----------------------------------------------------------------------------- intersect / strides / Box


def test_intersect_basics() -> None:
    a = Box((0, 0), (4, 4))
    assert intersect(a, Box((2, 1), (5, 2))) == Box((2, 1), (2, 2))
    assert intersect(a, Box((1, 1), (2, 2))) == Box((1, 1), (2, 2))  # nested
    assert intersect(a, a) == a
    assert intersect(a, Box((4, 0), (1, 4))) is None  # touching edge: no common element
    assert intersect(a, Box((5, 5), (1, 1))) is None
    assert intersect(a, Box((1, 1), (0, 2))) is None  # empty box
    assert intersect(Box((), ()), Box((), ())) == Box((), ())  # scalars


@settings(max_examples=200, deadline=None)
@given(data=st.data(), shape=shapes(min_dims=1, max_dims=3, max_side=6))
def test_intersect_matches_numpy_masks(data: st.DataObject, shape: tuple[int, ...]) -> None:
    a, b = data.draw(boxes_in(shape)), data.draw(boxes_in(shape))

    def mask(box: Box) -> np.ndarray:
        m = np.zeros(shape, dtype=bool)
        m[tuple(slice(o, e) for o, e in zip(box.offsets, box.end))] = True
        return m

    both = mask(a) & mask(b)
    common = intersect(a, b)
    if common is None:
        assert not both.any()
    else:
        assert common.volume >= 1
        np.testing.assert_array_equal(mask(common), both)
    assert intersect(b, a) == common


def test_row_major_strides_and_linear_index() -> None:
    assert row_major_strides(()) == ()
    assert row_major_strides((5,)) == (1,)
    assert row_major_strides((3, 4, 5)) == (20, 5, 1)
    assert row_major_strides((0, 3)) == (3, 1)
    assert row_major_strides((2, 0, 3)) == (0, 3, 1)
    assert row_major_strides((3, 4, 5)) == tuple(s // 8 for s in np.zeros((3, 4, 5), dtype=np.int64).strides)
    assert linear_index((3, 4, 5), (2, 1, 3)) == 2 * 20 + 1 * 5 + 3
    assert linear_index((), ()) == 0


def test_box_validation_and_properties() -> None:
    box = Box((1, 2), (3, 4))
    assert box.ndim == 2
    assert box.volume == 12
    assert box.end == (4, 6)
    assert box.within((4, 6))
    assert not box.within((4, 5))
    assert not box.within((4, 6, 1))
    assert Box.full((2, 3)) == Box((0, 0), (2, 3))
    assert Box.full(()).volume == 1
    assert Box((0,), (0,)).volume == 0
    assert str(box) == "[1:4, 2:6]"
    with pytest.raises(ValueError):
        Box((0,), (1, 2))
    with pytest.raises(ValueError):
        Box((-1,), (1,))
    with pytest.raises(ValueError):
        Box((0,), (-1,))


# ----------------------------------------------------------------------------- hand-computed resharding

ROW = 4 * 4  # one row of a [8, 4] float32 tensor, in bytes
HEADER = 8  # pieces start after an 8-byte "header" in every file


def _row_pieces(cuts: list[int]) -> tuple[PieceTable, dict[int, bytes], np.ndarray]:
    """[8, 4] F32 tensor saved as row blocks [cuts[i], cuts[i+1]), block i alone in file i at offset 8."""
    array = np.arange(32, dtype="<f4").reshape(8, 4)
    n = len(cuts) - 1
    start = np.array([[cuts[i], 0] for i in range(n)], dtype=np.int64)
    length = np.array([[cuts[i + 1] - cuts[i], 4] for i in range(n)], dtype=np.int64)
    table = PieceTable(np.arange(n, dtype=np.int64), np.full(n, HEADER, dtype=np.int64), start, length)
    files = {i: b"\xff" * HEADER + array[cuts[i] : cuts[i + 1]].tobytes() + b"\xff" * 3 for i in range(n)}
    return table, files, array


def _run(plan_requests: tuple[ReadRequest, ...], files: dict[int, bytes], sizes: list[int]) -> list[bytes]:
    buffers = [np.zeros(size, dtype=np.uint8) for size in sizes]
    for request in plan_requests:
        fetched = np.frombuffer(files[request.file], dtype=np.uint8)[request.start : request.end]
        for copy in request.copies:
            apply_copy(copy, fetched, request.start, buffers[copy.target])
    return [b.tobytes() for b in buffers]


def test_eight_row_pieces_read_as_four_row_blocks() -> None:
    table, files, array = _row_pieces(list(range(9)))
    entries = {"w": tensor_entry("w", "F32", (8, 4), "box", table)}
    targets = [Target("w", Box((2 * j, 0), (2, 4))) for j in range(4)]
    plan = plan_reads(entries, targets, block_size=16, max_gap=0, max_request=1 << 20)
    # Every row is its own file: two requests per target, each one whole row (= one 16-byte block).
    assert len(plan.requests) == 8
    for request in plan.requests:
        row = request.file
        assert (request.start, request.end) == (HEADER, HEADER + ROW)
        assert request.verify == (VerifySpan("w", row, HEADER, ROW, HEADER, HEADER + ROW),)
        assert request.copies == (Copy(row // 2, HEADER, (row % 2) * ROW, (ROW,), (), ()),)
    got = _run(plan.requests, files, [2 * ROW] * 4)
    assert got == [array[2 * j : 2 * j + 2].tobytes() for j in range(4)]
    assert plan.fetch_bytes == plan.needed_bytes == 8 * ROW


def test_four_ranks_read_on_three_ranks() -> None:
    # Saved on 4 ranks: rows [0,2) [2,4) [4,6) [6,8). Read on 3 ranks: rows [0,3) [3,6) [6,8).
    table, files, array = _row_pieces([0, 2, 4, 6, 8])
    entries = {"w": tensor_entry("w", "F32", (8, 4), "box", table)}
    # Reader rank 1 wants rows 3..6: row 3 is the second row of file 1, rows 4..5 all of file 2.
    plan = plan_reads(entries, [Target("w", Box((3, 0), (3, 4)))], block_size=16, max_gap=0, max_request=1 << 20)
    assert plan.requests == (
        ReadRequest(
            file=1,
            start=HEADER + ROW,
            end=HEADER + 2 * ROW,
            verify=(VerifySpan("w", 1, HEADER, 2 * ROW, HEADER + ROW, HEADER + 2 * ROW),),
            copies=(Copy(0, HEADER + ROW, 0, (ROW,), (), ()),),
        ),
        ReadRequest(
            file=2,
            start=HEADER,
            end=HEADER + 2 * ROW,
            verify=(VerifySpan("w", 2, HEADER, 2 * ROW, HEADER, HEADER + 2 * ROW),),
            copies=(Copy(0, HEADER, ROW, (2 * ROW,), (), ()),),
        ),
    )
    assert _run(plan.requests, files, [3 * ROW]) == [array[3:6].tobytes()]
    # With 32-byte blocks the read of row 3 is rounded out to the whole piece, which is one block.
    plan = plan_reads(entries, [Target("w", Box((3, 0), (3, 4)))], block_size=32, max_gap=0, max_request=1 << 20)
    assert [(r.file, r.start, r.end) for r in plan.requests] == [(1, HEADER, HEADER + 2 * ROW), (2, HEADER, 40)]
    assert plan.requests[0].copies == (Copy(0, HEADER + ROW, 0, (ROW,), (), ()),)
    # All three reader ranks together get the whole tensor back.
    targets = [Target("w", Box((a, 0), (b - a, 4))) for a, b in [(0, 3), (3, 6), (6, 8)]]
    plan = plan_reads(entries, targets, block_size=16, max_gap=32 << 10, max_request=8 << 20)
    got = _run(plan.requests, files, [3 * ROW, 3 * ROW, 2 * ROW])
    assert got == [array[0:3].tobytes(), array[3:6].tobytes(), array[6:8].tobytes()]


def test_requests_are_never_smaller_than_a_checksum_block() -> None:
    # max_request 4 bytes over 32-byte blocks: each 4-byte request read and checked its whole block, every block of
    # the tensor eight times over (before); now one request per block at most, each byte read once.
    table, files, array = _row_pieces([0, 8])
    entries = {"w": tensor_entry("w", "F32", (8, 4), "box", table)}
    plan = plan_reads(entries, [Target("w", Box((0, 0), (8, 4)))], block_size=32, max_gap=0, max_request=4)
    assert plan.fetch_bytes == plan.needed_bytes == 8 * ROW
    assert _run(plan.requests, files, [8 * ROW]) == [array.tobytes()]


def test_column_pieces_read_as_row_blocks_use_strided_copies() -> None:
    # TP-style: two column halves [0:8, 0:2] and [0:8, 2:4], each (8, 2) F32 = 8 bytes per stored row, both in
    # file 0 (second one after the first). Reading rows 2..5 takes 3 strided runs of 8 bytes from each.
    array = np.arange(32, dtype="<f4").reshape(8, 4)
    left, right = array[:, :2].tobytes(), array[:, 2:].tobytes()
    files = {0: b"\x00" * HEADER + left + right}
    table = PieceTable(
        np.zeros(2, dtype=np.int64),
        np.array([HEADER, HEADER + 64], dtype=np.int64),
        np.array([[0, 0], [0, 2]], dtype=np.int64),
        np.array([[8, 2], [8, 2]], dtype=np.int64),
    )
    entries = {"w": tensor_entry("w", "F32", (8, 4), "box", table)}
    plan = plan_reads(entries, [Target("w", Box((2, 0), (3, 4)))], block_size=8, max_gap=64, max_request=1 << 20)
    (request,) = plan.requests
    assert (request.start, request.end) == (HEADER + 16, HEADER + 64 + 40)
    assert sorted(request.copies, key=lambda c: c.src) == [
        Copy(0, HEADER + 16, 0, (3, 8), (8,), (16,)),
        Copy(0, HEADER + 64 + 16, 8, (3, 8), (8,), (16,)),
    ]
    assert _run(plan.requests, files, [48]) == [array[2:5].tobytes()]
    # The bytes between the two pieces' runs (rows 5..7 of the left piece, rows 0..1 of the right) count as gap.
    assert plan.fetch_bytes == 88
    assert plan.needed_bytes == 48


def test_flat_zero_partitions_read_as_a_box() -> None:
    # ZeRO: the flattened [3, 4] I64 tensor cut at elements 0, 5, 7, 12 on three ranks; read the column 1..3 box.
    array = np.arange(12, dtype="<i8").reshape(3, 4) * 11
    cuts = [0, 5, 7, 12]
    flat = array.reshape(-1)
    files = {i: flat[cuts[i] : cuts[i + 1]].tobytes() for i in range(3)}
    table = PieceTable(
        np.arange(3, dtype=np.int64),
        np.zeros(3, dtype=np.int64),
        np.array([[c] for c in cuts[:-1]], dtype=np.int64),
        np.array([[b - a] for a, b in zip(cuts[:-1], cuts[1:])], dtype=np.int64),
    )
    entries = {"z": tensor_entry("z", "I64", (3, 4), "flat", table)}
    box = Box((0, 1), (3, 2))
    plan = plan_reads(entries, [Target("z", box)], block_size=8, max_gap=0, max_request=1 << 20)
    # Rank 0 holds elements 0..4: (0, 1), (0, 2) are elements 1, 2 at byte 8. Rank 1 holds elements 5, 6, exactly
    # (1, 1), (1, 2): one 16-byte run. Rank 2 holds 7..11: (2, 1), (2, 2) are elements 9, 10 at byte 16.
    copies = sorted((r.file, c.src, c.dst, c.shape) for r in plan.requests for c in r.copies)
    assert copies == [(0, 8, 0, (16,)), (1, 0, 16, (16,)), (2, 16, 32, (16,))]
    assert _run(plan.requests, files, [48]) == [array[:, 1:3].tobytes()]


@settings(max_examples=100, deadline=None)
@given(
    runs=st.lists(st.tuples(st.integers(-2, 40), st.integers(-2, 40), st.integers(1, 12), st.booleans()), max_size=6)
)
def test_apply_copies_equals_apply_copy_one_by_one(runs: list[tuple[int, int, int, bool]]) -> None:
    """Plain byte runs go by slice assignment, strided copies through apply_copy: the same bytes land, and a copy out
    of range fails with apply_copy's error, the copies before it done."""
    fetched = np.arange(100, 140, dtype=np.uint8)  # file bytes 1000..1039
    copies = [
        Copy(0, 1000 + src, dst, (2, n // 2 or 1), (3,), (n,)) if strided else Copy(0, 1000 + src, dst, (n,), (), ())
        for src, dst, n, strided in runs
    ]
    expected, actual = np.zeros(48, np.uint8), np.zeros(48, np.uint8)
    expected_error = actual_error = None
    try:
        for copy in copies:
            apply_copy(copy, fetched, 1000, expected)
    except ValueError as exc:
        expected_error = str(exc)
    try:
        apply_copies(copies, fetched, 1000, [actual])
    except ValueError as exc:
        actual_error = str(exc)
    assert actual_error == expected_error
    assert actual.tolist() == expected.tolist()
