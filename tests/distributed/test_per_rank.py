"""PerRank values on a world-size change: saved on 2 ranks (RNG state tensors, top level and nested in a dict),
loaded on 3, where rank 2 gets what PerRank(missing=...) chooses."""

from __future__ import annotations

import pytest

import shardckpt
from tests.helpers.launch import run_ranks

pytestmark = pytest.mark.dist


def test_per_rank_tensors_on_more_ranks_follow_the_missing_choice(tmp_path) -> None:
    url = str(tmp_path / "ck")
    saved = run_ranks("per_rank_save", 2, {"url": url})
    assert all(r is not None and r["ok"] for r in saved), saved
    loaded = run_ranks("per_rank_load", 3, {"url": url})
    assert all(r is not None and r["ok"] for r in loaded), loaded
    outcomes = [r["value"] for r in loaded]
    for rank in (0, 1):  # ranks that saved get their own values back, whatever the choice for missing ones
        assert outcomes[rank]["keep"] == {"rng": rank, "position": rank}
        assert outcomes[rank]["wrap"] == {"rng": rank, "position": rank}
    assert outcomes[2]["keep"] == {"rng": "mine", "position": "mine"}
    assert outcomes[2]["wrap"] == {"rng": 0, "position": 0}
    for rank in range(3):  # rank 2 refuses, and every rank learns it
        assert outcomes[rank]["error"]["raised"] == "DistributedError", outcomes[rank]
        assert "saved by 2 ranks, none of them rank 2" in outcomes[rank]["error"]["message"]


def test_per_rank_missing_choice_is_checked() -> None:
    with pytest.raises(shardckpt.ShardckptUsageError, match="keep"):
        shardckpt.PerRank(None, missing="zero")
