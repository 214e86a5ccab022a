"""The automatic checkpoint cadence: Young's rule, clamping, the MTBF estimate, and the failure history under a root
(ROOT/events/, SPEC 14.1) read as hostile input, newest first and bounded; ls, du, gc and retention leave it alone."""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path

import pytest

import shardckpt
from shardckpt.catalog.cadence import Bounds, History, Measurements, choose, estimate_mtbf, history_of, young_interval
from shardckpt.catalog.events import (
    END,
    EVENTS_DIR,
    MAX_EVENT_BYTES,
    PREEMPTION,
    RESTART,
    START,
    Event,
    EventWarning,
    decode_event,
    encode_event,
    prune_events,
    read_events,
    record_event,
)
from shardckpt.errors import FormatError, ShardckptUsageError
from shardckpt.ops.du import disk_usage
from shardckpt.ops.gc import gc
from shardckpt.ops.ls import list_checkpoints
from shardckpt.storage import LocalStorage
from shardckpt.testing.faults import FaultyStorage
from tests.helpers.checkpoints import sample_state, save_sharded

T0 = 1_700_000_000_000  # a Unix time in milliseconds


def _history(failures: int, exposure: float) -> History:
    return History(failures, exposure, failures + 1, "ROOT/events")


def _choose(cost: float, mtbf_failures: int, exposure: float, step: float, bounds: Bounds | None = None):
    return choose(
        7,
        bounds or Bounds(),
        cost=(cost, "measured"),
        step_seconds=(step, "measured"),
        history=_history(mtbf_failures, exposure),
        prior_seconds=0.0,
    )


def test_young_interval_numbers() -> None:
    assert young_interval(2.0, 1000.0) == pytest.approx(math.sqrt(4000.0))  # 63.25 s
    assert young_interval(10.0, 3600.0) == pytest.approx(268.328, abs=1e-3)
    assert young_interval(0.0, 3600.0) == 0.0
    assert young_interval(600.0, 1000.0) == 1000.0  # cost >= MTBF / 2: every MTBF (Daly), not sqrt(2CM) = 1095 s
    with pytest.raises(ShardckptUsageError):
        young_interval(1.0, 0.0)
    decision = _choose(2.0, 1, 1000.0, 0.5)  # 63.25 s at 0.5 s/step
    assert (decision.reason, decision.steps, decision.failures) == ("young", 126, 1)
    assert decision.mtbf_seconds == 1000.0 and decision.cost_seconds == 2.0
    assert "sqrt(2 x cost 2 s x MTBF 1000 s) = 63.2 s" in decision.why, decision.why


def test_the_interval_is_clamped_by_seconds_then_steps() -> None:
    by_seconds = _choose(2.0, 1, 1000.0, 1.0, Bounds(max_seconds=30.0))
    assert by_seconds.steps == 30 and by_seconds.seconds == 30.0
    assert "63.2 s clamped to 30 s" in by_seconds.why, by_seconds.why
    assert _choose(2.0, 1, 1000.0, 1.0, Bounds(min_seconds=100.0)).steps == 100
    by_steps = _choose(2.0, 1, 1000.0, 1.0, Bounds(max_steps=20))
    assert by_steps.steps == 20 and "63 steps clamped to 20" in by_steps.why, by_steps.why
    assert _choose(2.0, 1, 1000.0, 1.0, Bounds(min_steps=80)).steps == 80
    assert _choose(0.0, 1, 1000.0, 1.0).steps == 1  # a free checkpoint: every step, never 0
    for bad in (dict(min_steps=0), dict(min_steps=5, max_steps=4), dict(min_seconds=-1.0), dict(max_seconds=0.0)):
        with pytest.raises(ShardckptUsageError):
            Bounds(**bad)


def test_without_a_failure_a_cost_or_a_step_time_the_default_stays() -> None:
    no_failure = choose(
        7, Bounds(), cost=(2.0, "m"), step_seconds=(1.0, "m"), history=_history(0, 5000.0), prior_seconds=0.0
    )
    assert (no_failure.steps, no_failure.reason) == (7, "default")
    assert "no failure recorded in ROOT/events" in no_failure.why
    unread = choose(7, Bounds(), cost=(2.0, "m"), step_seconds=(1.0, "m"), history=None, prior_seconds=0.0)
    no_cost = choose(7, Bounds(), cost=None, step_seconds=(1.0, "m"), history=_history(3, 10.0), prior_seconds=0.0)
    no_step = choose(7, Bounds(), cost=(2.0, "m"), step_seconds=None, history=_history(3, 10.0), prior_seconds=0.0)
    assert [d.steps for d in (unread, no_cost, no_step)] == [7, 7, 7]
    assert "no checkpoint cost" in no_cost.why and "no step time" in no_step.why


