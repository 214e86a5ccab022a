"""`shardckpt inspect` of a torchtitan-like checkpoint: hundreds of one-value objects (a learning rate, betas and
weight decay per parameter, as torchtitan's flattened optimizer state has them) are summarised by name pattern."""

from __future__ import annotations

import json

import torch

import shardckpt
from shardckpt.cli import main as cli_main

PARAMETERS = [f"layers.{i}.attention.{w}.weight" for i in range(8) for w in ("wq", "wk", "wv", "wo")]


def _titan_like(url: str) -> None:
    state: dict = {"tok_embeddings.weight": torch.ones(4, 2)}
    for index, name in enumerate(PARAMETERS):
        state[f"optimizer.param_groups.{name}.lr"] = 3e-4
        state[f"optimizer.param_groups.{name}.weight_decay"] = 0.1 if index else 0.0  # one differs
        state[f"optimizer.param_groups.{name}.betas"] = (0.9, 0.95)
    state["train_state"] = {"step": 10}
    state["dataloader.dp_rank_0"] = b"\x00\x01"
    shardckpt.save(state, url, step=10)


def test_inspect_shows_one_row_per_name_pattern_and_every_object_on_request(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "160")
    url = str(tmp_path / "step-10")
    _titan_like(url)
    assert cli_main(["inspect", url]) == 0
    out = capsys.readouterr().out
    assert "optimizer.param_groups.*.lr" in out and "0.0003  (32 objects)" in out
    assert "optimizer.param_groups.*.betas" in out and "[0.9, 0.95]  (32 objects)" in out
    assert "optimizer.param_groups.*.weight_decay" in out and "32 objects, 2 distinct values" in out
    assert "train_state" in out and "dataloader.dp_rank_0" in out  # few alike: shown one by one
    assert "layers.3.attention.wk.weight" not in out
    assert cli_main(["inspect", "--all-objects", url]) == 0
    assert out.count("\n") + 3 * 32 - 3 <= capsys.readouterr().out.count("\n")
    assert cli_main(["inspect", "--json", url]) == 0
    assert len(json.loads(capsys.readouterr().out)["objects"]) == 3 * 32 + 2  # JSON: every object
