"""benchmarks.incremental runs end to end on a tiny frozen-base state: every row present, the incremental saves
write their changed bytes only; no timing is asserted."""

from __future__ import annotations

import json

import pytest

from benchmarks.incremental import main

pytestmark = pytest.mark.unit


def test_incremental_benchmark_smoke(tmp_path) -> None:
    out = tmp_path / "incremental.json"
    args = ["--frozen-mib", "1", "--trainable-mib", "0.25", "--saves", "2", "--repeats", "1"]
    assert main([*args, "--hash-threads", "1", "2", "--dir", str(tmp_path), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["full_saves"]) == {"no_hashes_s", "hashes_inline_s", "hashes_threaded_s"}
    assert set(report["hashing"]["rates_gb_s_by_threads"]) == {"1", "2"}
    assert min(report["hashing"]["rates_gb_s_by_threads"].values()) > 0
    kinds = [(row["save"], row["kind"]) for row in report["saves"]]
    assert kinds == [(0, "full"), (1, "incremental"), (2, "incremental")]
    for row in report["saves"][1:]:
        # 0.25 MiB trainable, its two AdamW moments and step counters: written once more each save, nothing else.
        assert row["changed_bytes"] == 3 * (1 << 18) + 4 * 4
        if row["written_over_changed_plus_manifests"] > 1.05:
            pytest.fail(f"save {row['save']}: {row} writes more than its changed bytes and manifests")
    assert set(report["loads"]) == {"incremental_s", "full_s", "ratio"}
    for row in report["saves"][1:]:
        assert row["hash_s"] > 0 and row["write_s"] > 0, row  # the save's time split into its two parts
