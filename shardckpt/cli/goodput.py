"""`shardckpt goodput`: where a job's time went, per run and in total, from the history under ROOT/events/: useful
work, checkpoint stalls, resume loads, work lost to crashes, downtime; MTBF and the interval chosen vs the optimum.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from rich.console import Console

from shardckpt import knobs
from shardckpt.cli.common import EXIT_OK, new_command, print_json, storage_options, when
from shardckpt.errors import NotFoundError, ShardckptUsageError

NAME = "goodput"
# Columns in the order they give way on a narrow terminal: the last listed goes first (the run id never does).
_COLUMNS = ("run", "ended", "wall", "saves", "stall", "lost", "load", "down", "every")


def register(subparsers: Any) -> None:
    command = new_command(
        subparsers,
        NAME,
        "where a job's time went: useful work, checkpoint stalls, failures, MTBF, best interval",
        "From the failure history a Checkpointer records under ROOT/events/ (every_steps='auto', or "
        "record_failures=True): per run and in total, the wall time, the checkpoint stall (what saves cost the "
        "training loop), the resume load, the work lost to crashes (from the last save to the next run's start: an "
        "upper bound, the restart's delay included), the downtime between runs, the failures and MTBF, and the "
        "interval between saves chosen against the one optimal in hindsight (Young: sqrt(2 x stall x MTBF); "
        "Daly's higher-order form). Exit 1 when ROOT does not exist.",
        "examples:\n  shardckpt goodput /ckpts/run\n  shardckpt goodput /ckpts/run --plot timeline.png\n"
        "  shardckpt goodput s3://bucket/run --json | jq .total.goodput",
    )
    command.add_argument("root", help="the root the Checkpointer saves under (it holds events/)")
    command.add_argument(
        "--plot", metavar="FILE", help="also draw the runs' timeline into FILE (.png, .svg or .pdf; needs matplotlib)"
    )


def run(args: argparse.Namespace, console: Console) -> int:
    from shardckpt.catalog.chain import BROKEN, COMMITTED, INCOMPLETE, MISSING, what_is
    from shardckpt.catalog.events import read_events
    from shardckpt.catalog.goodput import analyse
    from shardckpt.storage import open_storage

    root = open_storage(args.root, storage_options(args.storage_option))
    kind = what_is(root).kind
    if kind == MISSING:
        raise NotFoundError(f"{root.url} does not exist (check the path or URL for a typo)")
    if kind in (COMMITTED, INCOMPLETE, BROKEN):
        raise ShardckptUsageError(
            f"{root.url} is a checkpoint ({kind}); goodput reads the root the Checkpointer saves under: "
            f"`shardckpt goodput {root.parent().url}`"
        )
    log = read_events(root, 2 * knobs.CADENCE_MAX_EVENTS)  # all a writer keeps
    report = analyse(log.events)
    note = None
    if not report.runs:
        note = (
            f"no runs recorded under {root.describe('events')}: a Checkpointer records them with "
            "every_steps='auto' or record_failures=True"
        )
    if args.plot:
        _plot(report, args.plot, root.url)
    if args.json:
        print_json(_document(root.url, report, note, log.skipped))
        return EXIT_OK
    if note:
        console.print(note, highlight=False, soft_wrap=True)
        return EXIT_OK
    for line in _table(report, console.width):
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    for line in _totals(report):
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    if args.plot:
        console.print(f"timeline drawn into {args.plot}", highlight=False, markup=False, soft_wrap=True)
    return EXIT_OK


def _document(url: str, report: Any, note: str | None, skipped: tuple[str, ...]) -> dict[str, Any]:
    runs = []
    for entry in report.runs:
        row = dataclasses.asdict(entry)
        row["useful"] = entry.useful
        row["save_times_ms"] = list(entry.save_times_ms)
        runs.append(row)
    total = {
        key: getattr(report, key)
        for key in ("span", "useful", "stall", "load", "lost", "down", "failures", "mtbf", "cost", "chosen")
    }
    total.update(goodput=report.goodput, optimal_young=report.young, optimal_daly=report.daly)
    document: dict[str, Any] = {"root": url, "runs": runs, "total": total, "skipped": list(skipped)}
    if note:
        document["note"] = note
    return document


def duration(seconds: float | None) -> str:
    """A short duration: 850ms, 42.0s, 12m05s, 3h07m, 2d04h ('-' for None)."""
    if seconds is None:
        return "-"
    if seconds == 0:
        return "0s"
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def _table(report: Any, width: int) -> list[str]:
    """Plain text, one run a line; columns give way from the right until the table fits `width`."""
    rows = [
        [
            entry.run[:8],
            entry.how,
            duration(entry.wall),
            str(entry.saves),
            duration(entry.stall),
            duration(entry.lost),
            duration(entry.load),
            duration(entry.down),
            "-" if entry.every is None else str(entry.every),
        ]
        for entry in report.runs
    ]
    headers = list(_COLUMNS)
    keep = len(headers)
    while True:
        widths = [max(len(headers[i]), *(len(row[i]) for row in rows)) for i in range(keep)]
        if sum(widths) + 2 * (keep - 1) <= width or keep <= 2:
            break
        keep -= 1

    def line(cells: list[str]) -> str:
        parts = [cell.ljust(widths[i]) if i in (0, 1) else cell.rjust(widths[i]) for i, cell in enumerate(cells[:keep])]
        return "  ".join(parts).rstrip()

    return [line(headers)] + [line(row) for row in rows]


def _totals(report: Any) -> list[str]:
    share = "-" if report.goodput is None else f"{report.goodput:.1%}"
    first = min(entry.began_ms for entry in report.runs) / 1000
    # One figure a line: fits any terminal, and greps.
    return [
        "",
        f"total: {len(report.runs)} run(s) over {duration(report.span)} from {when(first)}",
        f"  goodput {share}: useful {duration(report.useful)}",
        f"  checkpoint stall {duration(report.stall)}",
        f"  resume loads {duration(report.load)}",
        f"  lost to crashes {duration(report.lost)}",
        f"  down between runs {duration(report.down)}",
        f"  failures {report.failures}, MTBF {duration(report.mtbf)}",
        f"  save stall (median) {duration(report.cost)}",
        f"  interval between saves {duration(report.chosen)} (median)",
        f"  optimal in hindsight {duration(report.young)} (Young), {duration(report.daly)} (Daly)",
    ]


def _plot(report: Any, path: str, title: str) -> None:
    """The timeline: one row per run, useful time green, lost red, down grey, saves as ticks."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ShardckptUsageError(f"--plot needs matplotlib (pip install matplotlib): {exc}") from exc
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not report.runs:
        raise ShardckptUsageError("--plot: no runs recorded to draw")
    origin = min(entry.began_ms for entry in report.runs)
    unit, per = next(
        (u, p) for u, p in (("hours", 3600.0), ("minutes", 60.0), ("seconds", 1.0)) if report.span >= 3 * p or p == 1.0
    )

    def at(ms: int) -> float:
        return float(ms - origin) / 1000 / per

    figure, axes = plt.subplots(figsize=(10, 1.2 + 0.45 * len(report.runs)))
    colors = {"clean": "tab:green", "preempted": "tab:orange", "crashed": "tab:red", "no end": "tab:blue"}
    for row, entry in enumerate(report.runs):
        y = len(report.runs) - 1 - row
        axes.broken_barh([(at(entry.began_ms), entry.wall / per)], (y - 0.3, 0.6), color=colors[entry.how])
        end = at(entry.ended_ms)
        if entry.lost:
            axes.broken_barh([(end, entry.lost / per)], (y - 0.3, 0.6), color="tab:red", alpha=0.35)
        if entry.down:
            axes.broken_barh([(end, entry.down / per)], (y - 0.3, 0.6), color="0.8")
        axes.vlines([at(ms) for ms in entry.save_times_ms], y - 0.35, y + 0.35, color="black", linewidth=0.8)
    axes.set_yticks(range(len(report.runs)), [entry.run[:8] for entry in reversed(report.runs)])
    axes.set_xlabel(f"{unit} since the first run's start")
    share = "-" if report.goodput is None else f"{report.goodput:.1%}"
    axes.set_title(f"{title}: goodput {share}, {report.failures} failure(s); ticks: saves", fontsize=9)
    handles = [Patch(color=color) for color in colors.values()]
    handles += [Patch(color="tab:red", alpha=0.35), Patch(color="0.8")]
    labels = [*(f"run: {how}" for how in colors), "lost to a crash", "down"]
    axes.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    try:
        figure.savefig(path)
    except (OSError, ValueError) as exc:  # an unknown extension, a directory that does not exist
        raise ShardckptUsageError(f"--plot {path}: {exc}") from exc
    finally:
        plt.close(figure)
