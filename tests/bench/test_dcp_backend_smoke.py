"""The DCP-backend benchmark (dcp.save / dcp.load through shardckpt.dcp vs FileSystemWriter / FileSystemReader)
runs end to end at its smallest and writes its rows (no timing asserted)."""

from __future__ import annotations

import json

from benchmarks.dcp_backend import main


def test_dcp_backend_benchmark_smoke(tmp_path) -> None:
    """2 ranks save (and load 2 -> 2 in the same job), 1 loads, warm, one run per row; the harness itself fails
    unless both backends loaded the same values."""
    out = tmp_path / "dcp_backend.json"
    args = ["--size-mib", "1", "--tensors", "4", "--save-world", "2", "--worlds", "2", "1", "--repeats", "1"]
    assert main([*args, "--warm", "--dir", str(tmp_path), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["save_world"] == 2 and report["state_bytes"] > 0
    assert report["save"]["shardckpt_gib_s"] > 0 and report["save"]["dcp_gib_s"] > 0
    assert [(row["load"], row["temperature"]) for row in report["rows"]] == [("2 -> 2", "warm"), ("2 -> 1", "warm")]
    for row in report["rows"]:
        assert row["shardckpt_seconds"] > 0 and row["dcp_seconds"] > 0
        assert row["shardckpt_read_ratio"] >= 1.0  # a load reads at least the bytes it fills
        assert row["dcp_read_ratio"] >= 1.0
