"""Where a job's time went, from its failure history (events.py): useful work, checkpoint stalls, resume loads, work
lost to crashes, time down between runs; MTBF and the checkpoint interval that was chosen against the optimal one.

Pure arithmetic over events (no I/O). A crashed run leaves no event at the crash: its work after its last save is
counted lost up to the next run's start (an upper bound, the restart's delay included).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from shardckpt.catalog.events import END, PREEMPTION, RESTART, SAVE, START, Event, runs_of

CLEAN, PREEMPTED, CRASHED, OPEN = "clean", "preempted", "crashed", "no end"


@dataclass(frozen=True)
class RunGoodput:
    """One run: from its start (or restart) event to its end or preemption event; a crashed one to its last event.

    how: clean, preempted, crashed (a later run started without its end), or "no end" (the newest run: still
    running, or crashed and not restarted). Seconds: wall (began..ended), stall (its saves' cost to training),
    load (its resume), lost (crashed: from its last save, or its start, to the next run's start), down (otherwise:
    from its end to the next run's start). every: the median interval in steps its saves were made at; interval:
    the median seconds between its saves.
    """

    run: str
    began_ms: int
    ended_ms: int
    how: str
    first_step: int | None
    last_step: int | None
    saves: int
    wall: float
    stall: float
    load: float
    lost: float
    down: float
    every: int | None
    interval: float | None
    save_times_ms: tuple[int, ...]

    @property
    def useful(self) -> float:
        return max(0.0, self.wall - self.stall - self.load)


@dataclass(frozen=True)
class Goodput:
    """All runs and the totals: span (the first start to the last end), and its parts; failures (runs that crashed
    or were preempted), MTBF (running time per failure), cost (the median save stall), the interval chosen (the
    median seconds between saves) and the optimal ones in hindsight: Young sqrt(2 x cost x MTBF) and Daly's
    higher-order form. None where there is nothing to compute them from."""

    runs: tuple[RunGoodput, ...]
    span: float
    useful: float
    stall: float
    load: float
    lost: float
    down: float
    failures: int
    mtbf: float | None
    cost: float | None
    chosen: float | None
    young: float | None
    daly: float | None

    @property
    def goodput(self) -> float | None:
        """The fraction of the span spent on useful work."""
        return self.useful / self.span if self.span > 0 else None


def analyse(events: Sequence[Event]) -> Goodput:
    """The goodput of the runs that have a start or restart event among `events` (any order)."""
    grouped = runs_of(events)
    starts = sorted((group[0].time_ms, run) for run, group in grouped.items() if group[0].kind in (START, RESTART))
    runs = [
        _run(grouped[run], starts[index + 1][0] if index + 1 < len(starts) else None)
        for index, (_, run) in enumerate(starts)
    ]
    failures = sum(1 for run in runs if run.how in (CRASHED, PREEMPTED))
    running = sum(run.wall + run.lost for run in runs)
    mtbf = running / failures if failures else None
    stalls = [event.stall_ms / 1000 for event in events if event.kind == SAVE and event.stall_ms is not None]
    cost = statistics.median(stalls) if stalls else None
    gaps = [
        (later - earlier) / 1000
        for run in runs
        for earlier, later in zip(run.save_times_ms, run.save_times_ms[1:], strict=False)
    ]
    chosen = statistics.median(gaps) if gaps else None
    young = daly = None
    if cost is not None and mtbf is not None and mtbf > 0:
        young = min(math.sqrt(2 * cost * mtbf), mtbf)
        daly = daly_interval(cost, mtbf)
    span = (max(run.ended_ms for run in runs) - min(run.began_ms for run in runs)) / 1000 if runs else 0.0
    return Goodput(
        tuple(runs),
        span,
        sum(run.useful for run in runs),
        sum(run.stall for run in runs),
        sum(run.load for run in runs),
        sum(run.lost for run in runs),
        sum(run.down for run in runs),
        failures,
        mtbf,
        cost,
        chosen,
        young,
        daly,
    )


def daly_interval(cost: float, mtbf: float) -> float:
    """Daly's (2006) higher-order optimum: sqrt(2 d M) (1 + sqrt(d / 2M) / 3 + (d / 2M) / 9) - d for d < 2M, else M."""
    if cost >= 2 * mtbf:
        return mtbf
    ratio = cost / (2 * mtbf)
    return max(0.0, math.sqrt(2 * cost * mtbf) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - cost)


def _run(events: list[Event], next_start_ms: int | None) -> RunGoodput:
    first = events[0]
    closing = [event for event in events if event.kind in (END, PREEMPTION)]
    saves = [event for event in events if event.kind == SAVE]
    if closing:
        ended = closing[-1]
        how = CLEAN if ended.kind == END else PREEMPTED
    else:
        ended = events[-1]
        how = CRASHED if next_start_ms is not None else OPEN
    lost = down = 0.0
    if next_start_ms is not None:
        gap = max(0, next_start_ms - ended.time_ms) / 1000
        if how == CRASHED:
            lost = gap  # from its last sign of life (its last save, or its start) to the next start
        else:
            down = gap
    steps = [event.step for event in events if event.step is not None]
    everies = [event.every for event in saves if event.every is not None]
    times = tuple(event.time_ms for event in saves)
    gaps = [(b - a) / 1000 for a, b in zip(times, times[1:], strict=False)]
    return RunGoodput(
        run=first.run,
        began_ms=first.time_ms,
        ended_ms=ended.time_ms,
        how=how,
        first_step=first.step,
        last_step=max(steps) if steps else None,
        saves=len(saves),
        wall=max(0, ended.time_ms - first.time_ms) / 1000,
        stall=sum(event.stall_ms or 0 for event in saves) / 1000,
        load=(first.load_ms or 0) / 1000,
        lost=lost,
        down=down,
        every=int(statistics.median(everies)) if everies else None,
        interval=statistics.median(gaps) if gaps else None,
        save_times_ms=times,
    )
