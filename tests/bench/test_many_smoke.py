"""benchmarks.many runs end to end on a few tensors: every row present, every load equal to the save (--check);
no timing is asserted."""

from __future__ import annotations

import json

from benchmarks.many import main


def test_many_tensors_benchmark_smoke(tmp_path) -> None:
    out = tmp_path / "many.json"
    args = ["--tensors", "64", "--scale", "128", "--repeats", "1", "--check", "--dir", str(tmp_path)]
    assert main([*args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [row["tensors"] for row in report["rows"]] == [8, 64, 128]
    for row in report["rows"]:
        assert row["shardckpt_save_s"] > 0 and row["shardckpt_load_s"] > 0
        assert row["safetensors_save_s"] > 0 and row["save_ratio_to_safetensors"] > 0
    assert report["rows"][1]["dcp_save_s"] > 0 and report["rows"][1]["load_ratio_to_dcp"] > 0
    assert "dcp_save_s" not in report["rows"][2]  # scale rows leave DCP out
    assert set(report["per_tensor_growth"]) == {"save", "load"}
