"""`shardckpt goodput` through the real entry point: a history written by the Checkpointer itself (a crash, a
preemption, a clean end, on a scripted clock) gives exact per-run and total figures, a table that fits 80 and 60
columns, strict JSON and a timeline plot."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardckpt

ENTRY_POINT = str(Path(sys.executable).with_name("shardckpt"))


def cli(*args: str, columns: int = 80) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": str(columns)}
    return subprocess.run([ENTRY_POINT, *args], capture_output=True, text=True, timeout=120, env=env)


class Clock:
    """Unix seconds that move only when the test says (and the next values of `script`, when set, first)."""

    def __init__(self, now: float) -> None:
        self.now, self.script = now, []

    def __call__(self) -> float:
        return self.script.pop(0) if self.script else self.now


def _history(root: str) -> None:
    """Run A (from t=1010) crashes after saving at steps 5 and 10 (t=1052, 1104); run B resumes at t=1200 (a 3 s
    load), saves at 15 and, preempted, at 17 (t=1255, 1277); run C resumes at t=1300 (1 s), saves 20 (t=1333) and
    ends cleanly. Each save stalls training 2 s; each step takes 10 s."""
    clock = Clock(1000.0)
    weights = {"w": torch.zeros(4)}

    def state() -> dict:
        clock.now += 2  # building and saving the state: the stall
        return weights

    def options(**extra: object) -> dict:
        return {"every_steps": 5, "record_failures": True, "clock": clock, "preemption_signals": (), **extra}

    a = shardckpt.Checkpointer(root, **options())
    for step in range(1, 13):
        clock.now += 10
        a.maybe_save(step, state)
    # crash: no close()
    clock.now, clock.script = 1200.0, [1200.0, 1203.0]
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        b = shardckpt.Checkpointer(root, **options(preemption_signals=(signal.SIGUSR1,)))
        assert b.restore_latest({"w": torch.zeros(4)}) == 10
        clock.now = 1203.0
        for step in range(11, 18):
            clock.now += 10
            if step == 17:
                os.kill(os.getpid(), signal.SIGUSR1)
            b.maybe_save(step, state)
        assert b.should_stop
        b.close()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    clock.now, clock.script = 1300.0, [1300.0, 1301.0]
    c = shardckpt.Checkpointer(root, **options())
    assert c.restore_latest({"w": torch.zeros(4)}) == 17
    clock.now = 1301.0
    for step in range(18, 21):
        clock.now += 10
        c.maybe_save(step, state)
    c.close()


def test_goodput_of_a_crash_a_preemption_and_a_clean_end(tmp_path) -> None:
    root = str(tmp_path / "run")
    _history(root)
    result = cli("goodput", "--json", root)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    runs = [
        (r["how"], r["saves"], r["wall"], r["stall"], r["load"], r["lost"], r["down"], r["every"], r["interval"])
        for r in report["runs"]
    ]
    assert runs == [
        ("crashed", 2, 94.0, 4.0, 0.0, 96.0, 0.0, 5, 52.0),
        ("preempted", 2, 77.001, 4.0, 3.0, 0.0, pytest.approx(22.999), 5, 22.0),
        ("clean", 1, 33.001, 2.0, 1.0, 0.0, 0.0, 5, None),
    ]
    total = report["total"]
    assert total["span"] == pytest.approx(323.001)
    assert total["useful"] == pytest.approx(190.002)
    assert total["useful"] + total["stall"] + total["load"] + total["lost"] + total["down"] == pytest.approx(
        total["span"]
    )
    assert (total["failures"], total["cost"], total["chosen"]) == (2, 2.0, 37.0)
    assert total["mtbf"] == pytest.approx(300.002 / 2)
    assert total["optimal_young"] == pytest.approx(math.sqrt(2 * 2.0 * 150.001))
    assert total["goodput"] == pytest.approx(190.002 / 323.001)

    for columns in (80, 60):
        text = cli("goodput", root, columns=columns)
        assert text.returncode == 0, text.stderr
        lines = text.stdout.splitlines()
        table = lines[: lines.index("")]
        assert all(len(line) <= columns for line in table), text.stdout
        ids = [row["run"][:8] for row in report["runs"]]
        assert [line.split()[0] for line in table[1:]] == ids  # each run named whole, in order
        assert "goodput 58.8%" in text.stdout and "failures 2, MTBF 2m30s" in text.stdout
        assert all(len(line) <= columns for line in lines), text.stdout


def test_goodput_plot_and_the_wrong_roots(tmp_path) -> None:
    root = str(tmp_path / "run")
    _history(root)
    figure = tmp_path / "timeline.png"
    drawn = cli("goodput", root, "--plot", str(figure))
    assert drawn.returncode == 0, drawn.stderr
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    missing = cli("goodput", str(tmp_path / "typo"))
    assert missing.returncode == 3 and "does not exist" in missing.stderr
    checkpoint = cli("goodput", shardckpt.latest(root))
    assert checkpoint.returncode == 2 and f"shardckpt goodput {root}" in checkpoint.stderr, checkpoint.stderr
    (tmp_path / "quiet").mkdir()
    quiet = cli("goodput", "--json", str(tmp_path / "quiet"))
    assert quiet.returncode == 0 and "record_failures=True" in json.loads(quiet.stdout)["note"]
