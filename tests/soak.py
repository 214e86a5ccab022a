"""Soak: the bundled training loop saves every step while a driver SIGKILLs a random rank at a random moment and
restarts the job with a random world size (1..4), again and again; then it counts what was lost.

    python -m tests.soak --minutes 10            # the long run (prints a table; exit 1 if anything was lost)
    python -m tests.soak --cycles 3 --seed 1     # a few cycles
    python -m tests.soak --minutes 10 --incremental   # frozen base, incremental saves (references to older ones)

After every cycle: every checkpoint ever seen committed is still committed with the same attempt and verifies
(every checksum, coverage, headers), unless retention legitimately pruned it (keep_last newer ones exist); the
resumed run restored exactly the step latest() named; and where the world size did not change, its first loss is
bit-identical to the loss the run that wrote that checkpoint computed for the same step from its memory. At the
end, gc removes the debris of the killed saves and the survivors verify again. With --incremental the loop
freezes its base and saves incrementally (a full save every third): kills land in saves that reference older
checkpoints, retention and gc must keep what the survivors reference, and verify reads the referenced bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import shardckpt
from shardckpt.catalog.chain import read_commit_marker
from shardckpt.ops.gc import gc
from shardckpt.ops.verify import verify
from shardckpt.storage import open_storage

RESUMED = re.compile(r"resumed (?:from \S+ )?at step (\d+) on (\d+) ranks")
MODES = ("random", "after-step")
RELATIVE_TOLERANCE = 1e-4  # another world size only reorders float sums (tests/train/test_train.py)


@dataclass
class Cycle:
    number: int
    world: int
    expected_resume: int | None  # the step latest() named before the launch
    mode: str = "random"  # when to kill: "random" (0..2.5 s into training) or "after-step" (during a save)
    resumed: int | None = None  # the step the job says it restored
    killed_rank: int | None = None
    kill_after: float = 0.0
    steps: dict[int, dict] = field(default_factory=dict)  # step -> loss log row
    returncode: int | None = None
    output: str = ""


@dataclass
class SoakReport:
    cycles: list[Cycle] = field(default_factory=list)
    committed_seen: set[str] = field(default_factory=set)
    referencing_seen: set[str] = field(default_factory=set)  # committed ones that store pieces by reference
    pruned: set[str] = field(default_factory=set)
    lost: list[str] = field(default_factory=list)  # checkpoints that vanished, changed or stopped verifying
    wrong_resumes: list[str] = field(default_factory=list)  # restored another step than latest() named
    exact: int = 0  # same world size: first loss after the resume compared bit for bit
    not_exact: list[str] = field(default_factory=list)
    close: int = 0  # other world size: first loss within RELATIVE_TOLERANCE
    not_close: list[str] = field(default_factory=list)
    kills_during_save: int = 0  # the kill interrupted a save: it left an uncommitted checkpoint directory
    failures: list[str] = field(default_factory=list)  # a job that died by itself, gc errors
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        problems = self.lost or self.wrong_resumes or self.not_exact or self.not_close or self.failures
        return not problems and bool(self.cycles)


def _committed(root: str, referencing: set[str] | None = None) -> dict[str, tuple[int, str]]:
    """name -> (step, attempt) of every committed checkpoint under `root`; `referencing` collects name@attempt of
    those that store pieces by reference (format 1.1)."""
    storage = open_storage(root)
    found = {}
    for name in storage.list():
        marker = read_commit_marker(storage.child(name))
        if marker is not None and marker.step is not None:
            found[name] = (marker.step, marker.attempt)
            if referencing is not None and marker.references:
                referencing.add(f"{name}@{marker.attempt}")
    return found


def _losses(path: Path) -> dict[int, dict]:
    if not path.exists():
        return {}
    rows = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[row["step"]] = row
    return rows


def _run_cycle(
    cycle: Cycle, root: str, work: Path, rng: random.Random, keep_last: int, steps: int, incremental: bool
) -> None:
    log, pids, out = work / f"loss-{cycle.number}.jsonl", work / f"pids-{cycle.number}", work / f"out-{cycle.number}"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cycle.world}"]
    command += ["--monitor-interval=0.2", "-m", "shardckpt.train", "--ckpt", root, "--steps", str(steps)]
    command += ["--ckpt-every", "1", "--keep-last", str(keep_last), "--resume", "--cpu"]
    command += ["--loss-log", str(log), "--pid-dir", str(pids)]
    if incremental:
        command += ["--freeze-base", "--incremental", "--full-every", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(out, "wb") as sink:
        job = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 180
            while not _losses(log) and job.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)  # wait until it trains (resume done), then strike at a random moment
            if job.poll() is None and _losses(log):
                began = time.monotonic()
                if cycle.mode == "random":
                    time.sleep(rng.uniform(0.0, 2.5))
                else:  # right after a step is logged: while its checkpoint is being written
                    logged = len(_losses(log))
                    while len(_losses(log)) == logged and job.poll() is None and time.monotonic() < deadline:
                        time.sleep(0.01)
                cycle.kill_after = time.monotonic() - began
                if job.poll() is None:
                    cycle.killed_rank = rng.randrange(cycle.world)
                    os.kill(int((pids / f"rank-{cycle.killed_rank}.pid").read_text()), signal.SIGKILL)
            job.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
    cycle.returncode = job.returncode
    cycle.output = out.read_text(errors="replace")
    cycle.steps = _losses(log)
    found = RESUMED.search(cycle.output)
    cycle.resumed = int(found.group(1)) if found else None


def _check(report: SoakReport, root: str, keep_last: int, cycle: Cycle, history: list[Cycle]) -> None:
    now = _committed(root, report.referencing_seen)
    current = {f"{name}@{attempt}" for name, (_, attempt) in now.items()}
    for seen in sorted(report.committed_seen - current - report.pruned):
        step = int(seen.split("@")[0].split("-")[1])
        if sum(1 for s, _ in now.values() if s > step) >= keep_last:
            report.pruned.add(seen)  # retention may delete it: keep_last newer ones exist
        else:
            report.lost.append(f"{seen}: gone or changed after cycle {cycle.number} and not beyond keep_last")
    report.committed_seen |= current
    for name in now:
        if not verify(f"{root}/{name}").ok:
            report.lost.append(f"{name}: does not verify after cycle {cycle.number}")
    if cycle.steps:
        interrupted = Path(root) / f"step-{max(cycle.steps):08d}"
        report.kills_during_save += interrupted.is_dir() and not (interrupted / "COMMITTED").exists()
    if cycle.resumed != cycle.expected_resume:
        report.wrong_resumes.append(
            f"cycle {cycle.number}: latest was {cycle.expected_resume}, restored {cycle.resumed}"
        )
    if cycle.resumed is None or cycle.resumed + 1 not in cycle.steps:
        return
    step = cycle.resumed
    writer = next((c for c in reversed(history) if step in c.steps), None)  # the run that saved that checkpoint
    if writer is None or step + 1 not in writer.steps:
        return
    mine, theirs = cycle.steps[step + 1], writer.steps[step + 1]
    label = f"cycle {cycle.number} (W={cycle.world}) resumed step {step} of cycle {writer.number} (W={writer.world})"
    if writer.world == cycle.world:
        if mine["loss_hex"] == theirs["loss_hex"]:
            report.exact += 1
        else:
            report.not_exact.append(f"{label}: loss {mine['loss']} != {theirs['loss']}")
    elif math.isclose(mine["loss"], theirs["loss"], rel_tol=RELATIVE_TOLERANCE):
        report.close += 1
    else:
        report.not_close.append(f"{label}: loss {mine['loss']} vs {theirs['loss']}")


def run_soak(
    root: str,
    *,
    cycles: int | None = None,
    seconds: float | None = None,
    worlds: Sequence[int] | None = None,
    modes: Sequence[str] | None = None,
    max_world: int = 4,
    keep_last: int = 3,
    seed: int = 0,
    steps: int = 100_000,
    incremental: bool = False,
    say: Callable[[str], None] = print,
) -> SoakReport:
    """Run kill/restart cycles until `cycles` are done or `seconds` have passed (whichever is given first)."""
    rng = random.Random(seed)
    report = SoakReport()
    work = Path(tempfile.mkdtemp(prefix="soak-"))
    began = time.monotonic()
    history: list[Cycle] = []
    number = 0
    while (cycles is None or number < cycles) and (seconds is None or time.monotonic() - began < seconds):
        number += 1
        world = worlds[(number - 1) % len(worlds)] if worlds else rng.randint(1, max_world)
        latest = shardckpt.latest(root)
        expected = shardckpt.open(latest).step if latest else None
        cycle = Cycle(number, world, expected, modes[(number - 1) % len(modes)] if modes else rng.choice(MODES))
        _run_cycle(cycle, root, work, rng, keep_last, steps, incremental)
        if cycle.killed_rank is None:
            report.failures.append(f"cycle {number}: the job ended before it was killed:\n{cycle.output[-3000:]}")
        _check(report, root, keep_last, cycle, history)
        history.append(cycle)
        report.cycles.append(cycle)
        last = max(cycle.steps) if cycle.steps else None
        say(
            f"cycle {number}: W={world} ({cycle.mode}) resumed {cycle.resumed} trained to {last}, "
            f"killed rank {cycle.killed_rank} after {cycle.kill_after:.2f} s; committed now {sorted(_committed(root))}"
        )
    plan = gc(root, keep_last=keep_last, grace=0)
    if not plan.ok:
        report.failures.append(f"gc failed: {[a.error for a in plan.actions if a.error]}")
    for name in _committed(root):
        if not verify(f"{root}/{name}").ok:
            report.lost.append(f"{name}: does not verify after gc")
    report.seconds = time.monotonic() - began
    return report


def table(report: SoakReport) -> str:
    cycles = len(report.cycles)
    worlds = sorted({c.world for c in report.cycles})
    survived = sum(1 for c in report.cycles if c.killed_rank is not None)
    rows = [
        "| fault | tried | survived | data lost |",
        "|---|---|---|---|",
        f"| SIGKILL of a random rank at a random moment, save every step, restart on W in {worlds} "
        f"| {cycles} cycles | {survived} | {len(report.lost)} checkpoints |",
        f"| ... of which the kill left an uncommitted save behind | {report.kills_during_save} | "
        f"{report.kills_during_save} | 0 |",
        f"| resume, same world size: first loss bit-identical | {report.exact + len(report.not_exact)} "
        f"| {report.exact} | {len(report.not_exact)} not bit-exact |",
        f"| resume, other world size: right step, loss within 1e-4 | {report.close + len(report.not_close)} "
        f"| {report.close} | {len(report.not_close) + len(report.wrong_resumes)} wrong |",
    ]
    summary = (
        f"{cycles} cycles in {report.seconds:.0f} s; {len(report.committed_seen)} checkpoints committed, "
        f"{len(report.pruned)} pruned by keep_last, {len(report.lost)} lost; "
        f"{len(report.referencing_seen)} stored pieces by reference; restores not bit-exact: "
        f"{len(report.not_exact) + len(report.not_close) + len(report.wrong_resumes)}"
    )
    return "\n".join([*rows, "", summary])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, help="run for this long (default: 10 unless --cycles is given)")
    parser.add_argument("--cycles", type=int, help="stop after this many kill/restart cycles")
    parser.add_argument("--root", help="checkpoint root (default: a new temporary directory)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep-last", type=int, default=3)
    parser.add_argument("--max-world", type=int, default=4)
    parser.add_argument("--incremental", action="store_true", help="freeze the base, save incrementally")
    args = parser.parse_args(argv)
    seconds = args.minutes * 60 if args.minutes is not None else (None if args.cycles else 600.0)
    root = args.root or tempfile.mkdtemp(prefix="soak-root-")
    report = run_soak(
        root,
        cycles=args.cycles,
        seconds=seconds,
        keep_last=args.keep_last,
        max_world=args.max_world,
        seed=args.seed,
        incremental=args.incremental,
    )
    print(table(report))
    for problem in report.lost + report.wrong_resumes + report.not_exact + report.not_close + report.failures:
        print(f"PROBLEM: {problem}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
