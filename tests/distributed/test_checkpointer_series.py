"""Checkpointer(incremental=True, run_names=True) on 2 ranks (issues 23.2, 23.13): every rank saves under the
coordinator's run id, and the place in the series recorded by the coordinator reaches every rank's decision."""

from __future__ import annotations

import pytest

import shardckpt
from tests.helpers.launch import run_ranks

pytestmark = pytest.mark.dist


def test_a_series_with_run_names_agrees_on_every_rank_and_survives_a_restart(tmp_path) -> None:
    root = tmp_path / "root"
    results = run_ranks("series", 2, {"root": str(root)})
    assert all(r is not None and r["ok"] for r in results), results
    values = [r["value"] for r in results]
    assert values[0] == values[1], values  # one name per save on both ranks, one decision
    assert values[0]["kinds"] == "FiiFii"  # full_every=3 with keep_last=1, continued across the restart
    urls = values[0]["urls"]
    runs = {url.rsplit("-", 1)[-1] for url in urls}
    assert len(runs) == 2 and all(url.rsplit("/", 1)[-1].startswith("step-0000000") for url in urls), urls
    newest = shardckpt.latest(str(root))
    assert newest == urls[-1]
    opened = shardckpt.open(newest)
    assert opened.step == 6 and opened.read("head").tolist() == [6.0] * 4
    assert opened.read("base").tolist() == [[float(8 * row + col) for col in range(8)] for row in range(8)]
