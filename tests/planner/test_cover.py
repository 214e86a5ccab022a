"""check_cover: every valid sharding passes; every gap or overlap raises CoverageError naming the tensor.

The verdict is also compared with a brute-force numpy counter on random (mostly invalid) piece sets, through
the normal paths, with the grid's cell counter disabled, and through the signed-corner check (_check_corners)
alone, whose reported point must really be uncovered (gap) or covered twice (overlap).
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Callable
from types import FrameType

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from shardckpt.errors import CoverageError, FormatError
from shardckpt.format import limits
from shardckpt.planner import cover
from shardckpt.planner.cover import check_cover
from tests.helpers.strategies import Sharding, shapes, shardings

NAME = "enc.layers.0/attn.w"  # odd characters: the message must name it exactly (repr)
SETTINGS = settings(max_examples=150, deadline=None)


def check(sharding: Sharding, name: str = NAME) -> None:
    check_cover(name, sharding.shape, sharding.layout, sharding.start, sharding.length)


def assert_rejected(sharding: Sharding) -> CoverageError:
    with pytest.raises(CoverageError) as info:
        check(sharding)
    assert repr(NAME) in str(info.value)
    return info.value


def brute_force_ok(shape: tuple[int, ...], layout: str, start: np.ndarray, length: np.ndarray) -> bool:
    counts = np.zeros(math.prod(shape), dtype=np.int64)
    if layout == "flat":
        for (s,), (n,) in zip(start.tolist(), length.tolist()):
            counts[s : s + n] += 1
    else:
        view = counts.reshape(shape)
        for s, n in zip(start.tolist(), length.tolist()):
            view[tuple(slice(a, a + b) for a, b in zip(s, n))] += 1
    return bool((counts == 1).all())


# ---------------------------------------------------------------------------------------- valid covers


@pytest.mark.slow
@SETTINGS
@given(sharding=shardings())
def test_every_valid_sharding_is_accepted(sharding: Sharding) -> None:
    check(sharding)
    assert brute_force_ok(sharding.shape, sharding.layout, sharding.start, sharding.length)


@settings(max_examples=60, deadline=None)
@given(sharding=shardings(kinds=("kdtree", "grid")))
def test_valid_shardings_pass_without_the_cell_counter(sharding: Sharding) -> None:
    original = cover._MAX_COUNTED_CELLS
    cover._MAX_COUNTED_CELLS = 0
    try:
        check(sharding)
    finally:
        cover._MAX_COUNTED_CELLS = original


# --------------------------------------------------------------------------------------- injected faults


def _nonempty(sharding: Sharding) -> None:
    assume(sharding.count >= 1)


@pytest.mark.slow
@SETTINGS
@given(sharding=shardings(), data=st.data())
def test_dropping_a_piece_leaves_a_gap(sharding: Sharding, data: st.DataObject) -> None:
    _nonempty(sharding)
    drop = data.draw(st.integers(0, sharding.count - 1))
    keep = np.arange(sharding.count) != drop
    error = assert_rejected(sharding.with_pieces(sharding.start[keep], sharding.length[keep]))
    message = str(error)
    assert "gap" in message or "covered by no piece" in message or "but 0 stored pieces" in message


@pytest.mark.slow
@SETTINGS
@given(sharding=shardings(), data=st.data())
def test_duplicating_a_piece_is_an_overlap(sharding: Sharding, data: st.DataObject) -> None:
    _nonempty(sharding)
    dup = data.draw(st.integers(0, sharding.count - 1))
    order = data.draw(st.permutations([*range(sharding.count), dup]))
    error = assert_rejected(sharding.with_pieces(sharding.start[order], sharding.length[order]))
    assert "overlap" in str(error) or "but 2 stored pieces" in str(error)


def _extents(sharding: Sharding) -> list[int]:
    return [math.prod(sharding.shape)] if sharding.layout == "flat" else list(sharding.shape)


@pytest.mark.slow
@SETTINGS
@given(sharding=shardings(), data=st.data())
def test_growing_a_piece_inside_the_shape_is_an_overlap(sharding: Sharding, data: st.DataObject) -> None:
    extents = _extents(sharding)
    end = sharding.start + sharding.length
    # (piece, dim, direction) that grow the piece by one while it stays inside the shape.
    moves = [(i, d, +1) for i in range(sharding.count) for d in range(sharding.k) if end[i, d] < extents[d]]
    moves += [(i, d, -1) for i in range(sharding.count) for d in range(sharding.k) if sharding.start[i, d] > 0]
    assume(moves)
    i, d, direction = data.draw(st.sampled_from(moves))
    start, length = sharding.start.copy(), sharding.length.copy()
    length[i, d] += 1
    if direction < 0:
        start[i, d] -= 1
    assert_rejected(sharding.with_pieces(start, length))


@pytest.mark.slow
@SETTINGS
@given(sharding=shardings(), data=st.data())
def test_shifting_a_piece_is_rejected(sharding: Sharding, data: st.DataObject) -> None:
    extents = _extents(sharding)
    end = sharding.start + sharding.length
    moves = [(i, d, +1) for i in range(sharding.count) for d in range(sharding.k) if end[i, d] < extents[d]]
    moves += [(i, d, -1) for i in range(sharding.count) for d in range(sharding.k) if sharding.start[i, d] > 0]
    assume(moves)
    i, d, step = data.draw(st.sampled_from(moves))
    start = sharding.start.copy()
    start[i, d] += step
    assert_rejected(sharding.with_pieces(start, sharding.length))


# ------------------------------------------------------------------------------------------ hand-written


def _box(shape: tuple[int, ...], pieces: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> Sharding:
    k = len(shape)
    start = np.array([p[0] for p in pieces], dtype=np.int64).reshape(len(pieces), k)
    length = np.array([p[1] for p in pieces], dtype=np.int64).reshape(len(pieces), k)
    return Sharding("hand", shape, "box", start, length, np.zeros(len(pieces), dtype=np.int64))


def _flat(shape: tuple[int, ...], ranges: list[tuple[int, int]]) -> Sharding:
    start = np.array([[a] for a, _ in ranges], dtype=np.int64).reshape(-1, 1)
    length = np.array([[b - a] for a, b in ranges], dtype=np.int64).reshape(-1, 1)
    return Sharding("hand", shape, "flat", start, length, np.zeros(len(ranges), dtype=np.int64))


def test_scalar_needs_exactly_one_piece() -> None:
    check(_box((), [((), ())]))
    check(_flat((), [(0, 1)]))
    assert_rejected(_box((), []))
    assert_rejected(_box((), [((), ()), ((), ())]))
    assert_rejected(_flat((), []))
    assert_rejected(_flat((), [(0, 1), (0, 1)]))


def test_empty_tensor_has_no_pieces() -> None:
    for shape in [(0,), (3, 0), (0, 4, 2)]:
        check(_box(shape, []))
        check(_flat(shape, []))
    # A piece of a 0-element tensor (callers normally reject it earlier; check_cover must too).
    assert_rejected(_box((3, 0), [((0, 0), (1, 1))]))
    assert_rejected(_flat((0,), [(0, 1)]))


@pytest.mark.parametrize("layout", ["box", "flat"])
@pytest.mark.parametrize(
    "ranges",
    [
        [(1, 10)],  # gap at the start
        [(0, 4), (5, 10)],  # gap in the middle
        [(0, 4), (4, 9)],  # gap at the end
        [(0, 4), (3, 10)],  # overlap in the middle
        [(0, 10), (0, 1)],  # overlap at the start
        [(0, 5), (5, 10), (9, 10)],  # overlap at the end
        [(0, 5), (5, 10), (2, 7)],  # a piece spanning a boundary
        [(0, 2), (2, 2 + 3), (0, 10)],  # a piece covering everything plus others
    ],
)
def test_one_dimensional_gaps_and_overlaps(layout: str, ranges: list[tuple[int, int]]) -> None:
    sharding = _flat((10,), ranges) if layout == "flat" else _box((10,), [((a,), (b - a,)) for a, b in ranges])
    assert_rejected(sharding)


@pytest.mark.parametrize("layout", ["box", "flat"])
def test_one_dimensional_valid_covers(layout: str) -> None:
    for ranges in [[(0, 10)], [(7, 10), (0, 3), (3, 7)], [(i, i + 1) for i in range(10)]]:
        sharding = _flat((10,), ranges) if layout == "flat" else _box((10,), [((a,), (b - a,)) for a, b in ranges])
        check(sharding)


def test_flat_ranges_of_a_matrix() -> None:
    check(_flat((3, 4), [(0, 5), (5, 6), (6, 12)]))
    assert_rejected(_flat((3, 4), [(0, 5), (6, 12)]))
    assert_rejected(_flat((3, 4), [(0, 6), (5, 12)]))


@pytest.fixture(params=["counted", "sweep"])
def general_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a hand-written case with and without the grid's cell counter (the general case takes the corners)."""
    if request.param == "sweep":
        monkeypatch.setattr(cover, "_MAX_COUNTED_CELLS", 0)
    return str(request.param)


