"""The local tier's placement (issue 28): replica partners survive the loss of any one node for any world size and
any (uneven) split into nodes; a restore's reader of every byte range is a rank that holds its file; the choice of
the local checkpoint never takes another job's copies, an incomplete save or one not newer than the persistent."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardckpt.catalog.local_tier import LocalCopy, choose
from shardckpt.errors import ShardckptUsageError
from shardckpt.planner.partners import replica_partners, tier_readers
from shardckpt.planner.share import plan_shared_reads

pytestmark = pytest.mark.unit

node_lists = st.lists(st.integers(0, 5), min_size=1, max_size=13)


@settings(max_examples=200, deadline=None)
@given(node_lists, st.integers(0, 4))
def test_every_file_outlives_the_loss_of_any_one_node(nodes, peers) -> None:
    partners = replica_partners(nodes, peers)
    distinct = set(nodes)
    for rank, chosen in enumerate(partners):
        homes = [nodes[partner] for partner in chosen]
        assert nodes[rank] not in homes and len(set(homes)) == len(homes)  # other nodes, one copy each
        assert len(chosen) == min(peers, len(distinct) - 1)
    if peers >= 1 and len(distinct) >= 2:
        for lost in distinct:
            for rank, chosen in enumerate(partners):
                assert any(nodes[r] != lost for r in (rank, *chosen)), (lost, rank)


def test_partners_hand_computed_on_uneven_nodes() -> None:
    # node 0: ranks 0, 1, 2; node 1: rank 3; node 2: ranks 4, 5
    assert replica_partners([0, 0, 0, 1, 2, 2], 1) == [(3,), (3,), (3,), (4,), (0,), (1,)]
    assert replica_partners([0, 0, 0, 1, 2, 2], 2) == [(3, 4), (3, 5), (3, 4), (4, 0), (0, 3), (1, 3)]
    assert replica_partners([7, 7], 1) == [(), ()]  # one node: nowhere else to keep a copy
    with pytest.raises(ShardckptUsageError, match="peers"):
        replica_partners([0, 1], -1)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_every_range_is_read_by_a_holder_of_its_file(data) -> None:
    world = data.draw(st.integers(1, 6))
    ranges = st.tuples(st.integers(0, 2), st.integers(0, 100), st.integers(1, 40))
    needs = [[(f, s, s + n) for f, s, n in data.draw(st.lists(ranges, max_size=5))] for _ in range(world)]
    holders = {f: data.draw(st.lists(st.integers(0, world - 1), max_size=3)) for f in range(3)}
    nodes = [rank // 2 for rank in range(world)]
    share = plan_shared_reads(needs, chunk=16, nodes=nodes)
    plan, missing = tier_readers(share, holders, nodes)
    needed_files = {f for ranges_ in needs for f, _, _ in ranges_}
    assert missing == sorted(f for f in needed_files if not holders[f])
    assert sum(s.size for s in plan.segments) == sum(s.size for s in share.segments if holders[s.file])
    for segment in plan.segments:
        assert segment.reader in holders[segment.file]
        if set(holders[segment.file]) & set(segment.consumers):
            assert segment.reader in segment.consumers  # a consumer that holds the file reads it itself


def _copy(name: str, step: int, held: tuple[int, ...], job: str = "job", attempt: str = "a", crc: int = 1) -> LocalCopy:
    return LocalCopy(name, attempt, step, job, crc, 4, held)


def test_the_choice_takes_the_newest_complete_save_of_this_job_above_the_persistent_step() -> None:
    survivors = [
        [_copy("s6", 6, (0, 1, 2, 3)), _copy("s7", 7, (0, 1)), _copy("x9", 9, (0, 1, 2, 3), job="other")],
        [_copy("s6", 6, (0, 1, 2, 3)), _copy("s7", 7, (0, 1))],
        [],  # a new node: nothing
    ]
    choice, aside = choose(survivors, "job", newer_than=4)
    assert choice is not None and (choice.name, choice.step) == ("s6", 6)
    assert choice.holders == {0: (0, 1), 1: (0, 1), 2: (0, 1), 3: (0, 1)}
    assert any("x9" in note for note in aside) and any("s7" in note and "2 of its 4" in note for note in aside)
    assert choose(survivors, "job", newer_than=6)[0] is None  # not newer than the persistent checkpoint
    # Two copies of one name with other attempts (or manifests) are two saves: never pooled into one.
    mixed = [[_copy("s8", 8, (0, 1), attempt="a")], [_copy("s8", 8, (2, 3), attempt="b")]]
    assert choose(mixed, "job", None)[0] is None
    mixed = [[_copy("s8", 8, (0, 1), crc=1)], [_copy("s8", 8, (2, 3), crc=2)]]
    assert choose(mixed, "job", None)[0] is None
