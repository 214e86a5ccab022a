"""Failures on one rank of a distributed save or load reach every rank promptly as the same DistributedError.

Covers storage errors on the coordinator before the first collective, malformed input on one rank, plain
tensors and values that differ between ranks (they must be wrapped in PerRank), and destinations of the wrong
global shape. One gloo world of 2 runs all cases in turn; a case that hangs shows up as a missing verdict.
"""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardckpt.statedict.replicas import replica_disagreements
from tests.helpers.launch import run_ranks

CASES = {  # case -> (failed ranks, words every cause must contain)
    "exists_fault": ({"0"}, ["StorageError", "injected: stat"]),
    "open_fault": ({"1"}, ["StorageError", "injected: open"]),
    "flatten_fault": ({"1"}, ["ShardckptUsageError", "not a str"]),
    "replicated_tensor": ({"1"}, ["'rng'", "differs", "PerRank"]),
    "partial_tensor": ({"1"}, ["'extra'", "rank 0", "PerRank"]),
    "replicated_value": ({"1"}, ["'seed'", "differs", "PerRank"]),
    "partial_value": ({"1"}, ["'note'", "rank 0", "PerRank"]),
    "load_opening_fault": ({"0"}, ["PermissionError", "injected: denied"]),
    "load_open_fault": ({"1"}, ["StorageError", "injected: open"]),
    "load_stateful_fault": ({"1"}, ["RuntimeError", "injected: stateful"]),  # before: rank 0 waited for the timeout
    "dtensor_shape": ({"0", "1"}, ["'w'", "[2, 2]", "[4, 3]"]),
    "ckpt_state_fault": ({"1"}, ["RuntimeError", "injected: state"]),
    "ckpt_stage_fault": ({"1"}, ["RuntimeError", "injected: state"]),
    "ckpt_latest_fault": ({"0"}, ["StorageError", "injected: list"]),
    # before: only "... is missing (rank 1)", which reads like lost data (azip3)
    "url_differs": ({"0"}, ["IntegrityError", "is missing (rank 1)", "another URL"]),
}
WORLD = 2
# case -> what the error names: ranks that pass different coordinator= (before: they waited in broadcasts from
# different ranks until the group's timeout; with one out of range, that rank raised alone and the other waited).
COORDINATOR_CASES = {
    "coordinator_save": ["save:", "0 on rank 0; 1 on rank 1"],
    "coordinator_load": ["load:", "0 on rank 0; 1 on rank 1"],
    "coordinator_range": ["save:", "0 on rank 0; 2 on rank 1"],
}

