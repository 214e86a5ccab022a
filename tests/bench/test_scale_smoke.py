"""The scale benchmark runs end to end on a small simulated job (its figures are reported, never asserted)."""

from __future__ import annotations

import json

from benchmarks.scale import main


def test_scale_benchmark_smoke(tmp_path) -> None:
    out = tmp_path / "scale.json"
    assert main(["--ranks", "8", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["ranks"] == 8 and row["pieces"] > 2892
    assert row["global_manifest_bytes"] > 0 and row["plan_requests"] > 0
