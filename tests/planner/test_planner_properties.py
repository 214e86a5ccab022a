"""Properties of plan_reads + apply_copy on random shardings, dtypes, targets and coalescing parameters.

Each example builds an in-memory checkpoint (tests/helpers/strategies.py): 1..2 tensors sharded over 1..16 rank
files as a grid, flat ZeRO ranges or an irregular k-d tiling, pieces at random byte offsets. The planner is
pure integer math, so every request is executed here against the bytes of those files.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardckpt.errors import ShardckptUsageError
from shardckpt.format.dtypes import itemsize
from shardckpt.planner.box import Box, intersect
from shardckpt.planner.execute import apply_copy
from shardckpt.planner.plan import Copy, ReadPlan, Target, plan_reads
from tests.helpers.strategies import Checkpoint, Sharding, box_bytes, boxes_in, checkpoints, tensor_entry_of

BLOCK_SIZES = [1, 3, 16, 64, 4096]  # the planner takes any positive int; 3 is deliberately not a power of two
MAX_GAPS = [0, 64, 1 << 20]
MAX_REQUESTS = [1, 7, 64, 1 << 26]

SETTINGS = settings(max_examples=120, deadline=None)


@dataclass(frozen=True)
class Case:
    ckpt: Checkpoint
    targets: list[Target]
    block_size: int
    max_gap: int
    max_request: int
    plan: ReadPlan

    @property
    def request_bound(self) -> int:
        """The largest request the planner makes: max_request, but never less than a checksum block."""
        return max(self.max_request, self.block_size)

    def itemsize(self, target: int) -> int:
        return itemsize(self.ckpt.tensors[self.targets[target].name].entry.dtype)

    def target_bytes(self, target: int) -> int:
        return self.targets[target].box.volume * self.itemsize(target)


@st.composite
def targets_of(draw: st.DrawFn, ckpt: Checkpoint, max_targets: int = 4) -> list[Target]:
    names = sorted(ckpt.tensors)
    result = []
    for _ in range(draw(st.integers(1, max_targets))):
        name = draw(st.sampled_from(names))
        result.append(Target(name, draw(boxes_in(ckpt.tensors[name].array.shape))))
    return result


@st.composite
def cases(
    draw: st.DrawFn,
    block_sizes: list[int] = BLOCK_SIZES,
    max_gaps: list[int] = MAX_GAPS,
    max_requests: list[int] = MAX_REQUESTS,
) -> Case:
    ckpt = draw(checkpoints())
    targets = draw(targets_of(ckpt))
    block_size = draw(st.sampled_from(block_sizes))
    max_gap = draw(st.sampled_from(max_gaps))
    max_request = draw(st.sampled_from(max_requests))
    plan = plan_reads(ckpt.entries, targets, block_size=block_size, max_gap=max_gap, max_request=max_request)
    return Case(ckpt, targets, block_size, max_gap, max_request, plan)


def copy_offsets(copy: Copy, which: str) -> np.ndarray:
    """Every byte offset a copy reads (which="src", absolute in the file) or writes (which="dst"), in order."""
    base, strides = (copy.src, copy.src_strides) if which == "src" else (copy.dst, copy.dst_strides)
    offsets = np.arange(copy.shape[-1], dtype=np.int64) + base
    for count, stride in zip(reversed(copy.shape[:-1]), reversed(strides)):
        offsets = ((np.arange(count, dtype=np.int64) * stride)[:, None] + offsets[None, :]).reshape(-1)
    return offsets.reshape(-1)


def execute(case: Case) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Run every request against the in-memory files; return the filled buffers and per-byte write counts."""
    buffers = [np.zeros(case.target_bytes(i), dtype=np.uint8) for i in range(len(case.targets))]
    writes = [np.zeros(case.target_bytes(i), dtype=np.int64) for i in range(len(case.targets))]
    for request in case.plan.requests:
        fetched = np.frombuffer(case.ckpt.files[request.file], dtype=np.uint8)[request.start : request.end]
        for copy in request.copies:
            # apply_copy itself refuses a copy that reads outside [request.start, request.end).
            apply_copy(copy, fetched, request.start, buffers[copy.target])
            np.add.at(writes[copy.target], copy_offsets(copy, "dst"), 1)
    return buffers, writes


