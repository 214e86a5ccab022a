"""`shardckpt diff` (per-tensor comparison, exit 0/1) and `shardckpt du` (committed bytes and leftovers)."""

from __future__ import annotations

import json
import os

import torch

import shardckpt
from shardckpt.cli import main as cli_main
from shardckpt.ops.du import disk_usage
from shardckpt.tools.diff import diff
from tests.helpers.checkpoints import sample_state, save_sharded


def test_identical_checkpoints_on_other_world_sizes(tmp_path, capsys) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    save_sharded(sample_state(), a, 2)
    save_sharded(sample_state(), b, 3, flat=("w",))  # other sharding, other layout: the same values
    # rank_info is saved per rank: rank 2 exists only in B.
    report = diff(a, b, memory_limit=1 << 20)
    assert all(t.status == "equal" for t in report.tensors) and len(report.tensors) == len(sample_state())
    assert [(o.name, o.rank, o.status) for o in report.objects] == [("rank_info", 2, "only in B")]
    assert cli_main(["diff", a, a, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["identical"] is True
    assert cli_main(["diff", a, b]) == 1


def test_every_kind_of_difference(tmp_path, capsys) -> None:
    state = sample_state()
    state["big"] = torch.arange(300_000, dtype=torch.float32)
    changed = {name: tensor.clone() for name, tensor in state.items()}
    changed["big"][-1] += 0.25  # the last element of the last chunk under a 1 MiB limit
    changed["big"][7] = float("nan")
    changed["w"][3, 4] += 1e-7
    changed["i"] = changed["i"].to(torch.int32)
    changed["m"] = torch.ones(3, 4, dtype=torch.bool)
    del changed["s"]
    changed["new"] = torch.zeros(2)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    save_sharded(state, a, 2)
    save_sharded(changed, b, 2)
    statuses = {t.name: t for t in diff(a, b, memory_limit=1 << 20).tensors}
    assert statuses["big"].status == "different" and statuses["big"].mismatched == 2
    assert statuses["big"].max_abs_diff != statuses["big"].max_abs_diff  # NaN against a number: NaN
    assert statuses["w"].status == "different" and statuses["w"].mismatched == 1
    assert 0 < statuses["w"].max_abs_diff < 1e-6
    assert statuses["i"].status == "dtype changed" and statuses["i"].mismatched == 0  # the same values
    assert statuses["m"].status == "shape changed" and statuses["m"].shape_b == (3, 4)
    assert statuses["s"].status == "only in A" and statuses["new"].status == "only in B"
    assert {name for name, t in statuses.items() if t.status == "equal"} == {"b", "e"}

    close = {t.name: t.status for t in diff(a, b, atol=1e-6).tensors}
    assert close["w"] == "close" and close["big"] == "different"
    assert cli_main(["diff", a, b, "--atol", "1e-6", "--json"]) == 1
    rows = {t["name"]: t for t in json.loads(capsys.readouterr().out)["tensors"]}
    assert rows["w"]["status"] == "close" and rows["m"]["shape_a"] == [6, 4]
    assert cli_main(["diff", a, b]) == 1
    table = capsys.readouterr().out
    assert "shape changed" in table and "only in B" in table and "different: " in table


def test_objects_are_compared_by_value(tmp_path) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    shardckpt.save({"w": torch.ones(2), "trainer": {"step": 1, "lr": 0.5}}, a)
    shardckpt.save({"w": torch.ones(2), "trainer": {"step": 2, "lr": 0.5}}, b)
    report = diff(a, b)
    assert [(o.name, o.status, o.value_a, o.value_b) for o in report.objects] == [
        ("trainer", "changed", {"step": 1, "lr": 0.5}, {"step": 2, "lr": 0.5})
    ]
    assert not report.identical and all(t.status == "equal" for t in report.tensors)


def test_du_counts_committed_bytes_and_leftovers(tmp_path, capsys) -> None:
    root = tmp_path / "root"
    good = str(root / "step-1")
    failed = save_sharded(sample_state(), str(root / "step-2"), 2)  # committed below by a second attempt...
    os.remove(root / "step-2" / "COMMITTED")
    os.remove(root / "step-2" / f"manifest-{failed}.msgpack")  # ...as if the first attempt died before commit
    committed = save_sharded(sample_state(), str(root / "step-2"), 2)
    save_sharded(sample_state(), good, 2)
    writer = shardckpt.ShardWriter(str(root / "step-3"), rank=0, world_size=2)  # never committed
    writer.add("a", torch.ones(64), global_shape=(128,), offsets=(0,))
    writer.close()
    (root / "step-1" / "notes.txt").write_bytes(b"x" * 100)
    (root / "not-a-checkpoint").mkdir()

    def sizes(directory, match=lambda name: True) -> int:
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(directory) for f in files if match(f))

    usage = {c.name: c for c in disk_usage(str(root)).checkpoints}
    assert sorted(usage) == ["step-1", "step-2", "step-3"]
    assert usage["step-1"].status == "committed" and usage["step-1"].leftover_bytes == 0
    assert usage["step-1"].other_bytes == 100 and usage["step-1"].committed_bytes == sizes(root / "step-1") - 100
    assert usage["step-2"].leftover_bytes == sizes(root / "step-2", lambda f: failed in f)
    assert usage["step-2"].leftover_files == 4  # 2 data files, 2 local manifests of the failed attempt
    assert usage["step-2"].committed_bytes == sizes(root / "step-2", lambda f: failed not in f)
    assert committed != failed
    assert usage["step-3"].status == "incomplete" and usage["step-3"].committed_bytes == 0
    assert usage["step-3"].leftover_bytes == sizes(root / "step-3") > 256

    assert cli_main(["du", str(root), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["total"]["total_bytes"] == sizes(root)
    assert summary["total"]["leftover_bytes"] == usage["step-2"].leftover_bytes + usage["step-3"].leftover_bytes
    assert cli_main(["du", good]) == 0  # a checkpoint itself as ROOT
    out = capsys.readouterr().out
    assert "step-1" in out and "committed" in out


def test_du_of_an_incremental_root_keeps_whole_names_on_an_80_column_console(tmp_path) -> None:
    """With the referenced column, du leaves out the leftovers and other columns when none has a size, so that
    checkpoint names are not cut on a plain 80-column console (the table a person reads at a terminal)."""
    import subprocess
    import sys

    state = {"base": torch.arange(4096, dtype=torch.float32), "head": torch.zeros(4)}
    root = tmp_path / "root"
    shardckpt.save(state, str(root / "step-00000001"), piece_hashes=True)
    state["head"] += 1
    shardckpt.save(state, str(root / "step-00000002"), parent=str(root / "step-00000001"))
    done = subprocess.run(
        [sys.executable, "-m", "shardckpt.cli", "du", str(root)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "80"},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    header = next(line for line in lines if line.startswith("checkpoint"))
    assert header.split() == ["checkpoint", "status", "step", "committed", "referenced", "total"]
    records = [line for line in lines if line.startswith("step-")]
    assert [line.split()[0] for line in records] == ["step-00000001", "step-00000002"]
    assert max(len(line) for line in [header, *records]) <= 80  # prose lines are not broken on a pipe (grep)
