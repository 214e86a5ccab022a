"""The benchmark harnesses (disk, S3) run end to end on a tiny state and write their JSON (no timing asserted)."""

from __future__ import annotations

import json

from conftest import S3_BUCKET

from benchmarks.__main__ import main


def test_benchmark_harness_smoke(tmp_path) -> None:
    out = tmp_path / "bench.json"
    assert main(["--size-mib", "8", "--repeats", "1", "--warm", "--dir", str(tmp_path), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["state_bytes"] > 0 and result["loads"] == "warm"
    assert any(name.startswith("shardckpt.save") for name in result["rows"])
    assert 1.0 <= result["resharded_read_ratio"] <= 1.5


def test_s3_benchmark_smoke(s3_server, tmp_path) -> None:
    from benchmarks.s3 import main as s3_main

    out = tmp_path / "bench-s3.json"
    args = ["--size-mib", "8", "--repeats", "1", "--endpoint", s3_server.endpoint, "--bucket", S3_BUCKET]
    assert s3_main([*args, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["state_bytes"] == 8 << 20 and len(result["rows"]) == 4
    assert result["save_ratio_to_s3fs"] > 0 and result["load_ratio_to_s3fs"] > 0
