"""The MoE benchmark harness end to end at its smallest: 2 ranks save, 1 loads, one run (no timing asserted)."""

from __future__ import annotations

import json

import pytest

from benchmarks.moe import main

pytestmark = pytest.mark.dist  # launches gloo ranks


def test_moe_benchmark_smoke(tmp_path) -> None:
    out = tmp_path / "moe.json"
    args = ["--ranks", "2", "--load-ranks", "1", "--layers", "1", "--experts", "4", "--dim", "8", "--ffn", "12"]
    assert main([*args, "--repeats", "1", "--dir", str(tmp_path), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    [row] = report["rows"]
    assert row["stored_tensors"] == 4 * (1 + 4 * 3)  # router + 4 experts x 3 matrices; param, exp_avg, sq, step
    assert row["agree"] is True
    for key in ("save_shardckpt_s", "save_dcp_s", "load_shardckpt_s", "load_dcp_s"):
        assert row[key] > 0, key
    assert row["read_ratio_shardckpt"] >= 1.0  # a load reads at least the bytes it fills
