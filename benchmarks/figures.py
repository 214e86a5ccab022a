"""The benchmark figures of the documentation: drawn from the JSON files `make bench` writes (benchmarks/*.json).

`python -m benchmarks.figures --from benchmarks --out docs/figures` draws each figure whose JSON exists and says which.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.patches

matplotlib.use("Agg")  # files only: no display on a server or in CI
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

# The same colour for a library in every figure.
COLOURS = {"shardckpt": "#1f77b4", "DCP": "#d62728", "safetensors": "#2ca02c", "torch": "#9467bd", "disk": "#7f7f7f"}
Report = dict[str, Any]


def library(row_name: str) -> str:
    """Which library a row of benchmarks/__main__.py's report measures."""
    for prefix, name in (("shardckpt", "shardckpt"), ("torch DCP", "DCP"), ("safetensors", "safetensors")):
        if row_name.startswith(prefix):
            return name
    return "disk" if row_name.startswith("raw") else "torch"


def _bars(ax: Any, labels: list[str], series: dict[str, list[float]], unit: str, fmt: str = ".2f") -> None:
    """Grouped horizontal bars: one group per label, one bar per library in `series`."""
    height = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        ys = [y + i * height for y in range(len(labels))]
        ax.barh(ys, values, height=height, label=name, color=COLOURS.get(name))
        for y, value in zip(ys, values):
            ax.annotate(
                f"{value:{fmt}}", (value, y), xytext=(2, 0), textcoords="offset points", va="center", fontsize=7
            )
    ax.set_yticks([y + height * (len(series) - 1) / 2 for y in range(len(labels))], labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.legend(fontsize=8, loc="best")


def throughput(reports: dict[str, Report]) -> Figure | None:
    """Save and load throughput: one process against every library and the disk; 4 ranks against DCP."""
    single, ranks = reports.get("results"), reports.get("distributed")
    if single is None and ranks is None:
        return None
    panels = [p for p in (single, ranks) if p is not None]
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 3.2 * len(panels)), squeeze=False)
    at = 0
    if single is not None:
        ax = axes[at][0]
        rows = [(name, row) for name, row in single["rows"].items() if row["kind"] in ("save", "load", "disk")]
        ax.barh(
            range(len(rows)),
            [row["gib_per_s"] for _, row in rows],
            color=[COLOURS[library(name)] for name, _ in rows],
        )
        ax.set_yticks(range(len(rows)), [name for name, _ in rows], fontsize=7)
        ax.invert_yaxis()
        shown = sorted({library(name) for name, _ in rows}, key=list(COLOURS).index)
        handles = [matplotlib.patches.Patch(color=COLOURS[name], label=name) for name in shown]
        ax.legend(handles=handles, fontsize=7, loc="lower right")
        ax.set_xlabel("GiB/s (median)")
        ax.set_title(f"One process, {single['state_bytes'] / 2**30:.3g} GiB state, {single['loads']} loads", fontsize=9)
        at += 1
    if ranks is not None:
        labels = [f"save on {ranks['save_world']}"] + [f"load {r['load']} {r['temperature']}" for r in ranks["rows"]]
        series = {
            "shardckpt": [ranks["save"]["shardckpt_gib_s"]] + [r["shardckpt_gib_s"] for r in ranks["rows"]],
            "DCP": [ranks["save"]["dcp_gib_s"]] + [r["dcp_gib_s"] for r in ranks["rows"]],
        }
        _bars(axes[at][0], labels, series, "GiB/s (median)")
        axes[at][0].set_title(f"{ranks['save_world']} gloo ranks against DCP, resharded loads included", fontsize=9)
    fig.tight_layout()
    return fig


def loop_state(reports: dict[str, Report]) -> Figure | None:
    """Milliseconds to save and load the training loop's own state (many tensors of many sizes), against DCP."""
    loop = reports.get("loop_state")
    if loop is None:
        return None
    labels, series = [], {"shardckpt": [], "DCP": []}
    if "save" in loop:  # the report keeps the save as a rate: back to seconds through the state's size
        labels.append(f"save on {loop['save_world']}")
        for name, key in (("shardckpt", "shardckpt_gib_s"), ("DCP", "dcp_gib_s")):
            series[name].append(loop["state_bytes"] / (loop["save"][key] * 2**30) * 1e3)
    for row in loop["rows"]:
        labels.append(f"load {row['load']} {row['temperature']}")
        series["shardckpt"].append(row["shardckpt_seconds"] * 1e3)
        series["DCP"].append(row["dcp_seconds"] * 1e3)
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(labels) + 1.4))
    _bars(ax, labels, series, "milliseconds (median; lower is better)", fmt=".0f")
    ax.set_title(
        f"The training loop's state: {loop.get('tensors', '?')} tensors, {loop['state_bytes'] / 2**20:.0f} MiB",
        fontsize=9,
    )
    fig.tight_layout()
    return fig