# ----------------------------------------------------------------------------------------- a. and b.


@pytest.mark.slow
@SETTINGS
@given(case=cases())
def test_executing_the_plan_reproduces_every_target_bit_for_bit(case: Case) -> None:
    buffers, _ = execute(case)
    for target, buffer in zip(case.targets, buffers):
        expected = box_bytes(case.ckpt.tensors[target.name].array, target.box)
        assert buffer.tobytes() == expected


@pytest.mark.slow
@SETTINGS
@given(case=cases())
def test_copies_write_every_target_byte_exactly_once(case: Case) -> None:
    _, writes = execute(case)
    for count in writes:
        np.testing.assert_array_equal(count, np.ones_like(count))


@pytest.mark.slow
@SETTINGS
@given(case=cases())
def test_copies_are_well_formed(case: Case) -> None:
    for request in case.plan.requests:
        for copy in request.copies:
            assert 0 <= copy.target < len(case.targets)
            assert len(copy.shape) >= 1
            assert all(n >= 1 for n in copy.shape)
            assert len(copy.src_strides) == len(copy.dst_strides) == len(copy.shape) - 1
            assert copy.shape[-1] <= case.request_bound
            assert copy.src_end - copy.src <= case.request_bound
            src = copy_offsets(copy, "src")
            assert int(src.max()) + 1 == copy.src_end
            # Source bytes of one copy are distinct: a copy never reads a byte twice.
            assert np.unique(src).size == src.size


# ----------------------------------------------------------------------------------------------- c.


@pytest.mark.slow
@SETTINGS
@given(case=cases())
def test_planned_bytes_equal_needed_bytes(case: Case) -> None:
    needed = sum(case.target_bytes(i) for i in range(len(case.targets)))
    copied = sum(copy.nbytes for request in case.plan.requests for copy in request.copies)
    assert case.plan.needed_bytes == needed
    assert case.plan.exact_bytes == needed
    assert copied == needed


# ----------------------------------------------------------------------------------------------- d.


def over_read_bound(case: Case) -> int:
    """Upper bound on plan.fetch_bytes, derived from how plan.py builds requests.

    1. A copy is cut (plan._split) so that consecutive source runs are <= max_gap apart; its source span is
       therefore <= nbytes + (runs - 1) * max_gap, with runs = prod(shape[:-1]).
    2. Each copy's span is rounded outwards to its piece's checksum blocks: < block_size extra on each
       side, so its rounded range is < span + 2 * block_size.
    3. A request is the union of the rounded ranges of its copies, merged while the gap to the next one is
       <= max_gap: at most (copies - 1) gaps of <= max_gap.
    So fetch <= needed + sum over copies of ((runs - 1) * max_gap + 2 * (block_size - 1))
                        + sum over requests of (copies - 1) * max_gap.
    (Rounding is per copy, not per verify span: three one-byte copies in consecutive blocks of one piece
    fetch three blocks with max_gap=0, more than needed + 2 * block_size.)
    """
    bound = case.plan.needed_bytes
    for request in case.plan.requests:
        bound += (len(request.copies) - 1) * case.max_gap
        for copy in request.copies:
            runs = copy.nbytes // copy.shape[-1]
            bound += (runs - 1) * case.max_gap + 2 * (case.block_size - 1)
    return bound


@pytest.mark.slow
@SETTINGS
@given(case=cases())
def test_over_read_is_bounded_and_requests_lie_inside_their_files(case: Case) -> None:
    for request in case.plan.requests:
        assert request.file in case.ckpt.files
        assert 0 <= request.start < request.end <= len(case.ckpt.files[request.file])
        # max_request bounds merging; a request of one copy may exceed it by the block rounding only.
        if len(request.copies) > 1:
            assert request.size <= case.request_bound
        else:
            assert request.size <= case.request_bound + 2 * (case.block_size - 1)
    assert case.plan.fetch_bytes <= over_read_bound(case)