# A brick wall: rows of bricks offset by half a brick. Not a grid: the pieces straddle each other's cuts.
BRICKS = [
    ((0, 0), (1, 2)),
    ((0, 2), (1, 2)),
    ((1, 0), (1, 1)),
    ((1, 1), (1, 2)),
    ((1, 3), (1, 1)),
    ((2, 0), (1, 2)),
    ((2, 2), (1, 2)),
]


def test_brick_layout_is_a_valid_cover(general_path: str) -> None:
    check(_box((3, 4), BRICKS))
    check(_box((3, 4), list(reversed(BRICKS))))


def test_brick_layout_with_a_hole_is_a_gap(general_path: str) -> None:
    holed = [b for b in BRICKS if b != ((1, 1), (1, 2))]
    error = assert_rejected(_box((3, 4), holed))
    assert "gap" in str(error)
    # Replacing the middle brick by a wider one overlaps both half bricks.
    error = assert_rejected(_box((3, 4), [*holed, ((1, 0), (1, 3))]))
    assert "overlap" in str(error)


def test_pinwheel_is_a_valid_non_grid_cover(general_path: str) -> None:
    # Four 2x1 / 1x2 rectangles around a 1x1 centre of a 3x3 square: no piece boundary is a full grid line.
    pinwheel = [((0, 0), (2, 1)), ((0, 1), (1, 2)), ((1, 2), (2, 1)), ((2, 0), (1, 2)), ((1, 1), (1, 1))]
    check(_box((3, 3), pinwheel))
    assert_rejected(_box((3, 3), pinwheel[:-1]))
    assert_rejected(_box((3, 3), [*pinwheel, ((1, 1), (1, 1))]))


