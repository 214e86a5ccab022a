"""benchmarks.shared_reads end to end at a tiny size: the HSDP same-mesh load and the DDP load each read at most
1.05x the checkpoint's bytes over all ranks when shared (byte counts are deterministic; no time is asserted)."""

from __future__ import annotations

import json

import pytest

from benchmarks.shared_reads import main

pytestmark = pytest.mark.dist


def test_shared_reads_benchmark_reads_each_byte_once(tmp_path) -> None:
    out = tmp_path / "shared.json"
    args = ["--size-mib", "4", "--tensors", "4", "--repeats", "1", "--warm", "--no-dcp", "--dir", str(tmp_path)]
    assert main([*args, "--loads", "2x2 -> 2x2,DDP 4 ranks", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]["local"]
    assert set(rows) == {"2x2 -> 2x2", "DDP 4 ranks"}
    for name, row in rows.items():
        assert 1.0 <= row["shared_read_ratio"] <= 1.05, (name, row)
        assert row["alone_read_ratio"] >= 1.9, (name, row)  # each replica on its own: 2x (HSDP), 4x (DDP)


def test_the_setup_of_a_larger_job_is_timed_without_io(tmp_path) -> None:
    out = tmp_path / "plan.json"
    assert main(["--plan-ranks", "64", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["plan_rows"]
    # 32 HSDP pairs, 64 ranges of 1 MiB each: merged into 8 MiB segments, each pair's read by one of its two ranks.
    assert (row["ranks"], row["segments"]) == (64, 32 * 8)
    assert row["gathered_mib"] > 0 and row["rounds"] >= 1
