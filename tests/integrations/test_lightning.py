"""shardckpt.integrations.lightning in one process, without Lightning: its overrides on a stand-in for Lightning
2.6's ModelParallelStrategy (the attributes they use), a Trainer checkpoint dict saved, loaded and removed.

The same code ran under Lightning itself on 2 gloo ranks: tests/integrations/try_lightning.py (README).
"""

from __future__ import annotations

import copy
import os
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

import shardckpt
from shardckpt.integrations import lightning
from shardckpt.integrations.lightning import strategy_class

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP warns when it runs without a process group


class AttributeDict(dict):
    """Lightning's hyper_parameters type: a dict subclass."""


class Strategy:
    """The part of Lightning 2.6's ModelParallelStrategy the overrides use: broadcast, global_rank, model,
    optimizers, lightning_module.strict_loading, _save_distributed_checkpoint, and the methods they override."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizers = model, [optimizer]
        self.global_rank, self._save_distributed_checkpoint = 0, True
        self.lightning_module = SimpleNamespace(strict_loading=True)
        self.calls: list[str] = []

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        self.calls.append("lightning save_checkpoint")

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict[str, Any]:
        self.calls.append("lightning load_checkpoint")
        return {}

    def remove_checkpoint(self, filepath) -> None:
        self.calls.append("lightning remove_checkpoint")


def trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 4), nn.LayerNorm(4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3 * (seed + 1))
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    return model, optimizer


def trainer_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What Lightning's Trainer hands strategy.save_checkpoint: states plus its own entries, with empty maps, a
    tensor inside a callback's state and a dict subclass, as a real fit loop's checkpoint has them."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {
        "epoch": 1,
        "global_step": 12,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": get_model_state_dict(model),
        "optimizer_states": [get_optimizer_state_dict(model, optimizer)],
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 2, "completed": 1}}}},
        "callbacks": {"ModelCheckpoint{'monitor': 'loss', 'mode': 'min'}": {"best_model_score": torch.tensor(0.25)}},
        "lr_schedulers": [{"last_epoch": 12, "_last_lr": [0.001]}],
        "hyper_parameters": AttributeDict(width=4, layers=(1, 2)),
    }


def test_a_trainer_checkpoint_round_trips_through_the_strategy_without_pickle(tmp_path) -> None:
    model, optimizer = trained(0)
    saved = trainer_checkpoint(model, optimizer)
    expected = copy.deepcopy({k: v for k, v in saved.items() if k not in ("state_dict", "optimizer_states")})
    url = str(tmp_path / "epoch=1-step=12.ckpt")
    strategy_class(Strategy)(model, optimizer).save_checkpoint(saved, url)

    checkpoint = shardckpt.open(url)  # an ordinary committed checkpoint, the step from Lightning's global_step
    assert checkpoint.step == 12 and "meta.pt" not in os.listdir(url)

    fresh_model, fresh_optimizer = trained(1)
    strategy = strategy_class(Strategy)(fresh_model, fresh_optimizer)
    entries = strategy.load_checkpoint(url)
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh_model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert fresh_optimizer.state_dict()["param_groups"][0]["lr"] == 1e-3
    for index, moments in optimizer.state_dict()["state"].items():
        assert torch.equal(moments["exp_avg_sq"], fresh_optimizer.state_dict()["state"][index]["exp_avg_sq"])
    score = entries["callbacks"].pop("ModelCheckpoint{'monitor': 'loss', 'mode': 'min'}")["best_model_score"]
    assert torch.equal(score, torch.tensor(0.25))
    expected["callbacks"].pop("ModelCheckpoint{'monitor': 'loss', 'mode': 'min'}")
    assert entries == {**expected, "hyper_parameters": {"width": 4, "layers": (1, 2)}}
    assert entries["loops"]["fit_loop"]["state_dict"] == {}  # DCP's flattening would have dropped this map
    assert strategy.calls == []

    strategy.remove_checkpoint(url)
    assert not os.path.exists(url)


def test_a_value_lightning_could_only_pickle_is_refused_by_name(tmp_path) -> None:
    model, optimizer = trained(0)
    saved = trainer_checkpoint(model, optimizer)
    saved["hyper_parameters"]["data_dir"] = tmp_path  # a PosixPath: meta.pt would pickle it
    url = str(tmp_path / "refused.ckpt")
    with pytest.raises(CheckpointException) as raised:
        strategy_class(Strategy)(model, optimizer).save_checkpoint(saved, url)
    assert "data_dir" in str(raised.value) and "PosixPath" in str(raised.value)
    assert not os.path.exists(os.path.join(url, "COMMITTED"))


def test_lightnings_own_checkpoints_and_options_stay_with_lightning(tmp_path) -> None:
    model, optimizer = trained(0)
    strategy = strategy_class(Strategy)(model, optimizer)
    (tmp_path / "lightning.ckpt").write_bytes(b"a file Lightning wrote")
    strategy.load_checkpoint(tmp_path / "lightning.ckpt")
    strategy.remove_checkpoint(tmp_path / "lightning.ckpt")
    strategy._save_distributed_checkpoint = False
    strategy.save_checkpoint(trainer_checkpoint(model, optimizer), tmp_path / "full.ckpt")
    assert strategy.calls == ["lightning load_checkpoint", "lightning remove_checkpoint", "lightning save_checkpoint"]
    with pytest.raises(TypeError, match="shardckpt_storage_options"):
        strategy.save_checkpoint({}, tmp_path / "x", storage_options={"anon": True})


def test_only_rank_0_stores_lightnings_entries(tmp_path, monkeypatch) -> None:
    """As Lightning keeps rank 0's meta.pt: other ranks' entries (which may differ) never reach storage."""
    model, optimizer = trained(0)
    saved: list[dict[str, Any]] = []
    monkeypatch.setattr(lightning.state_dict_saver, "save", lambda state, storage_writer: saved.append(state))
    for rank in (0, 1):
        strategy = strategy_class(Strategy)(model, optimizer)
        strategy.global_rank = rank
        strategy.save_checkpoint(trainer_checkpoint(model, optimizer), tmp_path / "c")
    assert [sorted(state) for state in saved] == [
        ["lightning", "optimizer_0", "state_dict"],
        ["optimizer_0", "state_dict"],
    ]


def test_lightning_is_imported_only_when_its_class_is_asked_for() -> None:
    if "lightning" in sys.modules:
        pytest.fail("importing shardckpt.integrations.lightning imported lightning", pytrace=False)
    with pytest.raises(ModuleNotFoundError, match="lightning"):
        lightning.ModelParallelStrategy  # noqa: B018


def test_save_last_saves_one_path_again_and_again_and_the_newest_loads(tmp_path) -> None:
    url = str(tmp_path / "last.ckpt")  # ModelCheckpoint(save_last=True) saves every time to this one path
    for step in (12, 24):
        model, optimizer = trained(step)
        saved = trainer_checkpoint(model, optimizer)
        saved["global_step"] = step
        strategy_class(Strategy)(model, optimizer).save_checkpoint(saved, url)
    fresh_model, fresh_optimizer = trained(0)
    entries = strategy_class(Strategy)(fresh_model, fresh_optimizer).load_checkpoint(url)
    assert entries["global_step"] == 24 and shardckpt.open(url).step == 24
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh_model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    strategy_class(Strategy)(fresh_model, fresh_optimizer).remove_checkpoint(url)
    assert not os.path.exists(url)
