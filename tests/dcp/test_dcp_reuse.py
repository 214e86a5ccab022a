"""shardckpt.dcp in one process as DCP code reuses it: one StorageWriter for many checkpoint ids (its step), the same
checkpoint id saved again (a rollback, Lightning's last.ckpt), and the options DCP offers that shardckpt cannot honour.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import shardckpt
import shardckpt.dcp
from shardckpt.dcp.writer import step_in_name

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _state(value: float) -> dict:
    return {"w": torch.full((3, 4), value), "meta": {"step": int(value)}}


def test_step_in_name_reads_the_steps_trainers_put_in_checkpoint_names() -> None:
    names = ["/r/step-6", "s3://b/step-00000100/", "/r/step_12", "/r/epoch=0-step=100.ckpt", "/r/global_step7"]
    assert [step_in_name(name) for name in names] == [6, 100, 12, 100, 7]
    unnamed = ["/r/last.ckpt", "/r/steps", "/r/mystep-5x", "/r/step-", f"/r/step-{1 << 63}"]  # too large: none
    assert [step_in_name(name) for name in unnamed] == [None] * 5
    with pytest.raises(shardckpt.ShardckptUsageError, match="64-bit"):
        shardckpt.dcp.StorageWriter("/r/x", step=1 << 63)  # refused before a byte is written


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


def _load(url: str) -> dict:
    target = _state(0.0)
    dcp.load(target, storage_reader=shardckpt.dcp.StorageReader(url))
    return target


def test_a_rollback_saves_the_same_step_again_and_the_new_save_supersedes_the_old(tmp_path) -> None:
    root = tmp_path / "checkpoint"
    for step in (2, 4, 6):
        dcp.save(_state(float(step)), checkpoint_id=str(root / f"step-{step}"), storage_writer=writer_for(root, step))
    # Resumed from step 4, the run reaches step 6 again with other values: DCP's own writer overwrote step-6.
    dcp.save(_state(60.0), checkpoint_id=str(root / "step-6"), storage_writer=writer_for(root, 6))
    assert sorted(p.name for p in (root / "step-6").iterdir() if p.name.startswith("COMMITTED")) == [
        "COMMITTED",
        "COMMITTED-2",
    ]
    assert torch.equal(_load(str(root / "step-6"))["w"], torch.full((3, 4), 60.0))
    assert torch.equal(shardckpt.open(str(root / "step-6")).read("w"), torch.full((3, 4), 60.0))
    assert shardckpt.latest(str(root)) == str(root / "step-6")
    # A third save supersedes the second; ls lists step-6 once, with the newest one's step.
    dcp.save(_state(61.0), checkpoint_id=str(root / "step-6"), storage_writer=writer_for(root, 6))
    assert torch.equal(_load(str(root / "step-6"))["w"], torch.full((3, 4), 61.0))
    from shardckpt.ops.ls import list_checkpoints

    rows = list_checkpoints(str(root))["checkpoints"]
    assert [(row["name"], row["status"], row["step"]) for row in rows] == [
        ("step-2", "committed", 2),
        ("step-4", "committed", 4),
        ("step-6", "committed", 6),
    ]


def writer_for(root, step: int) -> shardckpt.dcp.StorageWriter:
    return shardckpt.dcp.StorageWriter(str(root / f"step-{step}"))


def test_gc_collects_what_a_superseding_save_replaced_and_keeps_every_marker(tmp_path) -> None:
    from shardckpt.ops.gc import gc

    url = str(tmp_path / "step-6")
    dcp.save(_state(6.0), storage_writer=shardckpt.dcp.StorageWriter(url))
    first = shardckpt.open(url).manifest.attempt
    dcp.save(_state(60.0), storage_writer=shardckpt.dcp.StorageWriter(url))
    second = shardckpt.open(url).manifest.attempt
    assert first != second
    done = gc(str(tmp_path), grace=0)
    assert done.ok
    left = sorted(str(p.relative_to(tmp_path / "step-6")) for p in (tmp_path / "step-6").rglob("*") if p.is_file())
    assert left == sorted(
        [
            "COMMITTED",
            "COMMITTED-2",
            f"manifest-{second}.msgpack",
            f"data/00000-{second}.safetensors",
            f"ranks/00000-{second}.msgpack",
        ]
    )
    assert torch.equal(_load(url)["w"], torch.full((3, 4), 60.0))
    # Pruning the checkpoint deletes COMMITTED first, then the successor markers, then the rest.
    from shardckpt.catalog.deletion import checkpoint_objects
    from shardckpt.storage import open_storage

    assert checkpoint_objects(open_storage(url))[:2] == ["COMMITTED", "COMMITTED-2"]


def test_a_superseding_save_killed_before_its_commit_leaves_the_old_checkpoint_whole(tmp_path) -> None:
    import os
    import subprocess
    import sys

    url = str(tmp_path / "step-6")
    dcp.save(_state(6.0), storage_writer=shardckpt.dcp.StorageWriter(url))
    script = (
        "import torch, torch.distributed.checkpoint as dcp, shardckpt.dcp\n"
        f"dcp.save({{'w': torch.full((3, 4), 60.0), 'meta': {{'step': 60}}}}, "
        f"storage_writer=shardckpt.dcp.StorageWriter({url!r}))\n"
    )
    env = dict(os.environ, SHARDCKPT_CRASH_AT="before_commit")
    killed = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=120)
    assert killed.returncode == -9, killed.stderr.decode()[-2000:]
    assert len(list((tmp_path / "step-6").glob("manifest-*.msgpack"))) == 2  # the new attempt got that far
    assert not (tmp_path / "step-6" / "COMMITTED-2").exists()
    assert torch.equal(_load(url)["w"], torch.full((3, 4), 6.0))


def test_without_supersede_a_committed_url_is_refused_before_anything_is_written(tmp_path) -> None:
    url = str(tmp_path / "step-6")
    dcp.save(_state(6.0), storage_writer=shardckpt.dcp.StorageWriter(url))
    before = sorted(p.name for p in (tmp_path / "step-6").rglob("*"))
    with pytest.raises(CheckpointException) as refused:
        dcp.save(_state(7.0), storage_writer=shardckpt.dcp.StorageWriter(url, supersede=False))
    cause = refused.value.failures[0][0]
    assert isinstance(cause, shardckpt.AlreadyExistsError) and "supersede=True" in str(cause)
    assert sorted(p.name for p in (tmp_path / "step-6").rglob("*")) == before
    # shardckpt.save keeps its own rule: a committed URL is never saved over.
    with pytest.raises(shardckpt.AlreadyExistsError):
        shardckpt.save(_state(7.0), url)


def test_a_successor_marker_without_committed_is_not_a_checkpoint(tmp_path) -> None:
    url = str(tmp_path / "step-6")
    dcp.save(_state(6.0), storage_writer=shardckpt.dcp.StorageWriter(url))
    dcp.save(_state(60.0), storage_writer=shardckpt.dcp.StorageWriter(url))
    (tmp_path / "step-6" / "COMMITTED").unlink()  # what a deletion cut short after its first step leaves
    with pytest.raises(shardckpt.NotCommittedError):
        shardckpt.open(url)


def _prepared(url: str, value: float) -> str:
    """An attempt's files, written and not committed: what a save has done when it reaches its commit."""
    from shardckpt.format.layout import new_attempt

    attempt = new_attempt()
    writer = shardckpt.ShardWriter(url, rank=0, world_size=1, attempt=attempt)
    writer.add("w", torch.full((3, 4), value), global_shape=(3, 4), offsets=(0, 0))
    writer.close()
    return attempt


