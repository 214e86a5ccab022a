"""plan_shared_reads: every byte any rank needs is fetched once, by a rank that needs it, and reaches every rank that
needs it; reads spread across the consumers; a hand-computed replicated case."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardckpt.errors import ShardckptUsageError
from shardckpt.planner.share import Segment, plan_shared_reads

pytestmark = pytest.mark.unit


@st.composite
def needs(
    draw: st.DrawFn, worlds: int = 6, files: int = 3, starts: int = 200, lengths: int = 60, per_rank: int = 6
) -> list[list[tuple[int, int, int]]]:
    """Up to `worlds` ranks, each with up to `per_rank` ranges of `files` files."""
    world = draw(st.integers(1, worlds))
    ranges = st.tuples(st.integers(0, files - 1), st.integers(0, starts), st.integers(1, lengths))
    return [[(f, s, s + n) for f, s, n in draw(st.lists(ranges, max_size=per_rank))] for _ in range(world)]


@settings(max_examples=300, deadline=None)
@given(needs(), st.integers(1, 70), st.booleans())
def test_every_needed_byte_is_fetched_once_by_one_of_its_consumers(wanted, chunk, with_nodes) -> None:
    nodes = [rank // 2 for rank in range(len(wanted))] if with_nodes else None
    plan = plan_shared_reads(wanted, chunk=chunk, nodes=nodes)
    owner: dict[tuple[int, int], Segment] = {}
    for segment in plan.segments:
        assert segment.reader in segment.consumers and segment.size <= chunk
        for byte in range(segment.start, segment.end):
            assert (segment.file, byte) not in owner  # disjoint: fetched once
            owner[(segment.file, byte)] = segment
    needed_by: dict[tuple[int, int], set[int]] = {}
    for rank, ranges in enumerate(wanted):
        for file, start, end in ranges:
            for byte in range(start, end):
                needed_by.setdefault((file, byte), set()).add(rank)
    assert set(owner) == set(needed_by)  # nothing missing, nothing extra
    for place, ranks in needed_by.items():
        assert set(owner[place].consumers) == ranks
    assert sum(plan.read_bytes(rank) for rank in range(len(wanted))) == len(needed_by)
    assert [(s.file, s.start) for s in plan.segments] == sorted((s.file, s.start) for s in plan.segments)
    if nodes is not None:
        for segment in plan.segments:
            homes = [nodes[rank] for rank in segment.consumers]
            assert homes.count(nodes[segment.reader]) == max(homes.count(node) for node in homes)


def test_a_replicated_tensor_is_read_once_in_turns_by_its_replicas() -> None:
    # 4 ranks need the same 100 bytes of file 0 (a replicated tensor): chunks of 30 go to ranks 0, 1, 2, 3.
    plan = plan_shared_reads([[(0, 0, 100)]] * 4, chunk=30)
    assert [(s.start, s.end, s.reader) for s in plan.segments] == [(0, 30, 0), (30, 60, 1), (60, 90, 2), (90, 100, 3)]
    assert all(s.consumers == (0, 1, 2, 3) for s in plan.segments)


def test_private_ranges_stay_with_their_rank_and_overlaps_are_shared() -> None:
    # HSDP-like: ranks 0 and 2 replicate shard A, ranks 1 and 3 shard B; rank 3 also reads a private range.
    plan = plan_shared_reads([[(0, 0, 8)], [(0, 8, 16)], [(0, 0, 8)], [(0, 8, 16), (1, 0, 4)]], chunk=4)
    table = [(s.file, s.start, s.end, s.reader, s.consumers) for s in plan.segments]
    assert table == [
        (0, 0, 4, 0, (0, 2)),
        (0, 4, 8, 2, (0, 2)),
        (0, 8, 12, 1, (1, 3)),
        (0, 12, 16, 3, (1, 3)),
        (1, 0, 4, 3, (3,)),
    ]


def test_rounds_bound_what_a_rank_fetches_and_receives() -> None:
    plan = plan_shared_reads([[(0, 0, 100)]] * 3, chunk=10)
    rounds = list(plan.rounds(25))
    assert sorted((s for r in rounds for s in r), key=lambda s: (s.file, s.start)) == list(plan.segments)
    for group in rounds:
        assert list(group) == sorted(group, key=lambda s: (s.file, s.start))
        for rank in range(3):
            assert sum(s.size for s in group if rank == s.reader or rank in s.consumers) <= 25


def test_ranks_that_share_nothing_fill_one_round_side_by_side() -> None:
    # HSDP at scale: replica pairs (r, r + 4) each read their own shard's file. Every round is a collective of the
    # whole job, so a pair whose bytes fill a round must not close it for the pairs after it: two rounds here (each
    # pair's 200 bytes in two of 100), not one more per pair (5 when rounds were cut in file order).
    plan = plan_shared_reads([[(rank % 4, 0, 100)] for rank in range(8)], chunk=100)
    assert len(list(plan.rounds(100))) == 1
    plan = plan_shared_reads([[(rank % 4, 0, 200)] for rank in range(8)], chunk=100)
    assert len(list(plan.rounds(100))) == 2


def test_what_sharing_saves_is_the_bytes_ranks_would_read_twice() -> None:
    # Three ranks whose ranges touch at their edges (a 2 -> 3 reshard read in whole blocks): 20 of 300 bytes twice.
    plan = plan_shared_reads([[(0, 0, 110)], [(0, 100, 210)], [(0, 200, 300)]], chunk=1000)
    assert (plan.total_bytes, plan.repeated_bytes) == (300, 20)
    plan = plan_shared_reads([[(0, 0, 300)]] * 4, chunk=1000)  # DDP: every rank all of it
    assert (plan.total_bytes, plan.repeated_bytes) == (300, 900)


def test_bad_input_is_a_usage_error() -> None:
    with pytest.raises(ShardckptUsageError, match="chunk"):
        plan_shared_reads([[(0, 0, 1)]], chunk=0)
    with pytest.raises(ShardckptUsageError, match="empty or negative"):
        plan_shared_reads([[(0, 5, 5)]], chunk=4)


def _reference_plan(needs: list[list[tuple[int, int, int]]], chunk: int, nodes: list[int] | None) -> list[Segment]:
    """The planner as first written (a Segment per piece cut at every boundary and chunk, then adjacent ones merged):
    the faster one must make exactly its plan, which every rank computes alike."""
    events: dict[int, list[tuple[int, int, int]]] = {}
    for rank, ranges in enumerate(needs):
        for file, start, end in ranges:
            events.setdefault(file, []).extend(((start, 1, rank), (end, -1, rank)))
    load, pieces = [0] * len(needs), []
    for file in sorted(events):
        active: dict[int, int] = {}
        previous = None
        for position, delta, rank in sorted(events[file]):
            if previous is not None and position > previous and active:
                consumers = tuple(sorted(active))
                for start in range(previous, position, chunk):
                    end = min(position, start + chunk)
                    candidates = consumers
                    if nodes is not None:
                        counts: dict[int, int] = {}
                        for r in consumers:
                            counts[nodes[r]] = counts.get(nodes[r], 0) + 1
                        home = min(n for n, c in counts.items() if c == max(counts.values()))
                        candidates = tuple(r for r in consumers if nodes[r] == home)
                    reader = min(candidates, key=lambda r: (load[r], r))
                    load[reader] += end - start
                    pieces.append(Segment(file, start, end, reader, consumers))
            active[rank] = active.get(rank, 0) + delta
            if not active[rank]:
                del active[rank]
            previous = position
    merged: list[Segment] = []
    for piece in pieces:
        last = merged[-1] if merged else None
        if (
            last is not None
            and (last.file, last.end, last.reader, last.consumers)
            == (piece.file, piece.start, piece.reader, piece.consumers)
            and last.size + piece.size <= chunk
        ):
            merged[-1] = Segment(last.file, last.start, piece.end, last.reader, last.consumers)
        else:
            merged.append(piece)
    return merged


@settings(max_examples=400, deadline=None)
@given(needs(worlds=12, files=4, starts=300, lengths=90, per_rank=8), st.integers(1, 100), st.integers(0, 4))
def test_the_plan_is_exactly_the_first_planners(wanted, chunk, per_node) -> None:
    nodes = [rank // per_node for rank in range(len(wanted))] if per_node else None
    assert list(plan_shared_reads(wanted, chunk=chunk, nodes=nodes).segments) == _reference_plan(wanted, chunk, nodes)