@st.composite
def disjoint_cases(draw: st.DrawFn) -> Case:
    """Cases with max_gap=0, block_size=1 and targets that share no element."""
    ckpt = draw(checkpoints())
    kept: list[Target] = []
    for target in draw(targets_of(ckpt)):
        if all(t.name != target.name or intersect(t.box, target.box) is None for t in kept):
            kept.append(target)
    max_request = draw(st.sampled_from(MAX_REQUESTS))
    plan = plan_reads(ckpt.entries, kept, block_size=1, max_gap=0, max_request=max_request)
    return Case(ckpt, kept, 1, 0, max_request, plan)


@pytest.mark.slow
@SETTINGS
@given(case=disjoint_cases())
def test_no_gap_and_unit_blocks_fetch_exactly_the_needed_bytes(case: Case) -> None:
    assert case.plan.fetch_bytes == case.plan.needed_bytes
    # And the requests do not overlap each other: no byte of a file is fetched twice.
    for file in case.ckpt.files:
        ranges = sorted((r.start, r.end) for r in case.plan.requests if r.file == file)
        for (_, end), (start, _) in zip(ranges, ranges[1:]):
            assert end <= start


# ----------------------------------------------------------------------------------------------- e.


@pytest.mark.slow
@SETTINGS
@given(case=cases())
def test_verify_spans_are_block_aligned_and_cover_every_copied_byte(case: Case) -> None:
    pieces = case.ckpt.pieces()
    block = case.block_size
    for request in case.plan.requests:
        for span in request.verify:
            # The span names the piece by tensor, table index, offset and size, all consistent.
            assert pieces[(request.file, span.piece_offset)] == (span.tensor, span.piece, span.piece_size)
            piece_end = span.piece_offset + span.piece_size
            assert span.piece_offset <= span.start < span.end <= piece_end
            assert (span.start - span.piece_offset) % block == 0
            assert (span.end - span.piece_offset) % block == 0 or span.end == piece_end
            assert request.start <= span.start
            assert span.end <= request.end
        for copy in request.copies:
            holders = [s for s in request.verify if s.start <= copy.src and copy.src_end <= s.end]
            assert len(holders) >= 1, f"copy {copy} is not inside a verified span of {request}"
            name, _, _ = pieces[(request.file, holders[0].piece_offset)]
            assert name == case.targets[copy.target].name


# ------------------------------------------------------------------------------------------- errors


def test_plan_rejects_unknown_tensors_boxes_outside_and_bad_parameters() -> None:
    ckpt_shape = (4, 3)
    sharding = Sharding(
        "grid",
        ckpt_shape,
        "box",
        np.array([[0, 0]], dtype=np.int64),
        np.array([[4, 3]], dtype=np.int64),
        np.zeros(1, dtype=np.int64),
    )
    entries = {"w": tensor_entry_of("w", "F32", sharding, np.zeros(1), np.zeros(1))}
    with pytest.raises(ShardckptUsageError, match="'x'"):
        plan_reads(entries, [Target("x", Box((0, 0), (1, 1)))], block_size=16, max_gap=0, max_request=1 << 20)
    with pytest.raises(ShardckptUsageError, match="outside"):
        plan_reads(entries, [Target("w", Box((3, 0), (2, 1)))], block_size=16, max_gap=0, max_request=1 << 20)
    with pytest.raises(ShardckptUsageError):
        plan_reads(entries, [Target("w", Box((0,), (1,)))], block_size=16, max_gap=0, max_request=1 << 20)
    with pytest.raises(ShardckptUsageError):
        plan_reads(entries, [], block_size=16, max_gap=-1, max_request=1 << 20)
    with pytest.raises(ShardckptUsageError):
        plan_reads(entries, [], block_size=16, max_request=0, max_gap=0)
    plan = plan_reads(entries, [Target("w", Box((0, 0), (0, 3)))], block_size=16, max_gap=0, max_request=1 << 20)
    assert plan.requests == ()
    assert plan.needed_bytes == 0