def tensor_count(reports: dict[str, Report]) -> Figure | None:
    """Seconds to save and to load N small tensors, against safetensors and DCP (log-log: linear is a slope of 1)."""
    many = reports.get("many")
    if many is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), sharey=True)
    for ax, what in zip(axes, ("save", "load")):
        for name, key in (("shardckpt", "shardckpt"), ("safetensors", "safetensors"), ("DCP", "dcp")):
            points = [(r["tensors"], r[f"{key}_{what}_s"]) for r in many["rows"] if f"{key}_{what}_s" in r]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o", label=name, color=COLOURS[name])
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("tensors")
        ax.set_title(what, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("seconds")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def resharding_read(reports: dict[str, Report]) -> Figure | None:
    """Bytes read per byte needed by each load of the multi-rank benchmarks (1.0: nothing read in vain)."""
    labels: list[str] = []
    series: dict[str, list[float]] = {"shardckpt": [], "DCP": []}
    for key, title in (("distributed", "reference state"), ("loop_state", "training loop state")):
        for row in reports.get(key, {}).get("rows", []):
            if "shardckpt_read_ratio" in row and "dcp_read_ratio" in row:
                labels.append(f"{title}: {row['load']} {row.get('temperature', '')}".rstrip())
                series["shardckpt"].append(row["shardckpt_read_ratio"])
                series["DCP"].append(row["dcp_read_ratio"])
    if not labels:
        return None
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(labels) + 1.2))
    _bars(ax, labels, series, "bytes read / bytes needed", fmt=".3f")
    ax.axvline(1.0, color="black", linewidth=0.8)
    fig.tight_layout()
    return fig


SCALE_PANELS = (
    ("global manifest (MiB)", "global_manifest_bytes", "metadata_bytes", 2**-20),
    ("commit validation (s)", "validation_seconds", ("global_plan_seconds", "validate_seconds"), 1.0),
    ("one rank's plan W -> 3W/4 (s)", "plan_seconds", "plan_seconds", 1.0),
)
DCP_LAYOUT = {"moe-experts": "experts", "moe-grouped": "grouped"}


def _dcp_value(row: dict[str, Any], key: str | tuple[str, ...]) -> float:
    return float(sum(row[k] for k in key) if isinstance(key, tuple) else row[key])


def scale(reports: dict[str, Report]) -> Figure | None:
    """Metadata size, commit validation and planning time against the rank count, shardckpt (solid) and DCP
    (dashed), for each model of benchmarks.scale."""
    ours = reports.get("scale")
    if ours is None:
        return None
    dcp_rows = [r for r in reports.get("scale_dcp", {}).get("rows", []) if r.get("how", "per group") == "per group"]
    models = sorted({row["model"] for row in ours["rows"]})
    markers = dict(zip(models, "osD^v"))
    fig, axes = plt.subplots(1, len(SCALE_PANELS), figsize=(11, 3.4))
    for ax, (title, key, dcp_key, factor) in zip(axes, SCALE_PANELS):
        for model in models:
            rows = sorted((r["ranks"], r[key] * factor) for r in ours["rows"] if r["model"] == model and key in r)
            if rows:
                ax.plot(*zip(*rows), marker=markers[model], color=COLOURS["shardckpt"], label=f"shardckpt {model}")
            theirs = sorted(
                (r["ranks"], _dcp_value(r, dcp_key) * factor)
                for r in dcp_rows
                if r.get("layout", "dense") == DCP_LAYOUT.get(model, "dense")
            )
            if theirs:
                ax.plot(
                    *zip(*theirs), marker=markers[model], color=COLOURS["DCP"], linestyle="--", label=f"DCP {model}"
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    return fig


FIGURES: dict[str, Callable[[dict[str, Report]], Figure | None]] = {
    "throughput": throughput,
    "loop_state": loop_state,
    "tensor_count": tensor_count,
    "resharding_read": resharding_read,
    "scale": scale,
}
SOURCES = ("results", "distributed", "loop_state", "many", "scale", "scale_dcp")


def load_reports(directory: str | Path) -> dict[str, Report]:
    """The benchmark reports present in `directory`, by name (results.json -> "results")."""
    reports = {}
    for name in SOURCES:
        path = Path(directory) / f"{name}.json"
        if path.exists():
            reports[name] = json.loads(path.read_text())
    return reports


def draw(reports: dict[str, Report], out: str | Path, *, fmt: str = "svg") -> list[Path]:
    """Write every figure that `reports` has the data for into `out`; the paths written."""
    os.makedirs(out, exist_ok=True)
    written = []
    for name, make in FIGURES.items():
        fig = make(reports)
        if fig is None:
            continue
        path = Path(out) / f"{name}.{fmt}"
        # No date, a fixed hash salt: the same numbers give the same file, so a redraw shows as no change in git.
        metadata = {"Date": None} if fmt == "svg" else {}
        with matplotlib.rc_context({"svg.hashsalt": "shardckpt", "svg.fonttype": "none"}):
            fig.savefig(path, format=fmt, metadata=metadata)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.figures", description=__doc__)
    parser.add_argument("--from", dest="source", default="benchmarks", help="directory of the JSON reports")
    parser.add_argument("--out", default="docs/figures", help="directory the figures go to")
    parser.add_argument("--format", default="svg", choices=("svg", "png"))
    args = parser.parse_args(argv)
    reports = load_reports(args.source)
    written = draw(reports, args.out, fmt=args.format)
    for path in written:
        print(f"figures: wrote {path}")
    missing = sorted(set(SOURCES) - set(reports))
    if missing:
        print(f"figures: no {', '.join(m + '.json' for m in missing)} in {args.source}: their figures are not redrawn")
    if not written:
        print("figures: nothing drawn (run make bench first)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
