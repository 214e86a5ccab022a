"""The scale benchmarks run end to end on small simulated jobs (their figures are reported, never asserted): the
dense model and the DeepSeek-V3-shaped MoE state in both layouts (a few layers and experts), and DCP's figures
for the MoE state, whose per-group estimate must agree with a full run of every tensor."""

from __future__ import annotations

import json

from benchmarks import scale, scale_dcp

TINY = [
    "--layers",
    "4",
    "--dense-layers",
    "1",
    "--experts",
    "8",
    "--ep",
    "4",
]  # 1 dense + 3 MoE layers; EP 4 x FSDP 2 on 8 ranks


def test_scale_benchmark_smoke(tmp_path) -> None:
    out = tmp_path / "scale.json"
    assert scale.main(["--ranks", "8", *TINY, "--json", str(out), "--scratch", str(tmp_path)]) == 0
    rows = {row["model"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"dense", "moe-experts", "moe-grouped"}
    assert rows["dense"]["ranks"] == 8 and rows["dense"]["pieces"] > 2892
    for row in rows.values():  # each committed (every tensor's cover checked) and planned a resharded load
        assert row["global_manifest_bytes"] > 0 and row["plan_requests"] > 0 and row["plan_fetch_ratio"] >= 1
        assert row["validation_peak_rss"] > 0 and row["plan_peak_rss"] > 0
    for row in rows.values():  # format 1.2's piece index: a loading rank and a parent open read the head and blocks
        assert row["index_head_bytes"] < row["index_bytes_read"] <= row["index_manifest_bytes"]
        assert row["index_plan_requests"] > 0 and 0 < row["index_blocks_read"] <= row["index_blocks"]
        assert row["index_head_bytes"] < row["parent_bytes_read"] <= row["index_manifest_bytes"]
        assert row["parent_local_manifests"] == 1  # on the mesh that saved the parent: the rank's own pieces only
    # 3 MoE layers x 8 experts x 3 matrices, each with AdamW state (x3) and a step: 288 tensors, 3 in a grouped layer
    assert rows["moe-experts"]["tensors"] - rows["moe-grouped"]["tensors"] == 3 * (8 - 1) * 3 * 4


def test_scale_dcp_smoke(tmp_path) -> None:
    out = tmp_path / "dcp.json"
    argv = ["--ranks", "8", *TINY, "--check-ranks", "8", "--check-ep", "4", "--json", str(out)]
    assert scale_dcp.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    for layout in ("experts", "grouped"):
        full, estimate = (
            next(r for r in rows if r["layout"] == layout and r["how"] == how) for how in ("full", "per group")
        )
        assert estimate["chunks"] == full["chunks"] and estimate["items"] == full["items"]
        ratio = estimate["metadata_bytes"] / full["metadata_bytes"]
        if not 0.97 <= ratio <= 1.03:
            raise AssertionError(f"{layout}: DCP metadata estimated at {ratio:.3f}x the size of the full run's")
        assert full["validate_seconds"] > 0 and full["plan_seconds"] > 0
