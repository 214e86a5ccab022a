"""The node-local tier's replication holds no buffer the size of a peer's file (issue 28's memory target): through
the group every byte a rank receives lands in a shared mapping of the replica file itself and every large message
is sent from the state's own memory; between ranks of one host the kernel copies the file (nothing goes through
the group). 3 ranks as 3 nodes with peers=2, so each rank sends two copies and receives two files."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardckpt.distributed.tier_replicate import SMALL_MESSAGE, SMALL_PIECE, messages
from tests.helpers.launch import run_ranks
from tests.helpers.tier_worker import __file__ as WORKER_FILE

pytestmark = pytest.mark.dist

WINDOW = 1 << 20


def test_replicas_are_received_into_their_files_and_sent_from_the_state(tmp_path, monkeypatch) -> None:
    from pathlib import Path

    monkeypatch.setenv("SHARDCKPT_LOCAL_TIER_IN_FLIGHT", str(WINDOW))  # several rounds per file
    results = run_ranks("replicate", 3, {"base": str(tmp_path)}, timeout=120, worker=Path(WORKER_FILE))
    assert all(r is not None and r["ok"] for r in results), results
    for rank, result in enumerate(results):
        assert result is not None
        group, host = result["value"]["group"], result["value"]["host"]
        root = group["root"]
        # Each rank's file exists on its own node and two others, all three copies byte for byte the same.
        for copies in (group["copies"], host["copies"]):
            assert all(found == [3, 1] for found in copies.values()), (rank, copies)
        # Through the group: two files received, every byte into a mapping of a replica under this node's root.
        received = group["recv"]
        assert received and all(name == "irecv" for name, _, _ in received), (rank, received[:3])
        outside = [entry for entry in received if entry[2] is None or not entry[2].startswith(f"{root}/n{rank}/")]
        assert not outside, (rank, outside[:3])
        assert sum(size for _, size, _ in received) >= 2 * (640 << 12), (rank, len(received))
        # Sent from the state's memory, but for merged small pieces and the non-contiguous tensor read back.
        sent = group["send"]
        assert sent and all(name == "isend" for name, _, _ in sent), (rank, sent[:3])
        assert sum(size for _, size, inside in sent if inside) >= 2 * (640 << 12), (rank, [s[1:] for s in sent])
        assert all(inside or size <= max(SMALL_MESSAGE, WINDOW) for _, size, inside in sent), (rank, sent)
        assert max(group["scratch"], default=0) <= max(SMALL_MESSAGE, WINDOW), (rank, group["scratch"])
        # One host: the kernel copies each file; nothing goes through the group, nothing is allocated.
        assert (host["recv"], host["send"], host["scratch"]) == ([], [], []), (rank, host)
        # A replica rank 1 cannot create fails the save on every rank, with its cause; nothing of it is left.
        refused = result["value"]["refused"]
        assert refused["name"] is None and any("no room left (injected)" in w for w in refused["warnings"]), refused
        assert len(result["value"]["left"]) == 1 and result["value"]["left"][0].startswith("step-00000002-"), result


def test_ranks_that_disagree_are_refused_and_one_sharing_no_memory_restores_like_the_others(tmp_path) -> None:
    # Nodes reaching the persistent root by other paths (/fsx vs /mnt/fsx) made the default job differ: each rank
    # saved under its own job's name, and at the restore one rank took a local save while another found none and
    # went on to the persistent tier, their collectives mismatched (a hang, or a peer's reset). Peers or a cadence
    # that differ made one rank replicate or save while another did not. local_keep may differ (each node prunes).
    # Then rank 1's environment says SHARDCKPT_SHARE_MEMORY=0: it takes its bytes through the group while its host's
    # other ranks take theirs from a reader's shared region. The shared-read exchange returned a rank's requests in
    # the order they completed (a region's before the group's within a round), which the restore refused with an
    # untyped ValueError on some ranks while another had restored: now in the plan's order, on every rank.
    from pathlib import Path

    args = {"base": str(tmp_path), "env_by_rank": {"1": {"SHARDCKPT_SHARE_MEMORY": "0"}}}
    results = run_ranks("share_differs", 3, args, timeout=90, worker=Path(WORKER_FILE))
    assert all(r is not None and r["ok"] for r in results), results
    for result in results:
        assert result is not None
        errors = result["value"]["refused"]
        assert errors["agreed"] is None, errors
        job = errors["job"]
        assert job is not None and job.startswith("ShardckptUsageError: the ranks disagree on the local tier's job")
        assert "(rank 0: '/fsx/run', rank 1: '/mnt/fsx/run', rank 2: '/mnt/fsx/run')" in job, job
        assert "local_job=" in job, job
        assert errors["peers"] == (
            "ShardckptUsageError: the ranks disagree on the local tier's peers (rank 0: 0, rank 1: 1, rank 2: 2): give "
            "every rank the same"
        ), errors
        assert errors["every"] is not None and "local_every_steps (rank 0: 1, rank 1: 2, rank 2: 3)" in errors["every"]
        assert result["value"]["restore"] == {"error": None, "step": 1, "exact": True}, result["value"]


@pytest.mark.unit
@given(
    pieces=st.lists(st.integers(1, 3 << 20), max_size=40),
    header=st.integers(16, 4096),
    window=st.sampled_from([64 << 10, 1 << 20, 8 << 20]),
)
def test_a_file_travels_in_messages_that_tile_it_within_windows_large_pieces_alone(pieces, header, window) -> None:
    offsets, position = [], header
    for size in pieces:
        offsets.append(position)
        position += size
    rounds = messages(position, header, offsets, window)
    flat = [message for part in rounds for message in part]
    assert [low for low, _ in flat] == [0, *(high for _, high in flat[:-1])] and flat[-1][1] == position
    assert all(
        low // window == number and (high - 1) // window == number
        for number, part in enumerate(rounds)
        for low, high in part
    )
    starts = set(offsets) | {header}
    for low, high in flat:
        inside = [start for start in starts if low < start < high]  # pieces (or the header's end) merged into it
        assert not inside or high - low <= SMALL_MESSAGE, (low, high, inside)
    # Every range of at least SMALL_PIECE between two cuts travels alone: sent from its piece's memory, never copied.
    for start, end in zip(sorted(starts | {position}), sorted(starts | {position})[1:]):
        if end - start >= SMALL_PIECE:
            assert all(not (low < start < high) and not (low < end < high) for low, high in flat), (start, end)
