"""Soak: the bundled training loop saves every step while a driver SIGKILLs a random rank at a random moment and
restarts the job with a random world size (1..4), again and again; then it counts what was lost.

    python -m tests.soak --minutes 10            # the long run (prints a table; exit 1 if anything was lost)
    python -m tests.soak --cycles 3 --seed 1     # a few cycles
    python -m tests.soak --minutes 10 --incremental   # frozen base, incremental saves (references to older ones)
    python -m tests.soak --minutes 10 --local-tier     # node-local tier, whole nodes killed and wiped

After every cycle: every checkpoint ever seen committed is still committed with the same attempt and verifies
(every checksum, coverage, headers), unless retention legitimately pruned it (keep_last newer ones exist); the
resumed run restored exactly the step latest() named; and where the world size did not change, its first loss is
bit-identical to the loss the run that wrote that checkpoint computed for the same step from its memory. At the
end, gc removes the debris of the killed saves and the survivors verify again. With --incremental the loop
freezes its base and saves incrementally (a full save every third): kills land in saves that reference older
checkpoints, retention and gc must keep what the survivors reference, and verify reads the referenced bytes.
With --local-tier every cycle runs the job as simulated nodes (one torchrun agent per node, each with a local tier
directory of its own; a local save every step, peers=1, a persistent one every 5th): the kill takes a whole node
(its agent and ranks, SIGKILL) and wipes its directory; the restart runs on the surviving nodes plus new, empty
ones, with another layout and world size at random, and must resume from the newest step complete across the
surviving directories (or the persistent one when that is newer), exactly as above.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import shardckpt
from shardckpt.catalog.chain import read_commit_marker
from shardckpt.catalog.local_tier import inventory
from shardckpt.ops.gc import gc
from shardckpt.ops.verify import verify
from shardckpt.storage import open_storage

RESUMED = re.compile(r"resumed (?:from (\S+) )?at step (\d+) on (\d+) ranks")
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
    layout: list[tuple[Path, int]] = field(default_factory=list)  # local tier: (node directory, ranks) per node
    killed_node: Path | None = None  # local tier: the node killed, whose directory was wiped
    source: str | None = None  # "local:<name>" when the resume took a local checkpoint


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
    local_resumes: int = 0  # resumes that took a local checkpoint (the local tier mode)
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


PERSISTENT_EVERY = 5  # the local tier mode: a persistent checkpoint every 5th step, a local one at the others


def _agents(cycle: Cycle, root: str, log: Path, pids: Path, keep_last: int, steps: int, incremental: bool):
    """The launch command of each agent: one torchrun for the whole job, or one per simulated node (the local tier
    mode: each node is a torchrun agent with its own directory as --local-root)."""
    train = ["-m", "shardckpt.train", "--ckpt", root, "--steps", str(steps), "--keep-last", str(keep_last)]
    train += ["--resume", "--cpu", "--loss-log", str(log), "--pid-dir", str(pids)]
    if incremental:
        train += ["--freeze-base", "--incremental", "--full-every", "3"]
    run = [sys.executable, "-m", "torch.distributed.run", "--monitor-interval=0.2"]
    if not cycle.layout:
        return [[*run, "--standalone", f"--nproc-per-node={cycle.world}", *train, "--ckpt-every", "1"]]
    port = free_port()
    rendezvous = [f"--nnodes={len(cycle.layout)}", "--rdzv-backend=static", "--master-addr=127.0.0.1"]
    train += ["--ckpt-every", str(PERSISTENT_EVERY), "--local-every", "1", "--local-keep", "2", "--peers", "1"]
    return [
        [*run, *rendezvous, f"--master-port={port}", f"--node-rank={node}", f"--nproc-per-node={ranks}", *train]
        + ["--local-root", str(directory)]
        for node, (directory, ranks) in enumerate(cycle.layout)
    ]


def _run_cycle(
    cycle: Cycle, root: str, work: Path, rng: random.Random, keep_last: int, steps: int, incremental: bool
) -> None:
    log, pids = work / f"loss-{cycle.number}.jsonl", work / f"pids-{cycle.number}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    jobs, outputs = [], []
    for index, command in enumerate(_agents(cycle, root, log, pids, keep_last, steps, incremental)):
        outputs.append(work / f"out-{cycle.number}-{index}")
        with open(outputs[-1], "wb") as sink:
            jobs.append(
                subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
            )

    def running() -> bool:
        return all(job.poll() is None for job in jobs)

    try:
        deadline = time.monotonic() + 180
        while not _losses(log) and running() and time.monotonic() < deadline:
            time.sleep(0.05)  # wait until it trains (resume done), then strike at a random moment
        if running() and _losses(log):
            began = time.monotonic()
            if cycle.mode == "random":
                time.sleep(rng.uniform(0.0, 2.5))
            else:  # right after a step is logged: while its checkpoint is being written
                logged = len(_losses(log))
                while len(_losses(log)) == logged and running() and time.monotonic() < deadline:
                    time.sleep(0.01)
            cycle.kill_after = time.monotonic() - began
            if running():
                _kill(cycle, rng, jobs, pids)
        for job in jobs:
            job.wait(timeout=120)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for job in jobs:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
    cycle.returncode = max(abs(job.returncode or 0) for job in jobs)
    cycle.output = "\n".join(out.read_text(errors="replace") for out in outputs)
    cycle.steps = _losses(log)
    found = RESUMED.search(cycle.output)
    cycle.resumed = int(found.group(2)) if found else None
    cycle.source = found.group(1) if found else None


def _kill(cycle: Cycle, rng: random.Random, jobs: list[subprocess.Popen], pids: Path) -> None:
    """SIGKILL a random rank, or in the local tier mode a random node: its agent and ranks, and its directory goes
    (a lost node's local storage is gone with it)."""
    if not cycle.layout:
        cycle.killed_rank = rng.randrange(cycle.world)
        os.kill(int((pids / f"rank-{cycle.killed_rank}.pid").read_text()), signal.SIGKILL)
        return
    node = rng.randrange(len(cycle.layout))
    first = sum(ranks for _, ranks in cycle.layout[:node])
    os.killpg(jobs[node].pid, signal.SIGKILL)  # the agent first: it must not restart or signal its ranks
    for rank in range(first, first + cycle.layout[node][1]):
        with contextlib.suppress(ProcessLookupError):  # in the agent's process group after all
            os.kill(int((pids / f"rank-{rank}.pid").read_text()), signal.SIGKILL)
    cycle.killed_rank, cycle.killed_node = first, cycle.layout[node][0]
    shutil.rmtree(cycle.killed_node, ignore_errors=True)


def _expected(root: str, layout: Sequence[tuple[Path, int]]) -> int | None:
    """The step a restart must resume: latest()'s, or the newest local step newer than it whose data files the
    layout's node directories hold between them (copies of one save: same name, attempt and manifest)."""
    latest = shardckpt.latest(root)
    expected = shardckpt.open(latest).step if latest else None
    held: dict[tuple[str, str, int], set[int]] = {}
    saves = {}
    for directory, _ in layout:
        if directory.is_dir():
            for copy in inventory(open_storage(str(directory))):
                saves[copy.key] = copy
                held.setdefault(copy.key, set()).update(copy.held)
    for key, copy in saves.items():
        complete = held[key] == set(range(copy.files))
        if complete and copy.step is not None and (expected is None or copy.step > expected):
            expected = copy.step
    return expected


def _layout(rng: random.Random, nodes: list[Path], work: Path, max_world: int, sizes: Sequence[int] | None):
    """The next cycle's nodes: the surviving ones first (in random order), then new ones with empty directories;
    `sizes` (ranks per node) given, or at random (1..3 nodes of 1..2 ranks, at most max_world ranks)."""
    if sizes is None:
        sizes = []
        while not sizes or (len(sizes) < 3 and rng.random() < 0.6):
            sizes.append(rng.randint(1, 2))
        while sum(sizes) > max_world:
            sizes.pop()
    survivors = [node for node in nodes if node.is_dir()]
    rng.shuffle(survivors)
    while len(survivors) < len(sizes):
        fresh = work / f"node-{len(nodes)}"
        nodes.append(fresh)
        fresh.mkdir()
        survivors.append(fresh)
    return list(zip(survivors, sizes, strict=False))


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
    report.local_resumes += cycle.source is not None and cycle.source.startswith("local:")
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
    local_tier: bool = False,
    layouts: Sequence[Sequence[int]] | None = None,
    say: Callable[[str], None] = print,
) -> SoakReport:
    """Run kill/restart cycles until `cycles` are done or `seconds` have passed (whichever is given first); with
    `local_tier`, on simulated nodes (`layouts`: the ranks of each node, per cycle; else at random)."""
    rng = random.Random(seed)
    report = SoakReport()
    work = Path(tempfile.mkdtemp(prefix="soak-"))
    began = time.monotonic()
    history: list[Cycle] = []
    nodes: list[Path] = []  # the local tier mode: every node directory ever made (wiped: a lost node)
    number = 0
    while (cycles is None or number < cycles) and (seconds is None or time.monotonic() - began < seconds):
        number += 1
        world = worlds[(number - 1) % len(worlds)] if worlds else rng.randint(1, max_world)
        layout = []
        if local_tier:
            sizes = layouts[(number - 1) % len(layouts)] if layouts else None
            layout = _layout(rng, nodes, work, max_world, sizes)
            world = sum(ranks for _, ranks in layout)
        expected = _expected(root, layout)
        cycle = Cycle(number, world, expected, modes[(number - 1) % len(modes)] if modes else rng.choice(MODES))
        cycle.layout = layout
        _run_cycle(cycle, root, work, rng, keep_last, steps, incremental)
        if cycle.killed_rank is None:
            report.failures.append(f"cycle {number}: the job ended before it was killed:\n{cycle.output[-3000:]}")
        _check(report, root, keep_last, cycle, history)
        history.append(cycle)
        report.cycles.append(cycle)
        last = max(cycle.steps) if cycle.steps else None
        victim = f"node {cycle.killed_node.name} (wiped)" if cycle.killed_node else f"rank {cycle.killed_rank}"
        nodes_text = f" as nodes {[(d.name, r) for d, r in layout]}" if layout else ""
        say(
            f"cycle {number}: W={world}{nodes_text} ({cycle.mode}) resumed {cycle.resumed} from "
            f"{cycle.source or 'persistent'} trained to {last}, killed {victim} after {cycle.kill_after:.2f} s; "
            f"committed now {sorted(_committed(root))}"
        )
    if not Path(root).exists() and not report.committed_seen:
        report.seconds = time.monotonic() - began  # local saves only (the local tier mode, short runs): no root
        return report
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
    fault = "SIGKILL of a random rank at a random moment, save every step"
    if any(c.layout for c in report.cycles):
        fault = "SIGKILL of a random node's agent and ranks, its local tier wiped, local save every step, peers=1"
    rows = [
        "| fault | tried | survived | data lost |",
        "|---|---|---|---|",
        f"| {fault}, restart on W in {worlds} | {cycles} cycles | {survived} | {len(report.lost)} checkpoints |",
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
        f"{len(report.referencing_seen)} stored pieces by reference; {report.local_resumes} resumes from the "
        "local tier; restores not bit-exact: "
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
    parser.add_argument("--local-tier", action="store_true", help="simulated nodes with a local tier, node losses")
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
        local_tier=args.local_tier,
    )
    print(table(report))
    for problem in report.lost + report.wrong_resumes + report.not_exact + report.not_close + report.failures:
        print(f"PROBLEM: {problem}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