def test_mtbf_is_running_time_over_failures_with_a_prior_of_one_failure() -> None:
    assert estimate_mtbf(_history(0, 1000.0), 3600.0) is None
    assert estimate_mtbf(_history(2, 1000.0), 0.0) == 500.0
    assert estimate_mtbf(_history(2, 1000.0), 3600.0) == pytest.approx(4600.0 / 3)


def test_history_counts_runs_without_a_clean_end_as_failures() -> None:
    events = [
        Event(START, "a", T0),
        Event(END, "a", T0 + 100_000, 10),  # clean: 100 s, no failure
        Event(RESTART, "b", T0 + 200_000, 10, "clean"),  # crashed: ran until c started, 300 s
        Event(RESTART, "c", T0 + 500_000, 12, "crash"),
        Event(PREEMPTION, "c", T0 + 800_000, 20),  # preempted after 300 s
        Event(RESTART, "d", T0 + 1_000_000, 20, "preemption"),  # the current run: 500 s so far
    ]
    history = history_of(list(reversed(events)), "d", T0 + 1_500_000, "ROOT/events")
    assert (history.failures, history.exposure_seconds, history.runs) == (2, 1200.0, 4)
    lone_end = history_of([Event(END, "x", T0)], "d", T0 + 10, "ROOT/events")  # no start: not a run
    assert (lone_end.failures, lone_end.runs) == (0, 0)


def test_measurements_take_medians_and_leave_the_save_out_of_step_time() -> None:
    measured = Measurements(window=3)
    for step, now in ((1, 0.0), (2, 1.0), (3, 2.0), (4, 30.0)):  # one slow step
        measured.step_seen(step, now)
    measured.saved(4, 5.0, 60.0, asynchronous=True)  # the save's 30 s are not step time
    measured.step_seen(5, 61.0)
    assert measured.step_seconds() == (1.0, "median of the last 3 step(s)")
    measured.saved(5, 1.0, 62.0, asynchronous=True)
    measured.saved(6, 2.0, 63.0, asynchronous=True)
    assert measured.cost() == (2.0, "median training stall of the last 3 save(s)")


def test_an_event_round_trips_and_hostile_fields_are_refused() -> None:
    event = Event(RESTART, "0123abcd", T0, 12, "crash")
    assert decode_event(encode_event(event), "e") == event
    base = json.loads(encode_event(event))
    cases = {
        "kind": {**base, "kind": "reboot"},
        "run": {**base, "run": "../x"},
        "time_ms": {**base, "time_ms": True},
        "step": {**base, "step": -1},
        "after": {**base, "kind": START, "after": "crash"},
        "format": {**base, "format": "other"},
        "version": {**base, "version": [2, 0]},
    }
    for field, document in cases.items():
        with pytest.raises(FormatError, match=field if field != "version" else "2.0 is not supported"):
            decode_event(json.dumps(document).encode(), "e")
    assert decode_event(json.dumps({**base, "later": 1}).encode(), "e") == event  # unknown keys are ignored


def _event_file(root: Path, time_ms: int, data: bytes, nonce: str = "0123456789abcdef") -> None:
    (root / EVENTS_DIR).mkdir(parents=True, exist_ok=True)
    (root / EVENTS_DIR / f"{time_ms:015d}-{nonce}.json").write_bytes(data)


def test_hostile_event_files_are_skipped_with_a_warning(tmp_path: Path) -> None:
    root = LocalStorage(str(tmp_path / "root"))
    good = [Event(START, "a", T0), Event(END, "a", T0 + 5)]
    for event in good:
        _event_file(tmp_path / "root", event.time_ms, encode_event(event))
    hostile = [
        b"not json",
        b'{"format": "shardckpt-event", "format": "twice"}',  # a repeated key
        b'{"format": "shardckpt-event", "version": [1, 0], "kind": "start", "run": "a", "time_ms": NaN}',
        b"[" * 3000 + b"]" * 3000,  # deep nesting inside the size limit
        b"\xff\xfe" + b"x" * 10,  # not UTF-8
        b" " * (MAX_EVENT_BYTES + 1),  # too large: refused before it is read
        encode_event(Event(START, "b", T0 + 999)),  # its name says another time
        json.dumps({"format": "shardckpt-event", "version": [1, 0], "kind": "end", "run": "a"}).encode(),
    ]
    for index, data in enumerate(hostile):
        _event_file(tmp_path / "root", T0 + 100 + index, data)
    (tmp_path / "root" / EVENTS_DIR / "README").write_text("not an event")
    (tmp_path / "root" / EVENTS_DIR / f"{T0 + 200:015d}-fedcba9876543210.json").mkdir()  # a directory
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        log = read_events(root, 100)
    assert list(log.events) == list(reversed(good))
    assert len(log.skipped) == len(hostile) + 2, log.skipped  # + the foreign name and the directory
    assert len([w for w in caught if w.category is EventWarning]) == len(log.skipped)
    assert any("over the 4096 byte limit" in message for message in log.skipped), log.skipped


