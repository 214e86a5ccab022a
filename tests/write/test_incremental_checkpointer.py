"""Checkpointer(incremental=True, full_every=N): the newest committed checkpoint is the parent, every N-th save is
full, the records say what was written against what was saved; incremental=False keeps full saves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import shardckpt
from shardckpt.checkpointer import SaveRecord

pytestmark = pytest.mark.unit


def referenced_checkpoints(ckpt: Path) -> list[str]:
    marker = json.loads((ckpt / "COMMITTED").read_text())
    return [entry["checkpoint"] for entry in marker.get("references", [])]


def test_every_nth_save_is_full_and_the_others_reference_the_newest(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(1)
    state = {"base": torch.randn(128, 128, generator=gen), "head": torch.zeros(8)}
    records: list[SaveRecord] = []
    ckpt = shardckpt.Checkpointer(
        str(tmp_path), every_steps=1, keep_last=10, incremental=True, full_every=3, on_save=records.append
    )
    for step in range(1, 6):
        state["head"] += 1
        assert ckpt.maybe_save(step, state)
    ckpt.close()
    refs = [referenced_checkpoints(tmp_path / f"step-{step:08d}") for step in range(1, 6)]
    assert refs == [[], ["step-00000001"], ["step-00000001"], [], ["step-00000004"]]
    assert [record.parent is not None for record in records] == [False, True, True, False, True]
    logical = state["base"].nbytes + state["head"].nbytes
    assert {record.logical_bytes for record in records} == {logical}
    # An incremental save writes the head (and a header), the full ones everything.
    assert [record.bytes < state["base"].nbytes for record in records] == [False, True, True, False, True]


def test_without_incremental_every_save_is_full(tmp_path: Path) -> None:
    state = {"base": torch.ones(64, 64)}
    ckpt = shardckpt.Checkpointer(str(tmp_path), every_steps=1, keep_last=10)
    for step in (1, 2):
        ckpt.maybe_save(step, state)
    ckpt.close()
    assert [referenced_checkpoints(tmp_path / f"step-{step:08d}") for step in (1, 2)] == [[], []]
    with pytest.raises(shardckpt.ShardckptUsageError, match="full_every"):
        shardckpt.Checkpointer(str(tmp_path), incremental=True, full_every=0)


def test_a_restarted_job_continues_the_series_read_from_the_root(tmp_path: Path) -> None:
    """The count of incremental saves since the last full one comes from the root's COMMITTED markers, so a new
    Checkpointer (a restarted job) neither starts with a full save nor lets the series run past full_every."""
    state = {"base": torch.randn(128, 128, generator=torch.Generator().manual_seed(2)), "head": torch.zeros(8)}

    def run(steps: range) -> None:
        ckpt = shardckpt.Checkpointer(str(tmp_path), every_steps=1, keep_last=10, incremental=True, full_every=3)
        for step in steps:
            state["head"] += 1
            ckpt.maybe_save(step, state)
        ckpt.close()

    run(range(1, 3))  # full, incremental
    run(range(3, 6))  # restart: incremental (third of the series), full, incremental
    refs = [referenced_checkpoints(tmp_path / f"step-{step:08d}") for step in range(1, 6)]
    assert refs == [[], ["step-00000001"], ["step-00000001"], [], ["step-00000004"]]
