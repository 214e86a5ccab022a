"""A frozen-base run saved incrementally on 2 gloo ranks resumes on 1 rank: the distributed load follows the newest
checkpoint's references (2 -> 1), and the 1-rank job's own incremental checkpoint verifies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardckpt.ops.verify import verify
from tests.helpers.training import losses, torchrun

pytestmark = pytest.mark.dist


def test_an_incremental_checkpoint_of_two_ranks_resumes_on_one(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    common = ["--ckpt", str(root), "--ckpt-every", "2", "--cpu", "--layers", "4", "--freeze-base", "--incremental"]
    torchrun(2, *common, "--steps", "4", "--keep-last", "5", "--full-every", "3")
    marker = json.loads((root / "step-00000004" / "COMMITTED").read_text())
    assert [entry["checkpoint"] for entry in marker["references"]] == ["step-00000002"]
    log = tmp_path / "loss.jsonl"
    torchrun(1, *common, "--steps", "6", "--keep-last", "5", "--resume", "--loss-log", str(log))
    assert sorted(losses(str(log))) == [5, 6]  # resumed from step 4, the incremental one
    report = verify(str(root / "step-00000006"))
    assert report.ok, [str(problem) for problem in report.problems]
