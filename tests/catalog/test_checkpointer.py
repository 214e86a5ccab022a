"""Checkpointer: cadence, retention, restore_latest, async saves from staging copies, preemption signals."""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings

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


class _FakeClock:
    """Unix seconds that move only when the test says so: step times and save costs without sleeping."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_auto_cadence_follows_youngs_rule_from_the_recorded_failures(tmp_path) -> None:
    """A run that crashed (a start without an end) 1000 s before this one: after the first save at the default
    interval, every sqrt(2 x 2 s x MTBF) seconds at 1 s per step, MTBF growing with this run's time."""
    from shardckpt.catalog.events import EVENTS_DIR, RESTART, START, Event, read_events, record_event
    from shardckpt.storage import LocalStorage

    root = str(tmp_path / "ck")
    t0 = 1_700_000_000.0
    record_event(LocalStorage(root), Event(START, "earlier", int(t0 * 1000)))
    clock = _FakeClock(t0 + 1000)
    decisions: list = []
    saved: list = []
    checkpointer = shardckpt.Checkpointer(
        root,
        every_steps="auto",
        default_every_steps=5,
        mtbf_prior_seconds=0.0,
        keep_last=1,
        preemption_signals=(),
        clock=clock,
        on_cadence=decisions.append,
        on_save=saved.append,
    )

    def state() -> dict:
        clock.now += 2.0  # what each save costs the training thread
        return _state(1.0)

    for step in range(1, 141):
        clock.now += 1.0
        checkpointer.maybe_save(step, state)
    checkpointer.close()
    # At the first save the run that crashed ran 1001 s (until this one began), this one 6 s: MTBF 1007 s,
    # sqrt(2 x 2 x 1007) = 63.5 s = 63 steps; at step 68 MTBF is 1072 s: sqrt(4288) = 65.5 s = 65 steps; at step
    # 133, 1139 s: 67 steps.
    assert [(d.reason, d.steps) for d in decisions] == [("default", 5), ("young", 63), ("young", 65), ("young", 67)]
    assert [record.step for record in saved] == [5, 68, 133]
    assert decisions[1].mtbf_seconds == pytest.approx(1007.0) and decisions[1].cost_seconds == 2.0
    assert decisions[1].failures == 1 and "1 failure(s)" in decisions[1].why, decisions[1].why
    events = read_events(LocalStorage(root), 10).events
    kinds = [(e.kind, e.run == checkpointer.run_id, e.after) for e in events if e.kind != "save"]
    assert kinds == [("end", True, None), (RESTART, True, "crash"), (START, False, None)]
    # Each committed save is in the history too (for `shardckpt goodput`): its stall and the interval then.
    saves = [(e.step, e.stall_ms, e.every) for e in events if e.kind == "save"]
    assert saves == [(133, 2000, 65), (68, 2000, 63), (5, 2000, 5)]  # each under the interval that chose it
    assert sorted(os.listdir(root)) == [EVENTS_DIR, "step-00000133"]


def test_a_crashed_run_counts_until_its_last_checkpoint_not_while_the_job_waited(tmp_path) -> None:
    """Issue 23 (also found): run A starts, commits a checkpoint 1000 s in, crashes; the job waits 3000 s to be
    rescheduled. Run B counts A's 1000 s (A's checkpoint's creation time), not 4000 s."""
    root = str(tmp_path / "ck")
    began = time.time() - 1000.0  # A's checkpoint below is created now, 1000 s after A's start
    first = shardckpt.Checkpointer(
        root, every_steps="auto", mtbf_prior_seconds=0.0, preemption_signals=(), clock=_FakeClock(began)
    )
    first.maybe_save(1, _state(1.0), force=True)  # then A crashes: no close(), no end event
    clock = _FakeClock(began + 4000.0)
    second = shardckpt.Checkpointer(
        root, every_steps="auto", mtbf_prior_seconds=0.0, preemption_signals=(), clock=clock
    )
    assert second.restore_latest(_state(0.0)) == 1
    second.maybe_save(2, _state(2.0))
    clock.now += 10.0
    second.maybe_save(3, _state(3.0))
    clock.now += 10.0
    second.maybe_save(4, _state(3.0), force=True)
    second.close()
    assert second.cadence is not None and second.cadence.reason == "young", second.cadence
    # One failure: A's ~1000 s (the seconds this test itself takes blur it a little) + B's 20 s; main said 4020 s.
    assert second.cadence.mtbf_seconds is not None and 1000 <= second.cadence.mtbf_seconds < 1300, second.cadence


