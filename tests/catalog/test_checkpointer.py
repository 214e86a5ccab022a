"""Checkpointer: cadence, retention, restore_latest, async saves from staging copies, preemption signals."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

import shardckpt


def _state(value: float) -> dict:
    return {"w": torch.full((64, 32), value), "meta": {"value": value}}


def test_cadence_retention_and_restore(tmp_path) -> None:
    root = str(tmp_path / "ck")
    saved = []
    checkpointer = shardckpt.Checkpointer(root, every_steps=2, keep_last=2, preemption_signals=(), on_save=saved.append)
    for step in range(1, 8):
        checkpointer.maybe_save(step, _state(float(step)))
    checkpointer.close()
    assert [r.step for r in saved] == [2, 4, 6]
    assert sorted(os.listdir(root)) == ["step-00000004", "step-00000006"]
    fresh = _state(0.0)
    restorer = shardckpt.Checkpointer(root, every_steps=2, preemption_signals=())
    assert restorer.restore_latest(fresh) == 6
    assert torch.equal(fresh["w"], torch.full((64, 32), 6.0)) and fresh["meta"] == {"value": 6.0}
    assert shardckpt.Checkpointer(str(tmp_path / "empty"), preemption_signals=()).restore_latest(fresh) is None


def test_async_save_writes_the_staged_values(tmp_path) -> None:
    root = str(tmp_path / "ck")
    records = []
    checkpointer = shardckpt.Checkpointer(
        root, every_steps=1, async_save=True, preemption_signals=(), on_save=records.append
    )
    state = _state(1.0)
    checkpointer.maybe_save(1, state)
    state["w"].fill_(99.0)  # the training step goes on at once; the checkpoint must hold the staged values
    checkpointer.maybe_save(2, lambda: _state(2.0))  # queues behind the first save
    checkpointer.close()
    assert torch.equal(shardckpt.open(f"{root}/step-00000001").read("w"), torch.full((64, 32), 1.0))
    assert torch.equal(shardckpt.open(f"{root}/step-00000002").read("w"), torch.full((64, 32), 2.0))
    assert [r.step for r in records] == [1, 2]


def test_the_stall_counts_all_the_training_thread_waits_for(tmp_path, monkeypatch) -> None:
    """An async save's stall covers building the state and staging; a save that queues behind a slow one counts
    the wait too (only the background write is left out)."""
    records = []
    checkpointer = shardckpt.Checkpointer(
        str(tmp_path / "ck"), every_steps=1, async_save=True, preemption_signals=(), on_save=records.append
    )
    real_save = checkpointer._save
    returned = threading.Event()  # set once maybe_save gave the training thread its control back
    writes_waited: list[bool] = []

    def slow_save(*args, **kwargs):
        # The background write goes on only after maybe_save returned: a stall that included it would deadlock
        # here (and time out), which no wall-clock bound is needed to see.
        writes_waited.append(returned.wait(timeout=60))
        time.sleep(0.3)  # and then it takes a while
        return real_save(*args, **kwargs)

    monkeypatch.setattr(checkpointer, "_save", slow_save)

    def slow_state() -> dict:
        time.sleep(0.1)  # building the state dict is the training thread's time
        return _state(1.0)

    checkpointer.maybe_save(1, slow_state)
    returned.set()
    checkpointer.maybe_save(2, _state(2.0))  # waits for the first save's write
    checkpointer.close()
    first, second = records
    assert writes_waited == [True, True]  # neither stall included its own background write
    assert first.stall_seconds >= 0.1  # building the state is counted
    assert second.stall_seconds >= 0.25  # queued behind the first's write


def test_async_save_errors_surface_on_wait(tmp_path) -> None:
    # A failure only the background save meets (the URL is taken); what staging can check fails at once (below).
    shardckpt.save({"w": torch.zeros(2)}, str(tmp_path / "ck" / "step-00000001"), step=0)
    checkpointer = shardckpt.Checkpointer(str(tmp_path / "ck"), every_steps=1, async_save=True, preemption_signals=())
    checkpointer.maybe_save(1, {"w": torch.ones(2)})
    with pytest.raises(shardckpt.AlreadyExistsError):
        checkpointer.wait()
    assert shardckpt.open(shardckpt.latest(str(tmp_path / "ck"))).manifest.step == 0


def test_preemption_signal_saves_once_more_and_stops(tmp_path) -> None:
    root = str(tmp_path / "ck")
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        checkpointer = shardckpt.Checkpointer(root, every_steps=100, preemption_signals=(signal.SIGUSR1,))
        assert not checkpointer.maybe_save(3, _state(3.0))
        os.kill(os.getpid(), signal.SIGUSR1)
        assert checkpointer.maybe_save(4, _state(4.0))
        assert checkpointer.should_stop
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert shardckpt.latest(root).endswith("step-00000004")


def test_async_save_names_a_tensor_it_cannot_stage(tmp_path) -> None:
    """The staging copy runs before the save's own checks: a sparse tensor is named there, not by torch."""
    checkpointer = shardckpt.Checkpointer(str(tmp_path / "ck"), every_steps=1, async_save=True, preemption_signals=())
    with pytest.raises(shardckpt.ShardckptUsageError, match="'emb'.*sparse"):
        checkpointer.maybe_save(1, {"w": torch.ones(2), "emb": torch.ones(2, 2).to_sparse()})
    assert not (tmp_path / "ck").exists()