def test_grid_fast_path_reports_gaps_at_the_edges_and_inside() -> None:
    assert_rejected(_box((4, 4), [((0, 0), (2, 4)), ((2, 0), (1, 4))]))  # missing last row
    assert_rejected(_box((4, 4), [((1, 0), (3, 4))]))  # missing first row
    assert_rejected(_box((2, 2), [((0, 0), (1, 1)), ((0, 1), (1, 1)), ((1, 0), (1, 1))]))  # missing a cell
    assert_rejected(_box((2, 2), [((0, 0), (1, 1)), ((0, 1), (1, 1)), ((1, 0), (1, 1)), ((0, 0), (1, 1))]))


def test_grid_gap_without_the_cell_counter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cover, "_MAX_COUNTED_CELLS", 0)
    error = assert_rejected(_box((2, 2), [((0, 0), (1, 1)), ((0, 1), (1, 1)), ((1, 0), (1, 1))]))
    assert "3 of 4" in str(error)


def test_huge_volumes_are_reported_as_overlap_without_overflow() -> None:
    # Volumes whose int64 sum would wrap: the float guard must still see an overlap.
    big = 1 << 31
    shape = (big, big)
    pieces = [((0, 0), (big, big))] * 3
    error = assert_rejected(_box(shape, pieces))
    assert "overlap" in str(error)


# ------------------------------------------------------------------------------------ brute force oracle


@st.composite
def piece_sets(draw: st.DrawFn) -> Sharding:
    """A shape and 0..6 random pieces inside it (each with >= 1 element), or a valid sharding perturbed."""
    if draw(st.booleans()):
        sharding = draw(shardings(shapes(max_dims=3, max_side=5)))
        change = draw(st.sampled_from(["none", "replace", "drop", "drop", "duplicate"]))
        if not sharding.count or change == "none":
            return sharding
        i = draw(st.integers(0, sharding.count - 1))
        start, length = sharding.start.copy(), sharding.length.copy()
        if change == "drop":  # on a k-d tiling this makes non-grid gaps
            keep = np.arange(sharding.count) != i
            return sharding.with_pieces(start[keep], length[keep])
        if change == "duplicate":
            return sharding.with_pieces(
                np.concatenate([start, start[i : i + 1]]), np.concatenate([length, length[i : i + 1]])
            )
        extents = _extents(sharding)
        for d in range(sharding.k):
            s = draw(st.integers(0, extents[d] - 1))
            start[i, d], length[i, d] = s, draw(st.integers(1, extents[d] - s))
        return sharding.with_pieces(start, length)
    shape = draw(shapes(max_dims=3, max_side=4))
    assume(math.prod(shape) > 0)
    layout = draw(st.sampled_from(["box", "flat"]))
    extents = [math.prod(shape)] if layout == "flat" else list(shape)
    starts, lengths = [], []
    for _ in range(draw(st.integers(0, 6))):
        s = [draw(st.integers(0, e - 1)) for e in extents]
        starts.append(s)
        lengths.append([draw(st.integers(1, e - a)) for e, a in zip(extents, s)])
    k = len(extents)
    start = np.array(starts, dtype=np.int64).reshape(len(starts), k)
    length = np.array(lengths, dtype=np.int64).reshape(len(lengths), k)
    return Sharding("random", shape, layout, start, length, np.zeros(len(starts), dtype=np.int64))


