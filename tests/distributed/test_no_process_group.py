"""Two ranks started as torchrun starts them, without init_process_group: save, load and Checkpointer refuse.

Without the check each rank saved a one-rank checkpoint to the same URL (one lost with misleading advice) and
each load filled whole tensors on every rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import shardckpt
from tests.helpers.launch import run_ranks

pytestmark = pytest.mark.dist

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "no_group_worker.py"


@pytest.mark.parametrize("scenario", ["save", "load", "checkpointer"])
def test_a_rank_of_many_without_a_process_group_is_refused(tmp_path, scenario) -> None:
    url = str(tmp_path / "ckpt")
    if scenario == "load":
        shardckpt.save({"weight": torch.zeros(2, 3), "step": 0}, url)
    results = run_ranks(scenario, 2, {"url": url}, timeout=120, worker=WORKER)
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} wrote no verdict"
        assert result["raised"] == "ShardckptUsageError", result
        assert f"rank {rank} of 2" in result["message"]
        assert "init_process_group" in result["message"] and "process_group=" in result["message"]
    if scenario == "save":
        assert not (tmp_path / "ckpt").exists()  # refused before a byte was written
