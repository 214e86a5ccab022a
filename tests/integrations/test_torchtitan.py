"""shardckpt.integrations.torchtitan in one process, without torchtitan: its overrides on a stand-in for torchtitan
0.3.0's CheckpointManager (the methods and attributes they use), saving, resuming and pruning step-N checkpoints.

The same code ran under torchtitan itself on 2 gloo ranks: tests/integrations/try_torchtitan.py (README).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import shardckpt
from shardckpt.format.layout import new_attempt
from shardckpt.integrations import torchtitan
from shardckpt.integrations.torchtitan import manager_class, newest_step, step_of

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP warns when it runs without a process group


class Model:
    """torchtitan's ModelWrapper as dcp_load uses it: load_state_dict gets the whole flattened state."""

    def __init__(self) -> None:
        self.loaded: dict[str, Any] | None = None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state


class TorchtitanManager:
    """The part of torchtitan 0.3.0's CheckpointManager (components/checkpointer/dcp.py) the overrides rely on:
    folder, states, keep_latest_k, pg, stager, a nested slots Config, and the methods they override or call."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config:
        enable: bool = False
        folder: str = "checkpoint"
        keep_latest_k: int = 10

    def __init__(self, folder: str, keep_latest_k: int = 0) -> None:
        self.folder, self.keep_latest_k = folder, keep_latest_k
        self.states: dict[str, Any] = {"model": Model()}
        self.pg = self.stager = None
        self.calls: list[str] = []

    def dcp_save(self, state_dict, checkpoint_id, async_mode, enable_garbage_collection=False, to_hf=False):
        self.calls.append(f"torchtitan dcp_save to_hf={to_hf}")

    def dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized):
        self.calls.append(f"torchtitan dcp_load from_hf={from_hf}")

    def _find_load_step(self, folder: str = "") -> int:
        raise AssertionError("torchtitan's own _find_load_step must not run")

    def _create_checkpoint_id(self, step: int, folder: str = "") -> str:
        return os.path.join(folder or self.folder, f"step-{step}")


def state(value: float) -> dict[str, Any]:
    """A flattened torchtitan state: model entries at the top, the other components as nested dicts."""
    return {
        "tok.weight": torch.full((6, 4), value),
        "optimizer": {
            "state": {"tok.weight": {"exp_avg": torch.full((6, 4), value / 2)}},
            "param_groups": [{"lr": 1e-3}],
        },
        "train_state": {"step": int(value), "losses": [1.5, 0.5]},
        "dataloader": {"position": b"\x00\x07"},
    }


@pytest.fixture
def manager(tmp_path) -> Any:
    return manager_class(TorchtitanManager)(str(tmp_path / "checkpoint"), keep_latest_k=2)


def test_step_of_reads_torchtitans_checkpoint_ids() -> None:
    assert [step_of(i) for i in ("/r/step-12", "s3://b/c/step-0/", "/r/step-x", "/r/latest")] == [12, 0, None, None]


def test_saves_are_committed_checkpoints_and_the_newest_committed_step_resumes(manager) -> None:
    for step in (1, 2):
        assert manager.dcp_save(state(float(step)), manager._create_checkpoint_id(step), "disabled") is None
    # A save killed before its commit: data and a local manifest, no COMMITTED. torchtitan itself would not see
    # it either (no .metadata); a killed DCP save that got as far as .metadata is what it would take.
    torn = shardckpt.ShardWriter(manager._create_checkpoint_id(3), rank=0, world_size=1, attempt=new_attempt())
    torn.add("tok.weight", torch.zeros(6, 4), global_shape=(6, 4), offsets=(0, 0))
    torn.close()
    assert manager._find_load_step() == 2
    assert shardckpt.open(manager._create_checkpoint_id(2)).step == 2  # the step is recorded (shardckpt ls, latest)
    assert manager.calls == []

    target = state(0.0)
    manager.dcp_load(target, manager._create_checkpoint_id(2), False, False)
    expected = state(2.0)
    assert torch.equal(target["tok.weight"], expected["tok.weight"])
    exp_avg = target["optimizer"]["state"]["tok.weight"]["exp_avg"]
    assert torch.equal(exp_avg, expected["optimizer"]["state"]["tok.weight"]["exp_avg"])
    assert target["train_state"] == {"step": 2, "losses": [1.5, 0.5]}
    assert target["dataloader"] == {"position": b"\x00\x07"}
    assert manager.states["model"].loaded is target  # as torchtitan's dcp_load: the model loads its entries


def test_a_step_dcp_wrote_itself_counts_and_loads_through_torchtitans_code(manager) -> None:
    manager.dcp_save(state(1.0), manager._create_checkpoint_id(1), "disabled")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state(4.0), storage_writer=dcp.FileSystemWriter(manager._create_checkpoint_id(4)))
    assert manager._find_load_step() == 4
    manager.dcp_load(state(0.0), manager._create_checkpoint_id(4), False, False)
    assert manager.calls == ["torchtitan dcp_load from_hf=False"]


def test_async_save_returns_a_future_and_hf_exports_stay_with_torchtitan(manager) -> None:
    future = manager.dcp_save(state(5.0), manager._create_checkpoint_id(5), "async")
    future.result()
    assert shardckpt.open(manager._create_checkpoint_id(5)).step == 5
    manager.dcp_save(state(6.0), manager._create_checkpoint_id(6), "disabled", to_hf=True)
    manager.dcp_load(state(0.0), manager._create_checkpoint_id(5), True, False)
    assert manager.calls == ["torchtitan dcp_save to_hf=True", "torchtitan dcp_load from_hf=True"]
    with pytest.raises(shardckpt.ShardckptUsageError, match="async_mode 'sometimes'"):
        manager.dcp_save(state(7.0), manager._create_checkpoint_id(7), "sometimes")


def test_purge_keeps_the_newest_k_committed_steps_and_deletes_commit_first(manager) -> None:
    for step in (1, 2, 3):
        manager.dcp_save(state(float(step)), manager._create_checkpoint_id(step), "disabled")
    manager._purge_stale_checkpoints()
    assert sorted(os.listdir(manager.folder)) == ["step-2", "step-3"]
    assert manager._find_load_step() == 3


def test_no_folder_is_a_fresh_start(tmp_path) -> None:
    assert newest_step(str(tmp_path / "missing")) == -1


def test_the_subclass_declares_its_own_config_as_torchtitans_configurable_requires() -> None:
    cls = manager_class(TorchtitanManager)
    config = cls.__dict__["Config"]  # Configurable builds the class that declares Config itself
    assert issubclass(config, TorchtitanManager.Config) and "__slots__" in config.__dict__
    assert config(enable=True, folder="ckpt").enable is True
    assert manager_class(TorchtitanManager) is cls  # one class per base: pickling and isinstance keep working


def test_torchtitan_is_imported_only_when_its_class_is_asked_for() -> None:
    if "torchtitan" in sys.modules:
        pytest.fail("importing shardckpt.integrations.torchtitan imported torchtitan", pytrace=False)
    with pytest.raises(ModuleNotFoundError, match="torchtitan"):
        torchtitan.CheckpointManager  # noqa: B018


def test_a_save_collects_garbage_as_torchtitan_does_generation_1_not_a_full_collection(manager, monkeypatch) -> None:
    import gc

    generations: list[tuple[Any, ...]] = []
    monkeypatch.setattr(gc, "collect", lambda *args: generations.append(args) or 0)
    manager.dcp_save(state(1.0), manager._create_checkpoint_id(1), "disabled", enable_garbage_collection=True)
    assert generations == [(1,)]  # torchtitan's GarbageCollection.collect(reason) runs gc.collect(1)


def test_a_rollback_to_an_older_step_saves_over_the_newer_steps_as_torchtitans_dcp_does(manager) -> None:
    for step in (4, 6):
        manager.dcp_save(state(float(step)), manager._create_checkpoint_id(step), "disabled")
    # --checkpoint.load_step 4: the run resumes at 4 and reaches step 6 again (here through async_save's thread,
    # where the AlreadyExistsError of a refusal surfaced one save late).
    manager.dcp_load(state(0.0), manager._create_checkpoint_id(4), False, False)
    manager.dcp_save(state(66.0), manager._create_checkpoint_id(6), "async").result()
    assert manager._find_load_step() == 6
    target = state(0.0)
    manager.dcp_load(target, manager._create_checkpoint_id(6), False, False)
    assert torch.equal(target["tok.weight"], torch.full((6, 4), 66.0)) and target["train_state"]["step"] == 66
    manager.dcp_save(state(8.0), manager._create_checkpoint_id(8), "disabled")
    manager._purge_stale_checkpoints()  # keep_latest_k=2: step-4 goes, the superseded step-6 is one checkpoint
    assert sorted(os.listdir(manager.folder)) == ["step-6", "step-8"]
