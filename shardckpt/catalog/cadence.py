"""How often to checkpoint, from what a checkpoint costs and how often the job fails (Young's rule), clamped to
bounds: pure arithmetic over measurements and a root's failure history (catalog/events.py); no I/O, no torch.

Checkpointer(every_steps="auto") feeds it step times and save costs and asks for the interval after each save.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from shardckpt.catalog.events import END, PREEMPTION, RESTART, START, Event, runs_of
from shardckpt.errors import ShardckptUsageError


@dataclass(frozen=True)
class Bounds:
    """Limits on the automatic interval: seconds first (on the interval Young's rule gives), then steps."""

    min_steps: int = 1
    max_steps: int | None = None
    min_seconds: float = 0.0
    max_seconds: float | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.min_steps, int) and self.min_steps >= 1):
            raise ShardckptUsageError(f"min_every_steps must be an integer >= 1, got {self.min_steps!r}")
        if self.max_steps is not None and not (isinstance(self.max_steps, int) and self.max_steps >= self.min_steps):
            raise ShardckptUsageError(
                f"max_every_steps must be an integer >= min_every_steps ({self.min_steps}), got {self.max_steps!r}"
            )
        if not (math.isfinite(self.min_seconds) and self.min_seconds >= 0):
            raise ShardckptUsageError(f"min_every_seconds must be a number >= 0, got {self.min_seconds!r}")
        if self.max_seconds is not None and not (self.max_seconds >= self.min_seconds and self.max_seconds > 0):
            raise ShardckptUsageError(
                f"max_every_seconds must be > 0 and >= min_every_seconds ({self.min_seconds}), got {self.max_seconds!r}"
            )


@dataclass(frozen=True)
class History:
    """A root's failure history as the cadence sees it: failed runs, and the seconds the job ran in all runs."""

    failures: int
    exposure_seconds: float
    runs: int
    source: str  # where it was read, for the log (e.g. the events URL)
    ahead: int = 0  # other runs that began after `now` (a clock ahead of this run's): left out


def history_of(
    events: Sequence[Event], current_run: str, now_ms: int, source: str, saved_ms: Sequence[int] = ()
) -> History:
    """Count failures and running time over the runs that have a start or restart event in `events`.

    A run other than the current one failed unless it recorded a clean end. A run ran from its start to its end or
    preemption event; the current run until `now_ms`. A run that crashed left no event at its end: it ran at least
    until the last sign of life the root still holds, the newest checkpoint committed (`saved_ms`: creation times
    of the root's committed checkpoints, in ms) after its start and before the next run's start, which excludes the
    time the job waited to be rescheduled; without one, until the next run's start (an upper bound). Nothing
    happened after `now_ms`, and no run went on after the next one started: a later time comes from a clock ahead
    and counts as that bound, and a run that began after `now_ms` is left out (History.ahead): when and how long it
    ran is unknown, and counting it as a failure that ran for no time at all would drive the interval to its minimum.
    """
    runs = runs_of(events)
    ahead = sum(1 for run, group in runs.items() if run != current_run and group[0].time_ms > now_ms)
    runs = {run: group for run, group in runs.items() if run == current_run or group[0].time_ms <= now_ms}
    starts = sorted((group[0].time_ms, run) for run, group in runs.items() if group[0].kind in (START, RESTART))
    saved = sorted(saved_ms)
    failures, exposure_ms = 0, 0
    for index, (began, run) in enumerate(starts):
        kinds = {event.kind for event in runs[run]}
        limit = starts[index + 1][0] if index + 1 < len(starts) else now_ms
        if run == current_run:
            ended = now_ms
        elif END in kinds or PREEMPTION in kinds:
            ended = max(event.time_ms for event in runs[run] if event.kind in (END, PREEMPTION))
        else:
            alive = [time for time in saved if began <= time <= limit]
            ended = max(alive[-1], max(event.time_ms for event in runs[run])) if alive else limit
        # A run is over when the next one starts (one job per root): an end stamped later is a clock ahead.
        exposure_ms += max(0, min(ended, limit) - began)
        if run != current_run and END not in kinds:
            failures += 1
    return History(failures, exposure_ms / 1000, len(starts), source, ahead)


def estimate_mtbf(history: History, prior_seconds: float) -> float | None:
    """Mean time between failures in seconds, None without a recorded failure.

    The maximum-likelihood estimate for failures as a Poisson process is running time / failures. With few
    failures it swings widely (one early crash says little), so a prior of one failure per `prior_seconds` counts
    as one more observation: (running time + prior) / (failures + 1). prior_seconds 0 leaves the plain estimate.
    """
    if history.failures < 1:
        return None
    weight = 1 if prior_seconds > 0 else 0
    return (history.exposure_seconds + prior_seconds) / (history.failures + weight)


