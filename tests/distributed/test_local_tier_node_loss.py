"""The node-local tier under a node loss (issue 28): 4 ranks as 2 nodes x 2 ranks save locally every step with
peers=1 and peers=0; node 1's ranks are SIGKILLed and its directories wiped; restarts on 3 and 4 ranks (node 0 plus
a new node with empty directories) resume from the newest local step with peers=1, reading no data byte from the
persistent root, and from the persistent checkpoint with peers=0, never a partial local one."""

from __future__ import annotations

import shutil

import pytest

from tests.helpers.launch import run_ranks
from tests.helpers.tier_worker import __file__ as WORKER_FILE

pytestmark = pytest.mark.dist


def test_a_node_loss_resumes_from_the_surviving_local_copies_or_falls_back_whole(tmp_path, monkeypatch) -> None:
    # A small read and transfer budget: files are replicated, and restored, in several rounds of 4 KiB.
    monkeypatch.setenv("SHARDCKPT_MAX_IN_FLIGHT", "4096")
    from pathlib import Path

    worker = Path(WORKER_FILE)
    base = str(tmp_path)
    trained = run_ranks(
        "train", 4, {"base": base, "nodes": ["a", "a", "b", "b"], "killed": "b"}, timeout=120, worker=worker
    )
    assert [r is not None and r["ok"] for r in trained] == [True, True, False, False], trained
    # Node a keeps local steps 1 and 3 (2 is persistent) of its own two ranks and, as replicas, of node b's two.
    taken = trained[0]["value"]  # type: ignore[index]
    assert taken["checkpoints"] == 2 and taken["own"] > 0 and abs(taken["replicas"] - taken["own"]) < taken["own"] / 4
    # Both nodes' directories still there: a flipped byte in node a's copy of rank 0's file of local step 3 (rank 0
    # reads it there first) costs no step: the restore reads that file again from node b's replica, exact.
    data = next((tmp_path / "peers1" / "local-a").glob("step-00000003-*/data"))
    victim = sorted(data.iterdir())[0]
    good = victim.read_bytes()
    victim.write_bytes(good[:-1] + bytes([good[-1] ^ 0xFF]))
    # Rank 0's environment cuts read requests at 4 KiB, the others' at 8 MiB: the ranks still plan one exchange.
    env = {"0": {"SHARDCKPT_MAX_REQUEST": "4096"}}
    restore_args = {"base": base, "nodes": ["a", "a", "b", "b"], "env_by_rank": env}
    results = run_ranks("restore", 4, restore_args, timeout=120, worker=worker)
    assert all(r is not None and r["ok"] for r in results), results
    for result in results:
        assert result is not None
        replicated = result["value"]["peers1"]
        assert (replicated["step"], replicated["exact"]) == (3, True), replicated
    assert any("nothing of it used" in w for w in results[0]["value"]["peers1"]["warnings"]), results[0]  # type: ignore[index]
    victim.write_bytes(good)
    for variant in ("peers1", "peers0"):
        shutil.rmtree(tmp_path / variant / "local-b")  # the lost node's local storage is gone with it
    for nodes in (["a", "a", "c"], ["a", "a", "c", "c"]):
        results = run_ranks("restore", len(nodes), {"base": base, "nodes": nodes}, timeout=120, worker=worker)
        assert all(r is not None and r["ok"] for r in results), results
        for rank, result in enumerate(results):
            assert result is not None
            replicated, alone = result["value"]["peers1"], result["value"]["peers0"]
            assert (replicated["step"], replicated["exact"], replicated["persistent_bytes"]) == (3, True, 0), (
                nodes,
                rank,
                replicated,
            )
            assert (alone["step"], alone["exact"]) == (2, True), (nodes, rank, alone)
        assert sum(r["value"]["peers0"]["persistent_bytes"] for r in results if r is not None) > 0
        assert sum(r["value"]["peers1"]["local_bytes"] for r in results if r is not None) > 0
    # A flipped byte in the only surviving copy of a file of the newest local step (3): every rank drops that save
    # alike, nothing of it written into the state, and the restore falls back to the persistent step 2 (local step
    # 1 is older), exact. The checksum failure is the consuming rank's alone; the others learn it from the vote.
    data = next((tmp_path / "peers1" / "local-a").glob("step-00000003-*/data"))
    victim = sorted(data.iterdir())[-1]
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 0xFF
    victim.write_bytes(bytes(raw))
    nodes = ["a", "a", "c", "c"]
    results = run_ranks("restore", 4, {"base": base, "nodes": nodes}, timeout=120, worker=worker)
    assert all(r is not None and r["ok"] for r in results), results
    for result in results:
        assert result is not None
        replicated = result["value"]["peers1"]
        assert (replicated["step"], replicated["exact"]) == (2, True), replicated
    assert any("nothing of it used" in w for w in results[0]["value"]["peers1"]["warnings"]), results[0]  # type: ignore[index]
