"""The benchmark harness runs end to end on a tiny state and writes its JSON (no timing is asserted)."""

from __future__ import annotations

import json

from benchmarks.__main__ import main


def test_benchmark_harness_smoke(tmp_path) -> None:
    out = tmp_path / "bench.json"
    assert main(["--size-mib", "8", "--repeats", "1", "--warm", "--dir", str(tmp_path), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["state_bytes"] > 0 and result["loads"] == "warm"
    assert any(name.startswith("shardckpt.save") for name in result["rows"])
    assert 1.0 <= result["resharded_read_ratio"] <= 1.5