def _verdict(sharding: Sharding) -> bool:
    try:
        check(sharding)
    except CoverageError as error:
        assert repr(NAME) in str(error)
        return False
    return True


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(sharding=piece_sets())
def test_verdict_matches_a_brute_force_counter(sharding: Sharding) -> None:
    assert _verdict(sharding) == brute_force_ok(sharding.shape, sharding.layout, sharding.start, sharding.length)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(sharding=piece_sets())
def test_verdict_without_the_cell_counter_matches_a_brute_force_counter(sharding: Sharding) -> None:
    original = cover._MAX_COUNTED_CELLS
    cover._MAX_COUNTED_CELLS = 0  # _check_grid without its counter
    try:
        verdict = _verdict(sharding)
    finally:
        cover._MAX_COUNTED_CELLS = original
    assert verdict == brute_force_ok(sharding.shape, sharding.layout, sharding.start, sharding.length)


@pytest.mark.slow
@given(
    rows=st.integers(1, 40),
    cols=st.integers(1, 5),
    cuts=st.lists(st.tuples(st.integers(0, 39), st.integers(1, 40)), min_size=1, max_size=6),
)
@settings(max_examples=300, deadline=None)
def test_row_slabs_take_the_fast_path_and_agree_with_brute_force(rows: int, cols: int, cuts) -> None:
    """Pieces spanning every column (FSDP Shard(0)) are checked as row intervals: same verdict as counting cells."""
    slabs = [(lo, min(length, rows - lo)) for lo, length in cuts if lo < rows]
    assume(slabs)
    start = np.array([[lo, 0] for lo, _ in slabs], dtype=np.int64)
    length = np.array([[n, cols] for _, n in slabs], dtype=np.int64)
    covered = np.zeros(rows, dtype=np.int64)
    for lo, n in slabs:
        covered[lo : lo + n] += 1
    exact = bool((covered == 1).all())
    if exact:
        check_cover("t", (rows, cols), "box", start, length)
    else:
        # With both a gap and an overlap, either may be the one reported.
        expected = "gap" if covered.max() <= 1 else "overlap" if covered.min() >= 1 else "gap|overlap"
        with pytest.raises(CoverageError, match=expected):
            check_cover("t", (rows, cols), "box", start, length)


def brute_force_counts(shape: tuple[int, ...], start: np.ndarray, length: np.ndarray) -> np.ndarray:
    counts = np.zeros(shape, dtype=np.int64)
    for s, n in zip(start.tolist(), length.tolist()):
        counts[tuple(slice(a, a + b) for a, b in zip(s, n))] += 1
    return counts


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(sharding=piece_sets())
def test_corner_check_alone_agrees_with_brute_force_and_names_a_true_defect(sharding: Sharding) -> None:
    """_check_corners on any box set (grids and row slabs too, bypassing the fast paths): same verdict as counting
    cells, and the element or pieces it names really are uncovered or covered twice."""
    assume(sharding.layout == "box" and sharding.k >= 1 and math.prod(sharding.shape) > 0)
    counts = brute_force_counts(sharding.shape, sharding.start, sharding.length)
    try:
        cover._check_corners(NAME, sharding.shape, sharding.start, sharding.length)
    except CoverageError as error:
        message = str(error)
        assert repr(NAME) in message
        assert not (counts == 1).all()
        found = re.search(r"elements \[([0-9:, ]+)\] are covered by no piece \(gap\)", message)
        if found:
            point = tuple(int(part.split(":")[0]) for part in found.group(1).split(","))
            assert counts[point] == 0
        else:
            pair = re.search(r"pieces (\d+) and (\d+) both cover \[([0-9:, ]+)\] \(overlap\)", message)
            if pair is None:
                pytest.fail(f"the message names neither a gap nor an overlap: {message}")
            region = tuple(slice(*map(int, part.split(":"))) for part in pair.group(3).split(","))
            assert (counts[region] >= 2).all()
        return
    assert (counts == 1).all()


