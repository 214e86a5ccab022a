"""shardckpt.integrations.torch_checkpointing under the real torch_checkpointing 0.1.1 (in the dev extra, so it runs
in make test): its CheckpointManager saving through shardckpt storage (local, S3) and loading shardckpt checkpoints,
on 2 gloo ranks and then on 1 and 3, bit-equal to its own backend; the object-store commit never half-visible."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch_checkpointing import ItemSpec
from torch_checkpointing.config import SyncCheckpointSaverConfig

import shardckpt
from shardckpt.errors import AlreadyExistsError, IntegrityError, ShardckptError
from shardckpt.integrations.torch_checkpointing import (
    COMMITTED_MARKER,
    PENDING_MARKER,
    CheckpointManager,
    ShardckptResharder,
    ShardckptStorageConfig,
)
from tests.helpers.launch import run_ranks

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "tc_worker.py"
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def manager(root: str, **options: Any) -> CheckpointManager:
    config = CheckpointManager.Config(
        default=ItemSpec(resharder=ShardckptResharder()),
        save=SyncCheckpointSaverConfig(),
        storage_config=ShardckptStorageConfig(root=root, **options),
    )
    return CheckpointManager(config)


def payload(seed: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    weights = {"w": torch.randn(6, 5, generator=generator), "b": torch.randn(5, generator=generator).bfloat16()}
    return {"model": weights, "train": {"step": seed, "tag": f"run-{seed}"}}


def zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
        "train": {"step": -1, "tag": ""},
    }


def assert_same(loaded: dict[str, Any], expected: dict[str, Any]) -> None:
    for name, tensor in expected["model"].items():
        assert loaded["model"][name].dtype == tensor.dtype
        assert torch.equal(loaded["model"][name], tensor), name
    assert loaded["train"] == expected["train"]


@pytest.mark.unit
def test_its_own_format_round_trips_through_shardckpt_local_storage_with_every_file_durable(tmp_path) -> None:
    state = payload(3)
    with_us = manager(str(tmp_path / "run"))
    with_us.save("step_3", state)
    assert sorted(os.listdir(tmp_path / "run")) == ["step_3"]  # the staging directory was renamed onto it
    assert_same(with_us.load("step_3", into=zeros_like(state)), state)
    with pytest.raises(AlreadyExistsError, match="occupied"):  # a committed checkpoint is never merged into
        with_us.save("step_3", payload(4))
    assert_same(with_us.load("step_3", into=zeros_like(state)), state)
    with_us.close()


@pytest.mark.unit
def test_a_shardckpt_checkpoint_loads_through_checkpoint_manager_and_damage_is_typed(tmp_path) -> None:
    state = payload(5)
    shardckpt.save(state, str(tmp_path / "sc" / "step-5"), step=5)
    loader = manager(str(tmp_path / "sc"))
    assert_same(loader.load("step-5", into=zeros_like(state)), state)  # recognised by its COMMITTED marker
    data = next((tmp_path / "sc" / "step-5" / "data").iterdir())
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0x40
    data.chmod(0o644)
    data.write_bytes(bytes(raw))
    target = zeros_like(state)
    with pytest.raises(IntegrityError):
        loader.load("step-5", into=target)
    loader.close()


@pytest.mark.unit
def test_a_plain_valued_item_is_refilled_in_the_callers_dict(tmp_path) -> None:
    shardckpt.save({"train": {"step": 9, "history": [1, 2]}}, str(tmp_path / "sc" / "step-9"), step=9)
    into = {"train": {"step": 0}}
    manager(str(tmp_path / "sc")).load("step-9", into=into)
    assert into["train"] == {"step": 9, "history": [1, 2]}


@pytest.mark.unit
@pytest.mark.parametrize("shape", [(3, 3), (8, 8), (30,)])
def test_its_own_format_into_a_target_of_another_shape_is_refused_not_filled_in_part(tmp_path, shape) -> None:
    # Found by an outside test: through the fallback (DefaultResharder) a 3x3 target got the 6x5 tensor's corner,
    # an 8x8 one a corner with its old values around it, a (30,) one nothing at all, with a log line only.
    state = payload(3)
    with_us = manager(str(tmp_path / "run"))
    with_us.save("step_3", state)
    target = zeros_like(state)
    target["model"]["w"] = torch.full(shape, 7.0)
    with pytest.raises(ShardckptError, match=r"'model'.*'w'.*\[6, 5\]"):
        with_us.load("step_3", into=target)
    assert torch.equal(target["model"]["w"], torch.full(shape, 7.0))  # refused before anything was written
    assert_same(with_us.load("step_3", into=zeros_like(state)), state)
    with_us.close()


@pytest.mark.unit
def test_paths_never_leave_the_root(tmp_path) -> None:
    storage = ShardckptStorageConfig(root=str(tmp_path / "run")).create_storage()
    with pytest.raises(ShardckptError, match="leaves the storage root"):
        storage.key(Path("../other/step_1"))
    assert storage.key(Path("/step_1/./model_0.pt")) == "step_1/model_0.pt"


@pytest.mark.unit
@pytest.mark.filterwarnings("ignore::shardckpt.storage.base.SingleCoordinatorCommitWarning")
def test_a_memory_root_commits_the_directory_not_an_empty_object() -> None:
    # Found by an outside test: memory:// gives a directory a size (0), so the commit took the staging directory
    # for one object and "renamed" it by writing an empty object step_1: the save returned, nothing loadable there.
    state = payload(4)
    with_us = manager("memory://tc-memory-root")
    with_us.save("step_4", state)
    backend = ShardckptStorageConfig(root="memory://tc-memory-root").create_storage().backend_at("")
    assert "model_0.pt" in backend.list("step_4") and not backend.list("tmp_step_4")
    assert_same(with_us.load("step_4", into=zeros_like(state)), state)
    with_us.close()


@pytest.mark.unit
@pytest.mark.filterwarnings("ignore::shardckpt.storage.base.SingleCoordinatorCommitWarning")
def test_an_object_store_commit_whose_claim_was_taken_over_never_commits(monkeypatch) -> None:
    # Found by an outside test: a second save of the same id (a zombie job beside its restart) takes a claim with
    # no commit for a dead one and deletes what the first copied so far; the first then went on and wrote the
    # commit marker over a mix of both saves' objects, some missing. It checks its claim before committing now.
    storage = ShardckptStorageConfig(root="memory://tc-takeover").create_storage()
    backend = storage.backend_at("")
    for name in ("a.pt", "b.pt", "c.pt"):
        backend.write_new(f"tmp_step_1/{name}", name.encode() * 10)
    copy = storage._copy
    copied: list[str] = []

    def copy_then_taken_over(src: str, dst: str) -> None:
        copy(src, dst)
        copied.append(dst)
        if len(copied) == 2:  # the other save arrives: it clears the unfinished claim and takes its own
            for name in list(storage._walk("step_1")):
                backend.delete(name)
            backend.commit_marker(f"step_1/{PENDING_MARKER}", b"the other save")

    monkeypatch.setattr(storage, "_copy", copy_then_taken_over)
    with pytest.raises(ShardckptError, match="step_1"):
        storage.rename(Path("tmp_step_1"), Path("step_1"), is_directory=True)
    assert not backend.exists(f"step_1/{COMMITTED_MARKER}")
    assert sorted(backend.list("tmp_step_1")) == ["a.pt", "b.pt", "c.pt"]  # the staging copy is kept


@pytest.mark.s3
def test_on_s3_a_commit_is_one_conditional_create_and_a_torn_one_stays_invisible(s3_url: str) -> None:
    state = payload(7)
    with_us = manager(s3_url)
    with_us.save("step_7", state)
    storage = ShardckptStorageConfig(root=s3_url).create_storage()
    assert storage.exists(Path("step_7")) and not storage.exists(Path("tmp_step_7"))
    assert COMMITTED_MARKER not in storage.ls(Path("step_7"))
    assert_same(with_us.load("step_7", into=zeros_like(state)), state)

    # A rename that died after claiming the destination and copying part of it: nothing there exists yet...
    backend = storage.backend_at("")
    backend.commit_marker(f"step_8/{PENDING_MARKER}", b"")
    backend.write_new("step_8/model_0.pt", b"half of a copy")
    assert not storage.exists(Path("step_8")) and not storage.isdir(Path("step_8"))
    with pytest.raises(FileNotFoundError):
        with_us.load("step_8", into=zeros_like(state))
    # ... and the next save of that id redoes the commit over it.
    with_us.save("step_8", payload(8))
    assert_same(with_us.load("step_8", into=zeros_like(payload(8))), payload(8))
    with pytest.raises(AlreadyExistsError):
        with_us.save("step_8", payload(9))
    with_us.close()


@pytest.mark.dist
def test_two_ranks_save_and_any_world_size_loads_bit_equal_to_its_own_backend(tmp_path) -> None:
    """FSDP2 + AdamW on 2 gloo ranks saved by CheckpointManager through shardckpt storage (async, its writer
    subprocess), through its own local backend, and by shardckpt.save; loaded on 1 and 3 ranks."""
    args = {
        "root": str(tmp_path / "ours"),
        "id": "step_3",
        "own_root": str(tmp_path / "theirs"),
        "shardckpt_url": str(tmp_path / "sc" / "step-3"),
        "async": True,
    }
    saved = run_ranks("save", 2, args, worker=WORKER, timeout=240)
    assert all(r and r["ok"] for r in saved), saved
    expected = saved[0]["value"]["digests"]
    for world in (1, 3):
        tensors_only = world > 2  # see tc_worker.scenario_load: its own format's plain items
        loads = {
            "through shardckpt storage": {"root": args["root"], "id": "step_3", "tensors_only": tensors_only},
            "its own backend": {"own": True, "id": str(tmp_path / "theirs" / "step_3"), "tensors_only": tensors_only},
            "a shardckpt checkpoint": {"root": str(tmp_path / "sc"), "id": "step-3"},
        }
        results = run_ranks("load", world, {"loads": loads}, worker=WORKER)
        assert all(r and r["ok"] for r in results), (world, results)
        for result in results:
            for what in loads:
                assert result["value"][what]["digests"] == expected, (what, world)
        assert results[0]["value"]["a shardckpt checkpoint"]["extra"] == {"epoch": 3, "tag": "tc"}
