"""benchmarks.figures draws every figure from small benchmark JSON (the committed reference numbers, and the shapes the
harnesses write), skips a figure whose JSON is missing, and draws the same bytes from the same numbers."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import figures

REFERENCE = Path(__file__).resolve().parents[2] / "benchmarks" / "reference"


def test_every_figure_is_drawn_from_the_reference_numbers(tmp_path) -> None:
    written = figures.draw(figures.load_reports(REFERENCE), tmp_path)
    assert sorted(path.name for path in written) == sorted(f"{name}.svg" for name in figures.FIGURES)
    for path in written:
        text = path.read_text()
        assert text.startswith("<?xml") and "<svg" in text and len(text) > 5000, path


def test_a_redraw_of_the_same_numbers_is_the_same_file(tmp_path) -> None:
    reports = {"loop_state": figures.load_reports(REFERENCE)["loop_state"]}  # one figure is enough, and quick
    first, second = figures.draw(reports, tmp_path / "a"), figures.draw(reports, tmp_path / "b")
    assert len(first) == 1 and first[0].read_bytes() == second[0].read_bytes()


def test_figures_from_what_the_small_harness_runs_write_and_skip_what_is_missing(tmp_path) -> None:
    """The keys the harnesses write (distributed.py, loop_state.py, many.py), a few rows each."""
    source = tmp_path / "json"
    source.mkdir()
    many = {"rows": [{"tensors": n, "shardckpt_save_s": n / 1e4, "shardckpt_load_s": n / 2e4} for n in (8, 64)]}
    many["rows"][1] |= {"safetensors_save_s": 0.004, "safetensors_load_s": 0.002, "dcp_save_s": 0.02}
    distributed = {
        "save_world": 2,
        "save": {"shardckpt_gib_s": 0.5, "dcp_gib_s": 0.25},
        "rows": [
            {"load": "2 -> 1", "temperature": "warm", "shardckpt_gib_s": 1.0, "dcp_gib_s": 0.8}
            | {"shardckpt_read_ratio": 1.01, "dcp_read_ratio": 1.2}
        ],
    }
    loop = {"state_bytes": 2**20, "tensors": 12, "save_world": 2, "save": {"shardckpt_gib_s": 0.1, "dcp_gib_s": 0.05}}
    loop["rows"] = [{"load": "2 -> 1", "temperature": "warm", "shardckpt_seconds": 0.01, "dcp_seconds": 0.02}]
    (source / "loop_state.json").write_text(json.dumps(loop))
    (source / "many.json").write_text(json.dumps(many))
    (source / "distributed.json").write_text(json.dumps(distributed))
    assert figures.main(["--from", str(source), "--out", str(tmp_path / "out"), "--format", "png"]) == 0
    drawn = sorted(path.name for path in (tmp_path / "out").iterdir())
    assert drawn == [
        "loop_state.png",
        "resharding_read.png",
        "tensor_count.png",
        "throughput.png",
    ]  # no scale.json: no scale figure
    assert figures.main(["--from", str(tmp_path / "none"), "--out", str(tmp_path / "empty")]) == 1