def test_of_two_saves_superseding_at_once_one_commits_and_a_superseded_attempt_never_comes_back(
    tmp_path, monkeypatch
) -> None:
    from shardckpt.write import commit as commit_module

    url = str(tmp_path / "step-6")
    first, second, third = (_prepared(url, value) for value in (6.0, 60.0, 61.0))
    commit_module.commit(url, world_size=1, attempt=first)
    # Both racers chose COMMITTED-2 before either created it: the create-only marker lets exactly one win.
    monkeypatch.setattr(commit_module, "_next_marker", lambda storage: "COMMITTED-2")
    commit_module.commit(url, world_size=1, attempt=second, supersede=True)
    with pytest.raises(shardckpt.CommitConflictError, match="already committed by attempt"):
        commit_module.commit(url, world_size=1, attempt=third, supersede=True)
    monkeypatch.undo()
    assert shardckpt.open(url).manifest.attempt == second
    # A retried commit of the first attempt (superseded since) is refused, not committed as COMMITTED-3.
    with pytest.raises(shardckpt.CommitConflictError, match="superseded by attempt"):
        commit_module.commit(url, world_size=1, attempt=first, supersede=True)
    commit_module.commit(url, world_size=1, attempt=second, supersede=True)  # the committed one: a no-op
    assert not (tmp_path / "step-6" / "COMMITTED-3").exists()
    assert torch.equal(shardckpt.open(url).read("w"), torch.full((3, 4), 60.0))


def test_a_save_to_the_same_s3_url_supersedes_with_a_conditional_create(s3_url) -> None:
    url = f"{s3_url}/step-6"
    dcp.save(_state(6.0), storage_writer=shardckpt.dcp.StorageWriter(url))
    dcp.save(_state(60.0), storage_writer=shardckpt.dcp.StorageWriter(url))
    assert torch.equal(_load(url)["w"], torch.full((3, 4), 60.0))
    assert shardckpt.latest(s3_url) == url


def test_read_metadata_makes_the_chunks_of_only_the_tensors_a_load_asks_for(tmp_path, monkeypatch) -> None:
    """DCP's planner takes every name of the metadata, but a rank's chunks (one object per stored piece: 14 M for a
    per-expert DeepSeek-V3 on 4,096 ranks) only of the tensors it loads: made when asked for (issue 27)."""
    from shardckpt.dcp import reader as reader_module

    state = {f"t{i}": torch.full((3, 4), float(i)) for i in range(5)} | {"meta": {"step": 3}}
    shardckpt.save(state, str(tmp_path / "ckpt"))
    made: list[str] = []
    real = reader_module._tensor_metadata
    monkeypatch.setattr(reader_module, "_tensor_metadata", lambda name, *rest: made.append(name) or real(name, *rest))
    metadata = shardckpt.dcp.StorageReader(str(tmp_path / "ckpt")).read_metadata()
    entries = metadata.state_dict_metadata
    assert made == [] and sorted(entries) == ["meta.step", "t0", "t1", "t2", "t3", "t4"] and len(entries) == 6
    assert "t3" in entries and "nothing" not in entries and entries.get("nothing") is None
    partial = {"t3": torch.zeros(3, 4), "meta": {"step": 0}}
    dcp.load(partial, storage_reader=shardckpt.dcp.StorageReader(str(tmp_path / "ckpt")))
    assert made == ["t3"] and torch.equal(partial["t3"], state["t3"]) and partial["meta"]["step"] == 3
