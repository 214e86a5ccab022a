"""benchmarks.pickle_check runs end to end on a small DCP .metadata and reports both rows; no timing is asserted."""

from __future__ import annotations

import json

from benchmarks.pickle_check import main


def test_pickle_check_benchmark_smoke(tmp_path, capsys) -> None:
    out = tmp_path / "pickle_check.json"
    assert main(["--ranks", "4", "--layers", "2", "--repeats", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["mib"] > 0
    assert report["check_mib_s"] > 0 and report["genops_mib_s"] > 0 and report["speedup_over_genops"] > 0
    printed = capsys.readouterr().out
    assert "check_pickle" in printed and "pickletools.genops" in printed
