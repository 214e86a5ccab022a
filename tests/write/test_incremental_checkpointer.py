"""Checkpointer(incremental=True, full_every=N): the newest committed checkpoint is the parent, every N-th save is
full, the records say what was written against what was saved; incremental=False keeps full saves."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import shardckpt
from shardckpt.checkpointer import SERIES_KEY, SaveRecord

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


def test_every_nth_save_is_full_whatever_retention_deleted_and_across_a_restart(tmp_path: Path) -> None:
    """Issue 23.2: with keep_last < full_every - 1 retention deletes the saves between the last full one and the
    newest, so a count of what the root holds never reached full_every (one full save ever: F i i i ... i). The
    place in the series is recorded with each save: 30 saves of keep_last=3, full_every=10 (a restart after save 14)
    come out F i*9 F i*9 F i*9, and no checkpoint references one more than 9 saves older."""
    state = {"base": torch.randn(64, 64, generator=torch.Generator().manual_seed(3)), "head": torch.zeros(8)}
    kinds: list[str] = []
    referenced: dict[int, list[str]] = {}

    def run(steps: range) -> None:
        ckpt = shardckpt.Checkpointer(str(tmp_path), every_steps=1, keep_last=3, incremental=True, full_every=10)
        for step in steps:
            state["head"] += 1
            assert ckpt.maybe_save(step, state)
            kinds.append("F" if ckpt.records[-1].parent is None else "i")
            referenced[step] = referenced_checkpoints(tmp_path / f"step-{step:08d}")
        ckpt.close()

    run(range(1, 15))
    run(range(15, 31))  # a restarted job continues the count read from the newest checkpoint
    assert "".join(kinds) == ("F" + "i" * 9) * 3
    for step, names in referenced.items():
        assert all(step - int(name.removeprefix("step-")) <= 9 for name in names), (step, names)
    # Retention kept the newest 3 and what they reference: the last full save, nothing older.
    assert sorted(os.listdir(tmp_path)) == ["step-00000021", "step-00000028", "step-00000029", "step-00000030"]


def test_a_newest_incremental_checkpoint_without_a_recorded_place_is_followed_by_a_full_save(tmp_path: Path) -> None:
    """A referencing checkpoint saved by plain save(parent=) (or an earlier release) says nothing of how long its
    series is: the Checkpointer starts a new series rather than let it run on unbounded."""
    state = {"base": torch.randn(64, 64, generator=torch.Generator().manual_seed(4))}
    shardckpt.save(state, str(tmp_path / "step-00000001"), step=1, piece_hashes=True)
    shardckpt.save(state, str(tmp_path / "step-00000002"), step=2, parent=str(tmp_path / "step-00000001"))
    assert referenced_checkpoints(tmp_path / "step-00000002") == ["step-00000001"]
    ckpt = shardckpt.Checkpointer(str(tmp_path), every_steps=1, keep_last=5, incremental=True, full_every=10)
    ckpt.maybe_save(3, state)
    ckpt.maybe_save(4, state)
    ckpt.close()
    assert [record.parent is None for record in ckpt.records] == [True, False]
    assert shardckpt.open(str(tmp_path / "step-00000004")).manifest.metadata == {SERIES_KEY: 1}
