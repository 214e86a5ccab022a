"""The bundled training loop with --ckpt-every auto on two ranks: a kill -9 leaves a start without an end in
ROOT/events/; the restarted run records a restart after a crash and logs an interval derived from that failure."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

import shardckpt
from shardckpt.catalog.events import EVENTS_DIR, RESTART, START, read_events
from shardckpt.storage import LocalStorage
from tests.helpers.training import losses, torchrun

pytestmark = pytest.mark.dist

SMALL = ["--cpu", "--d-model", "16", "--layers", "1", "--heads", "2", "--global-batch", "4"]
AUTO = ["--ckpt-every", "auto", "--ckpt-every-default", "3", "--ckpt-every-max", "4", "--ckpt-mtbf-prior", "0"]


def test_a_kill_is_recorded_and_the_restart_logs_an_interval_from_it(tmp_path: Path) -> None:
    root, pids, log = tmp_path / "ck", tmp_path / "pids", str(tmp_path / "loss.jsonl")
    common = ["--ckpt", str(root), *AUTO, *SMALL]
    job = torchrun(2, *common, "--steps", "1000", "--pid-dir", str(pids), "--loss-log", log, wait=False)
    deadline = time.monotonic() + 240
    while not (os.path.exists(log) and max(losses(log)) >= 4):  # past the first save, at the default step 3
        assert job.poll() is None, job.communicate()[0].decode(errors="replace")[-4000:]
        assert time.monotonic() < deadline, "the 2-rank job did not reach step 4"
        time.sleep(0.05)
    os.kill(int((pids / "rank-1.pid").read_text()), signal.SIGKILL)
    first = job.communicate(timeout=120)[0].decode(errors="replace")
    assert job.returncode != 0
    assert "checkpoint interval: every 3 steps, the default: no checkpoint cost measured yet" in first, first[-4000:]
    survivor = shardckpt.latest(str(root))
    assert survivor is not None
    step = shardckpt.open(survivor).step
    assert step is not None and step >= 3

    resumed = torchrun(2, *common, "--steps", str(step + 5), "--resume").communicate()[0].decode(errors="replace")
    every = read_events(LocalStorage(str(root)), 50).events
    events = [e for e in every if e.kind != "save"]  # each committed save is recorded too (for goodput)
    assert [(e.kind, e.after) for e in events] == [("end", None), (RESTART, "crash"), (START, None)], events
    assert events[1].step == step
    assert step in [e.step for e in every if e.kind == "save" and e.run == events[2].run]  # the crashed run's
    # The first save of the restarted run measures a cost; the interval then comes from 1 failure and is clamped
    # to --ckpt-every-max 4 (the cost of these tiny saves is milliseconds against seconds of run time).
    chosen = re.findall(r"\[train\] checkpoint interval: (every (\d+) steps\b.*)", resumed)
    assert len(chosen) >= 2, resumed[-4000:]
    assert chosen[0][1] == "3" and "the default" in chosen[0][0]
    why = chosen[1][0]
    assert "sqrt(2 x cost" in why and "over 1 failure(s)" in why and f"{root}/{EVENTS_DIR}" in why, why
    interval = int(chosen[1][1])
    assert 1 <= interval <= 4, why
    assert interval == 4 or "clamped" not in why, why