# case -> what the error names: ranks that pass different step=, metadata= or block_size= (before: the save
# committed rank 0's step and metadata silently; block sizes failed after every rank had written its data; a
# Checkpointer's steps blamed a missing data file and left two incomplete checkpoints).
AGREEMENT_CASES = {
    "agree_step": ["save: step= differs", "(100 on rank 0; 101 on rank 1)"],
    "agree_metadata": ["save: metadata= differs", "a value with digest", "on rank 0;", "on rank 1)"],
    "agree_block_size": ["save: block_size= differs", "(4096 on rank 0; 65536 on rank 1)"],
    "ckpt_step_differs": ["save: step= differs", "(1 on rank 0; 2 on rank 1)"],
    "ckpt_maybe_step_differs": ["maybe_save: the ranks of the group are at different steps (from 2 to 3"],
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> tuple[str, dict[str, list[dict | None]]]:
    """Every case's verdict on every rank (None: that rank never finished the case)."""
    root = str(tmp_path_factory.mktemp("faults"))
    # A generous group timeout, a short launch timeout: a rank left waiting on a collective is killed by the
    # launcher long before the group would give up, so a regression fails in a minute instead of hanging.
    cases = [*CASES, "replicated_ok", "ckpt_retention_fault", *COORDINATOR_CASES, *AGREEMENT_CASES, "agree_ok"]
    run_ranks("protocol_faults", WORLD, {"root": root, "cases": cases, "timeout": 600}, timeout=90)
    found: dict[str, list[dict | None]] = {}
    for case in cases:
        found[case] = []
        for rank in range(WORLD):
            path = os.path.join(root, f"{case}.rank-{rank}.json")
            found[case].append(json.load(open(path)) if os.path.exists(path) else None)
    return root, found


@pytest.mark.parametrize("case", list(CASES))
def test_a_failure_on_one_rank_fails_every_rank_with_the_same_error(outcomes, case: str) -> None:
    root, found = outcomes
    failed, words = CASES[case]
    verdicts = found[case]
    assert all(v is not None for v in verdicts), f"{case}: a rank never finished (blocked in a collective): {verdicts}"
    assert all(v == verdicts[0] for v in verdicts), f"{case}: ranks disagree: {verdicts}"
    assert verdicts[0]["raised"] == "DistributedError", verdicts[0]
    assert set(verdicts[0]["failures"]) == failed, verdicts[0]
    for cause in verdicts[0]["failures"].values():
        for word in words:
            assert word in cause, (word, cause)
    if not case.startswith(("load_", "ckpt_latest")) and case != "dtensor_shape":
        checkpoint = os.path.join(root, case, "step-00000001") if case.startswith("ckpt_") else os.path.join(root, case)
        assert not os.path.exists(os.path.join(checkpoint, "COMMITTED"))


def _every_rank_raised_the_same_usage_error(found: dict, case: str, words: list[str]) -> None:
    """Every rank finished `case` (none blocked in a collective) with the same ShardckptUsageError naming `words`."""
    verdicts = found[case]
    assert all(v is not None for v in verdicts), f"{case}: a rank never finished (blocked in a collective): {verdicts}"
    assert all(v == verdicts[0] for v in verdicts), f"{case}: ranks disagree: {verdicts}"
    assert verdicts[0]["raised"] == "ShardckptUsageError", verdicts[0]
    for word in words:
        assert word in verdicts[0]["message"], (word, verdicts[0])


@pytest.mark.parametrize("case", list(COORDINATOR_CASES))
def test_ranks_that_name_different_coordinators_all_raise_the_same_usage_error(outcomes, case: str) -> None:
    root, found = outcomes
    _every_rank_raised_the_same_usage_error(found, case, [*COORDINATOR_CASES[case], "coordinator= differs"])
    assert not os.path.exists(os.path.join(root, case, "COMMITTED")) or case == "coordinator_load"


@pytest.mark.parametrize("case", list(AGREEMENT_CASES))
def test_ranks_that_pass_different_recorded_arguments_all_raise_before_writing(outcomes, case: str) -> None:
    root, found = outcomes
    _every_rank_raised_the_same_usage_error(found, case, AGREEMENT_CASES[case])
    assert not os.path.exists(os.path.join(root, case)), f"{case}: written before the ranks agreed"


def test_ranks_may_differ_in_compression_when_step_metadata_and_block_size_agree(outcomes) -> None:
    root, found = outcomes
    assert found["agree_ok"] == [{"raised": None}, {"raised": None}]
    assert os.path.exists(os.path.join(root, "agree_ok", "COMMITTED"))


def test_a_retention_failure_after_the_commit_only_warns(outcomes) -> None:
    root, found = outcomes
    assert found["ckpt_retention_fault"] == [{"raised": None, "warned": True}, {"raised": None, "warned": False}]
    assert os.path.exists(os.path.join(root, "ckpt_retention_fault", "step-00000001", "COMMITTED"))


def test_per_rank_tensors_and_values_round_trip_and_equal_replicas_save(outcomes) -> None:
    _, found = outcomes
    for rank, verdict in enumerate(found["replicated_ok"]):
        assert verdict == {"raised": None, "rng": [rank, 7], "seed": 1000 + rank, "shared": [5, 7]}, verdict


_ENTRY = st.tuples(
    st.sampled_from(["a", "b", "rng"]),
    st.sampled_from(["tensor", "value"]),
    st.sampled_from(["F32", "U8"]),
    st.sampled_from([[], [2], [2, 3]]),
    st.integers(0, 3),
).map(list)
_DIGEST = st.lists(_ENTRY, max_size=4, unique_by=lambda entry: entry[0])


@settings(max_examples=300, deadline=None)
@given(digests=st.lists(_DIGEST, min_size=1, max_size=5), data=st.data())
def test_replica_disagreements_name_exactly_the_ranks_that_differ(digests, data) -> None:
    """A rank is reported iff its values saved once differ from the reference rank's (any field, or the set of
    names); each report names one of the differing values and tells the user about PerRank."""
    reference = data.draw(st.integers(0, len(digests) - 1))
    failures = replica_disagreements(digests, reference)
    expected = {entry[0]: entry for entry in digests[reference]}
    for rank, digest in enumerate(digests):
        held = {entry[0]: entry for entry in digest}
        if held == expected:
            assert rank not in failures
            continue
        assert "PerRank" in failures[rank]
        differing = {name for name in held.keys() | expected.keys() if held.get(name) != expected.get(name)}
        assert any(f"{name!r}" in failures[rank] for name in differing), failures[rank]
