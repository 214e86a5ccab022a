"""The benchmark harnesses (disk, S3) run end to end on a tiny state and write their JSON (no timing asserted)."""

from __future__ import annotations

import json

from benchmarks.__main__ import main
from tests.helpers.checkpoints import S3_BUCKET


def test_benchmark_harness_smoke(tmp_path) -> None:
    out = tmp_path / "bench.json"
    assert main(["--size-mib", "8", "--repeats", "1", "--warm", "--dir", str(tmp_path), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["state_bytes"] > 0 and result["loads"] == "warm"
    assert any(name.startswith("shardckpt.save") for name in result["rows"])
    assert 1.0 <= result["resharded_read_ratio"] <= 1.5
    # Issue 23.3: what piece hashes cost a full save, measured in the same run as the save without them.
    assert any("piece hashes (cost probe)" in name for name in result["rows"])
    assert set(result["piece_hash_cost"]) == {"default_hashes", "share_of_save"}


def test_s3_benchmark_smoke(s3_server, tmp_path) -> None:
    from benchmarks.s3 import main as s3_main

    out = tmp_path / "bench-s3.json"
    args = ["--size-mib", "8", "--repeats", "1", "--endpoint", s3_server.endpoint, "--bucket", S3_BUCKET]
    assert s3_main([*args, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["state_bytes"] == 8 << 20 and len(result["rows"]) == 4
    assert result["save_ratio_to_s3fs"] > 0 and result["load_ratio_to_s3fs"] > 0


def test_distributed_benchmark_smoke(tmp_path) -> None:
    """The gloo harness end to end at its smallest: 2 ranks save, 1 loads, warm, one run per row."""
    from benchmarks.distributed import main as distributed_main

    out = tmp_path / "distributed.json"
    args = ["--size-mib", "1", "--tensors", "4", "--save-world", "2", "--worlds", "1", "--repeats", "1", "--warm"]
    assert distributed_main([*args, "--dir", str(tmp_path), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["save_world"] == 2 and report["save"]["shardckpt_gib_s"] > 0
    [row] = report["rows"]
    assert row["load"] == "2 -> 1" and row["temperature"] == "warm"
    assert row["shardckpt_gib_s"] > 0 and row["dcp_gib_s"] > 0 and row["peak_rss_bytes"] > 0
    assert row["shardckpt_read_ratio"] >= 1.0  # a load reads at least the bytes it fills


def test_loop_state_benchmark_smoke(tmp_path) -> None:
    """The training loop's state through both libraries at the smallest size: 2 ranks save, 1 loads, warm; the
    harness itself fails unless both libraries loaded identical tensors."""
    from benchmarks.loop_state import main as loop_main

    out = tmp_path / "loop.json"
    args = ["--d-model", "32", "--layers", "1", "--heads", "2", "--vocab", "64", "--seq-len", "8"]
    args += ["--save-world", "2", "--worlds", "1", "--repeats", "1", "--warm", "--dir", str(tmp_path)]
    assert loop_main([*args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["tensors"] > 10 and report["state_bytes"] > 0
    [row] = report["rows"]
    assert row["load"] == "2 -> 1" and row["shardckpt_seconds"] > 0 and row["dcp_seconds"] > 0