def young_interval(cost_seconds: float, mtbf_seconds: float) -> float:
    """Seconds between checkpoints that minimise expected lost work plus checkpoint cost: sqrt(2 x cost x MTBF).

    Young's first-order rule, not Daly's higher-order form: Daly's terms change the interval by about
    (1/3) sqrt(cost / (2 MTBF)) relative (under 8% while cost <= MTBF / 10), well inside the error of an MTBF
    estimated from a handful of failures. Daly's one other case is kept: when cost >= MTBF / 2, every MTBF.
    """
    if cost_seconds < 0 or mtbf_seconds <= 0:
        raise ShardckptUsageError(f"cost must be >= 0 and MTBF > 0 seconds, got {cost_seconds}, {mtbf_seconds}")
    return min(math.sqrt(2 * cost_seconds * mtbf_seconds), mtbf_seconds)


@dataclass(frozen=True)
class Cadence:
    """One decision: checkpoint every `steps` steps, and why (each number with where it came from)."""

    steps: int
    reason: str  # "young" (the rule), "default" (the user's interval: nothing to apply the rule to yet)
    why: str  # one line for a log
    seconds: float | None = None  # the interval in seconds after the seconds bounds (rule only)
    cost_seconds: float | None = None
    mtbf_seconds: float | None = None
    step_seconds: float | None = None
    failures: int = 0


def choose(
    default_steps: int,
    bounds: Bounds,
    *,
    cost: tuple[float, str] | None,
    step_seconds: tuple[float, str] | None,
    history: History | None,
    prior_seconds: float,
) -> Cadence:
    """The interval in steps: Young's rule over the measured cost and the MTBF of `history`, in steps of the
    measured step time, clamped to `bounds`; `default_steps` while any of the three is missing.

    cost, step_seconds: (seconds, where the number comes from); history None: not read (not the coordinator).
    """
    mtbf = None if history is None else estimate_mtbf(history, prior_seconds)
    if history is None or mtbf is None or cost is None or step_seconds is None:
        missing = _missing(history, mtbf, cost)
        return Cadence(default_steps, "default", f"every {default_steps} steps, the default: {missing}")
    raw = young_interval(cost[0], mtbf)
    seconds = max(raw, bounds.min_seconds)
    if bounds.max_seconds is not None:
        seconds = min(seconds, bounds.max_seconds)
    wanted = max(1, round(seconds / step_seconds[0])) if step_seconds[0] > 0 else bounds.min_steps
    steps = max(wanted, bounds.min_steps)
    if bounds.max_steps is not None:
        steps = min(steps, bounds.max_steps)
    clamps = []
    if seconds != raw:
        clamps.append(f"{raw:.3g} s clamped to {seconds:.3g} s")
    if steps != wanted:
        clamps.append(f"{wanted} steps clamped to {steps}")
    prior = f" + prior {prior_seconds:g} s as 1 failure" if prior_seconds > 0 else ""
    why = (
        f"every {steps} steps ({seconds:.3g} s at {step_seconds[0]:.3g} s/step): sqrt(2 x cost {cost[0]:.3g} s "
        f"x MTBF {mtbf:.4g} s) = {raw:.3g} s{'; ' + ', '.join(clamps) if clamps else ''}; cost: {cost[1]}; "
        f"MTBF: {history.exposure_seconds:.4g} s run over {history.failures} failure(s){prior} ({history.source}"
        f"{_ahead(history)}); "
        f"step time: {step_seconds[1]}"
    )
    return Cadence(steps, "young", why, seconds, cost[0], mtbf, step_seconds[0], history.failures)


def _ahead(history: History) -> str:
    return f"; {history.ahead} run(s) stamped after this run's clock left out" if history.ahead else ""


def _missing(history: History | None, mtbf: float | None, cost: tuple[float, str] | None) -> str:
    """Why the rule cannot apply yet, for the log."""
    if history is None:
        return "no failure history read"
    if mtbf is None:
        return f"no failure recorded in {history.source} ({history.runs} run(s){_ahead(history)})"
    return "no checkpoint cost measured yet" if cost is None else "no step time measured yet"


class Measurements:
    """The recent step times and checkpoint costs of this run; their medians (one slow outlier does not steer)."""

    def __init__(self, window: int) -> None:
        self.step_times: deque[float] = deque(maxlen=max(1, window))
        self.costs: deque[float] = deque(maxlen=max(1, window))
        self._last: tuple[int, float] | None = None
        self.cost_kind = "save time"

    def step_seen(self, step: int, now: float) -> None:
        """The training loop reached `step` at time `now`: the time since the last step seen is step time."""
        if self._last is not None and step > self._last[0] and now >= self._last[1]:
            self.step_times.append((now - self._last[1]) / (step - self._last[0]))
        self._last = (step, now)

    def saved(self, step: int, cost: float, now: float, *, asynchronous: bool) -> None:
        """A checkpoint of `step` cost the training thread `cost` seconds; the step clock restarts at `now`."""
        self.costs.append(max(0.0, cost))
        self.cost_kind = "training stall" if asynchronous else "save time"
        self._last = (step, now)  # the save's own time is not step time

    def cost(self) -> tuple[float, str] | None:
        if not self.costs:
            return None
        return statistics.median(self.costs), f"median {self.cost_kind} of the last {len(self.costs)} save(s)"

    def step_seconds(self) -> tuple[float, str] | None:
        if not self.step_times:
            return None
        return statistics.median(self.step_times), f"median of the last {len(self.step_times)} step(s)"