def test_many_event_files_are_read_newest_first_and_bounded(tmp_path: Path) -> None:
    inner = LocalStorage(str(tmp_path / "root"))
    for index in range(40):
        record_event(inner, Event(START, f"r{index}", T0 + index))
    root = FaultyStorage(inner)
    log = read_events(root, 8)
    assert [event.run for event in log.events] == [f"r{index}" for index in range(39, 31, -1)]
    assert log.listed == 40
    reads = [path for op, path in root.calls if op.startswith("read")]
    assert len(reads) == 8 and len(set(reads)) == 8, root.calls
    assert len(prune_events(inner, 10)) == 30
    assert [event.run for event in read_events(inner, 100).events] == [f"r{index}" for index in range(39, 29, -1)]


def test_ls_du_gc_latest_and_retention_leave_the_events_alone(tmp_path: Path) -> None:
    root = tmp_path / "root"
    for step in (1, 2):
        save_sharded(sample_state(step), str(root / f"step-{step:08d}"), 1, step=step)
    record_event(LocalStorage(str(root)), Event(START, "a", T0))
    events = sorted(os.listdir(root / EVENTS_DIR))
    assert [row["name"] for row in list_checkpoints(str(root))["checkpoints"]] == ["step-00000001", "step-00000002"]
    assert [usage.name for usage in disk_usage(str(root)).checkpoints] == ["step-00000001", "step-00000002"]
    assert shardckpt.latest(str(root)) == str(root / "step-00000002")
    plan = gc(str(root), keep_last=1, grace=0.0)
    assert plan.ok and [action.checkpoint for action in plan.actions] == ["step-00000001"]
    assert EVENTS_DIR not in {skipped.checkpoint for skipped in plan.skipped}  # not a checkpoint: nothing to say
    checkpointer = shardckpt.Checkpointer(str(root), every_steps=1, keep_last=1, preemption_signals=())
    checkpointer.maybe_save(3, sample_state(3))
    checkpointer.close()
    assert sorted(os.listdir(root)) == [EVENTS_DIR, "step-00000003"]
    assert sorted(os.listdir(root / EVENTS_DIR)) == events  # fixed every_steps records nothing by default


def test_a_crashed_run_ran_until_its_last_checkpoint_not_until_the_next_run_started() -> None:
    """Issue 23 (also found): a crash leaves no event; counting the crashed run until the next start counted the
    hour the job waited to be rescheduled as running time. Its newest checkpoint the root holds bounds it."""
    events = [Event(START, "a", T0), Event(RESTART, "b", T0 + 3_600_000, 10, "crash")]
    now = T0 + 3_700_000
    # a committed a checkpoint at 600 s; one before a began and one of b's time are not a's signs of life.
    saved = [T0 - 5_000, T0 + 600_000, T0 + 3_650_000]
    history = history_of(events, "b", now, "ROOT/events", saved)
    assert (history.failures, history.exposure_seconds) == (1, 600.0 + 100.0)
    # Without a checkpoint of its own time, the next start is the only bound left (as before).
    assert history_of(events, "b", now, "ROOT/events", [T0 + 3_650_000]).exposure_seconds == 3600.0 + 100.0


def test_a_run_stamped_after_now_is_left_out_and_a_later_end_counts_as_the_next_start() -> None:
    """Issue 23 (also found): a run whose clock is a day ahead, a crash counted with no running time at all: with
    --ckpt-mtbf-prior 0 its MTBF was this run's few seconds, an interval of one step. It is left out now; an end
    stamped after now (a clock ahead) still says the run ended cleanly, and it ran until the next run began."""
    now = T0 + 10_000
    events = [Event(START, "ahead", T0 + 86_400_000), Event(RESTART, "b", T0, 10, "crash")]
    history = history_of(events, "b", now, "ROOT/events")
    assert (history.failures, history.exposure_seconds, history.runs) == (0, 10.0, 1)  # main: 1 failure in 10 s
    assert history.ahead == 1
    cadence = choose(
        7, Bounds(), cost=(2.0, "measured"), step_seconds=(1.0, "measured"), history=history, prior_seconds=0.0
    )
    assert (cadence.steps, cadence.reason) == (7, "default") and "1 run(s) stamped after" in cadence.why
    clean = [Event(START, "a", T0 - 50_000), Event(END, "a", now + 5_000), Event(RESTART, "b", T0, 3, "clean")]
    history = history_of(clean, "b", now, "ROOT/events")
    assert (history.failures, history.exposure_seconds, history.ahead) == (0, 50.0 + 10.0, 0)  # a: until b began