def test_an_event_stamped_in_the_year_9999_does_not_stop_the_recording_of_later_ones(tmp_path) -> None:
    """Issue 23 (also found): each new event stepped past the newest one known, so one valid event of 9999-12-31
    put every later event beyond the last valid time: none was recorded again. It is not counted either."""
    from shardckpt.catalog.events import MAX_TIME_MS, START, Event, read_events, record_event
    from shardckpt.storage import LocalStorage

    root = str(tmp_path / "ck")
    record_event(LocalStorage(root), Event(START, "future", MAX_TIME_MS))
    clock = _FakeClock(1_700_000_000.0)
    decisions: list = []
    for run in range(2):
        ckpt = shardckpt.Checkpointer(
            root, every_steps="auto", mtbf_prior_seconds=0.0, preemption_signals=(), clock=clock,
            on_cadence=decisions.append,
        )  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "cannot record a start event" was a warning
            ckpt.maybe_save(10 * run + 1, _state(1.0))
            clock.now += 5.0
            ckpt.maybe_save(10 * run + 2, _state(1.0), force=True)
            ckpt.close()
        clock.now += 100.0
    # The save events (format 1.1) between them are not what this test is about.
    events = [e for e in read_events(LocalStorage(root), 20).events if e.kind != "save"]
    # Newest name first: the 9999 one, then this test's two runs (the first a start: nothing ran before it).
    assert [(e.kind, e.run == "future", e.after) for e in events] == [
        ("start", True, None), ("end", False, None), ("restart", False, "clean"), ("end", False, None),
        ("start", False, None),
    ]  # fmt: skip
    assert all(d.reason == "default" for d in decisions)
    assert ckpt.cadence is not None and "1 run(s) stamped after" in ckpt.cadence.why, ckpt.cadence


def test_a_preemption_is_recorded_and_the_next_run_counts_it(tmp_path) -> None:
    from shardckpt.catalog.events import read_events
    from shardckpt.storage import LocalStorage

    root = str(tmp_path / "ck")
    clock = _FakeClock(1_700_000_000.0)
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        first = shardckpt.Checkpointer(
            root, every_steps="auto", default_every_steps=100, clock=clock, preemption_signals=(signal.SIGUSR1,)
        )
        assert not first.maybe_save(1, _state(1.0))
        os.kill(os.getpid(), signal.SIGUSR1)
        clock.now += 50.0
        assert first.maybe_save(2, _state(2.0)) and first.should_stop
        first.close()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    clock.now += 10.0
    second = shardckpt.Checkpointer(root, every_steps="auto", clock=clock, preemption_signals=())
    assert second.restore_latest(_state(0.0)) == 2
    second.close()
    events = read_events(LocalStorage(root), 10).events
    assert [(e.kind, e.step, e.after) for e in events] == [
        ("end", 2, None),
        ("restart", 2, "preemption"),
        ("preemption", 2, None),
        ("save", 2, None),  # the checkpoint the signal asked for, committed just before
        ("start", None, None),
    ]


def test_auto_cadence_arguments(tmp_path) -> None:
    root = str(tmp_path / "ck")
    capped = shardckpt.Checkpointer(
        root, every_steps="auto", default_every_steps=10, max_every_steps=4, preemption_signals=()
    )
    assert (capped.auto, capped.every_steps, capped.record_failures) == (True, 4, True)
    fixed = shardckpt.Checkpointer(root, every_steps=7, preemption_signals=())
    assert (fixed.auto, fixed.every_steps, fixed.record_failures) == (False, 7, False)
    for bad in (dict(every_steps="often"), dict(every_steps="auto", default_every_steps=0), dict(min_every_steps=0)):
        with pytest.raises(shardckpt.ShardckptUsageError):
            shardckpt.Checkpointer(root, preemption_signals=(), **bad)
    assert not os.path.exists(root)  # nothing is written before the run starts
