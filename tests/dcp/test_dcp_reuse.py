"""shardckpt.dcp in one process as DCP code reuses it: one StorageWriter for many checkpoint ids (its step), the same
checkpoint id saved again (a rollback, Lightning's last.ckpt), and the options DCP offers that shardckpt cannot honour.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

import shardckpt
import shardckpt.dcp
from shardckpt.dcp.writer import step_in_name

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _state(value: float) -> dict:
    return {"w": torch.full((3, 4), value), "meta": {"step": int(value)}}


def test_step_in_name_reads_the_steps_trainers_put_in_checkpoint_names() -> None:
    names = ["/r/step-6", "s3://b/step-00000100/", "/r/step_12", "/r/epoch=0-step=100.ckpt", "/r/global_step7"]
    assert [step_in_name(name) for name in names] == [6, 100, 12, 100, 7]
    assert [step_in_name(name) for name in ["/r/last.ckpt", "/r/steps", "/r/mystep-5x", "/r/step-"]] == [None] * 4


def test_a_reused_writer_records_the_step_each_checkpoint_id_names(tmp_path) -> None:
    writer = shardckpt.dcp.StorageWriter(str(tmp_path / "step-1"), step=1)
    for step in (1, 2, 3):
        dcp.save(_state(float(step)), checkpoint_id=str(tmp_path / f"step-{step}"), storage_writer=writer)
    assert [shardckpt.open(str(tmp_path / f"step-{step}")).step for step in (1, 2, 3)] == [1, 2, 3]
    # Without a step given, the id's own step is recorded (shardckpt ls, latest order by it).
    dcp.save(_state(4.0), storage_writer=shardckpt.dcp.StorageWriter(str(tmp_path / "step-4")))
    assert shardckpt.open(str(tmp_path / "step-4")).step == 4


def test_a_reused_writer_refuses_an_id_naming_no_step_rather_than_recording_a_stale_one(tmp_path) -> None:
    writer = shardckpt.dcp.StorageWriter(str(tmp_path / "first"), step=5)
    with pytest.raises(shardckpt.ShardckptUsageError, match="names no step"):
        dcp.save(_state(6.0), checkpoint_id=str(tmp_path / "second"), storage_writer=writer)
    assert not (tmp_path / "second").exists()


def test_use_collectives_false_saves_in_one_process_and_is_refused_up_front_on_many_ranks(
    tmp_path, monkeypatch
) -> None:
    dcp.save(_state(1.0), storage_writer=shardckpt.dcp.StorageWriter(str(tmp_path / "one")), use_collectives=False)
    assert torch.equal(shardckpt.open(str(tmp_path / "one")).read("w"), torch.full((3, 4), 1.0))
    # On 2 ranks each would plan and commit alone as rank 0 of 1: refused in set_up_storage_writer, which DCP calls
    # on every rank before anything is written (the same answer everywhere: no rank waits for another).
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    writer = shardckpt.dcp.StorageWriter(str(tmp_path / "two"))
    with pytest.raises(shardckpt.ShardckptUsageError, match="use_collectives=False.*gathering every rank"):
        writer.set_up_storage_writer(True, rank=0, use_collectives=False)
    writer.set_up_storage_writer(True, rank=0, use_collectives=True)
    assert not (tmp_path / "two").exists()