def test_corner_check_names_the_first_gap_and_overlap() -> None:
    holed = _box((3, 4), [b for b in BRICKS if b != ((1, 1), (1, 2))])
    with pytest.raises(CoverageError, match=re.escape("'t': elements [1:2, 1:2] are covered by no piece (gap)")):
        cover._check_corners("t", (3, 4), holed.start, holed.length)
    wide = _box((3, 4), [*BRICKS, ((2, 1), (1, 2))])
    with pytest.raises(CoverageError, match=re.escape("'t': pieces 5 and 7 both cover [2:3, 1:2] (overlap)")):
        cover._check_corners("t", (3, 4), wide.start, wide.length)


def test_an_irregular_tiling_beyond_the_corner_limit_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The corner work is bounded before any corner is made: beyond the limit a typed error names the tensor."""
    monkeypatch.setattr(limits, "MAX_COVER_CORNERS", 8)
    bricks = _box((3, 4), BRICKS)
    with pytest.raises(FormatError, match=r"tensor 't': 7 irregular pieces need \d+ corner points"):
        check_cover("t", (3, 4), "box", bricks.start, bricks.length)


# ---------------------------------------------------------------------------------------- per-tensor cost


def numpy_calls(work: Callable[[], object]) -> int:
    """Calls into numpy made directly by the code under test while `work` runs: its C functions, methods of
    arrays and ufuncs, and its Python functions; what numpy runs inside such a call is not counted."""
    count = inside = 0

    def in_numpy(filename: str) -> bool:
        return f"{os.sep}numpy{os.sep}" in filename

    def numpy_object(arg: object) -> bool:
        module = getattr(arg, "__module__", None) or type(getattr(arg, "__self__", None)).__module__
        return module.split(".")[0] == "numpy"

    def profile(frame: FrameType, event: str, arg: object) -> None:
        nonlocal count, inside
        if event == "c_call" and not inside and not in_numpy(frame.f_code.co_filename) and numpy_object(arg):
            count, inside = count + 1, 1
        elif event in ("c_return", "c_exception") and inside and not in_numpy(frame.f_code.co_filename):
            inside = 0
        elif event == "call" and not inside and in_numpy(frame.f_code.co_filename) and frame.f_back is not None:
            # np.argsort & co. run a "_dispatcher" first, from C; the call proper is the one to count.
            caller_outside = not in_numpy(frame.f_back.f_code.co_filename)
            count += caller_outside and not frame.f_code.co_name.endswith("_dispatcher")

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        work()
    finally:
        sys.setprofile(previous)
    return count


def fsdp_rows(rows: int, cols: int, ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """The non-empty Shard(0) pieces of a [rows, cols] tensor on `ranks` ranks, in a shuffled rank order."""
    chunk = -(-rows // ranks)
    lo = np.arange(0, rows, chunk, dtype=np.int64)
    order = np.random.default_rng(0).permutation(lo.size)
    start = np.stack([lo, np.zeros_like(lo)], 1)[order]
    length = np.stack([np.minimum(lo + chunk, rows) - lo, np.full_like(lo, cols)], 1)[order]
    return start, length


@pytest.mark.parametrize(("ranks", "budget"), [(16, 2), (64, 5)])
def test_a_few_row_slabs_cost_a_few_numpy_calls(ranks: int, budget: int) -> None:
    """An MoE state's commit checks 100,000+ tensors of 16-64 pieces each (issue 15): the check's fixed cost is
    the cost, so the common verdict (row slabs, exact cover) takes a bounded number of numpy calls (a dozen
    calls is ~13 us, 2.5 s over 180,000 tensors)."""
    start, length = fsdp_rows(2048, 7168, ranks)
    calls = numpy_calls(lambda: check_cover(NAME, (2048, 7168), "box", start, length))
    if calls > budget:
        pytest.fail(f"exact cover of {ranks} row slabs made {calls} numpy calls, over the budget of {budget}")
    with pytest.raises(CoverageError, match="overlap"):  # and a defect in a few slabs is still named
        check_cover(NAME, (2048, 7168), "box", np.concatenate([start, start[:1]]), np.concatenate([length, length[:1]]))
