"""The local tier in one process (issue 28): retention keeps the newest K local checkpoints, a restart resumes
from the newest local step above the persistent one, a corrupt local copy falls back to the persistent tier with
a warning and the state untouched by it, another job's local checkpoints are never used and are deleted."""

from __future__ import annotations

import os

import fsspec
import pytest
import torch

import shardckpt
from shardckpt import knobs
from shardckpt.catalog.local_tier import JOB_KEY, LocalTierWarning, inventory
from shardckpt.errors import ShardckptUsageError
from shardckpt.storage import open_storage
from shardckpt.storage.volatile import VolatileStorage, file_system_type, open_local_tier

pytestmark = pytest.mark.unit


def state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4) + step, "n": torch.tensor([step])}


def manager(tmp_path, **kwargs) -> shardckpt.Checkpointer:
    options = {"every_steps": 4, "local_every_steps": 1, "local_keep": 2, "preemption_signals": ()}
    options.update(kwargs)
    return shardckpt.Checkpointer(str(tmp_path / "persistent"), local_root=str(tmp_path / "local"), **options)


def run(tmp_path, steps: range, **kwargs) -> None:
    saver = manager(tmp_path, **kwargs)
    for step in steps:
        saver.maybe_save(step, state(step))
    saver.close()


def local_steps(tmp_path) -> list[int | None]:
    return sorted(copy.step for copy in inventory(open_storage(str(tmp_path / "local"))))


def test_local_saves_between_persistent_ones_are_kept_k_deep_and_resumed_from(tmp_path) -> None:
    run(tmp_path, range(1, 7))
    assert local_steps(tmp_path) == [5, 6]  # 4 is persistent only; local_keep=2
    taken = manager(tmp_path).tier.footprint(0)
    data = sum(p.stat().st_size for p in (tmp_path / "local").glob("*/data/*"))
    assert (taken.checkpoints, taken.own_bytes, taken.replica_bytes) == (2, data, 0) and taken.other_bytes > 0
    assert shardckpt.latest(str(tmp_path / "persistent")).endswith("step-00000004")
    restored = state(0)
    assert manager(tmp_path).restore_latest(restored) == 6
    assert all(torch.equal(restored[k], state(6)[k]) for k in restored)
    # The planner's in-memory copy of the local manifests lives in fsspec's process-wide store: gone afterwards.
    assert not [path for path in fsspec.filesystem("memory").store if path.startswith("/shardckpt-tier/")]


def flip_last_byte(tmp_path, name: str) -> None:
    data = tmp_path / "local" / name / "data"
    path = data / os.listdir(data)[0]
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # a flipped bit in the last tensor's bytes: the file keeps its size
    path.write_bytes(bytes(raw))


def test_a_corrupt_local_copy_falls_back_to_an_older_one_then_to_the_persistent_checkpoint(tmp_path) -> None:
    run(tmp_path, range(1, 7))
    older, newest = sorted(os.listdir(tmp_path / "local"))
    flip_last_byte(tmp_path, newest)
    restored = state(0)
    with pytest.warns(LocalTierWarning, match="nothing of it used"):
        assert manager(tmp_path).restore_latest(restored) == 5
    assert all(torch.equal(restored[k], state(5)[k]) for k in restored)
    flip_last_byte(tmp_path, older)
    restored = state(0)
    with pytest.warns(LocalTierWarning, match="nothing of it used"):
        assert manager(tmp_path).restore_latest(restored) == 4
    assert all(torch.equal(restored[k], state(4)[k]) for k in restored)


def test_a_local_save_that_never_committed_is_cleaned_by_the_next_once_old(tmp_path, monkeypatch) -> None:
    run(tmp_path, range(1, 3))
    leftover = tmp_path / "local" / "step-00000009-0123abcd"  # a crash mid-save left data and no COMMITTED
    (leftover / "data").mkdir(parents=True)
    (leftover / "data" / "00000-0123abcd.safetensors").write_bytes(b"partial")
    (tmp_path / "local" / "notes.txt").write_text("not ours")
    run(tmp_path, range(3, 4))
    assert leftover.exists()  # young: another job sharing the root may still be writing it
    monkeypatch.setattr(knobs, "LOCAL_TIER_GRACE", 0.0)
    run(tmp_path, range(4, 6))
    assert not leftover.exists() and (tmp_path / "local" / "notes.txt").exists()


def test_another_jobs_local_checkpoints_are_never_used_and_are_deleted(tmp_path, monkeypatch) -> None:
    run(tmp_path, range(1, 4), local_job="yesterday's job")  # steps 1..3 in the local root, no persistent one
    restored = state(0)
    with pytest.warns(LocalTierWarning, match="another job"):
        assert manager(tmp_path).restore_latest(restored) is None
    assert torch.equal(restored["w"], state(0)["w"])
    run(tmp_path, range(1, 2))
    assert {c.job for c in inventory(open_storage(str(tmp_path / "local")))} == {
        str(tmp_path / "persistent"),
        "yesterday's job",
    }
    monkeypatch.setattr(knobs, "LOCAL_TIER_GRACE", 0.0)
    run(tmp_path, range(2, 3))  # once older than the grace period, the other job's copies go
    copies = inventory(open_storage(str(tmp_path / "local")))
    assert sorted(c.step for c in copies) == [1, 2] and {c.job for c in copies} == {str(tmp_path / "persistent")}
    assert JOB_KEY == "shardckpt.tier.job"


def test_another_spelling_of_the_persistent_root_is_the_same_job(tmp_path, monkeypatch) -> None:
    run(tmp_path, range(1, 4))
    monkeypatch.chdir(tmp_path)
    restored = state(0)
    again = shardckpt.Checkpointer("./persistent/", local_root="local", local_every_steps=1, preemption_signals=())
    assert again.restore_latest(restored) == 3


def test_local_tier_arguments_and_media(tmp_path) -> None:
    for bad in ({"local_keep": 0}, {"local_every_steps": 0}, {"peers": -1}, {"peers": True}):
        with pytest.raises(ShardckptUsageError):
            manager(tmp_path, **bad)
    with pytest.raises(ShardckptUsageError, match="local_root"):
        shardckpt.Checkpointer(str(tmp_path / "p"), local_root="s3://bucket/local")
    for inside in ("p", "p/local", "."):  # the same directory, or one inside the other: listed as each other's
        with pytest.raises(ShardckptUsageError, match="overlap"):
            shardckpt.Checkpointer(str(tmp_path / "p"), local_root=str(tmp_path / inside))
    assert isinstance(open_local_tier(str(tmp_path), durable=False), VolatileStorage)
    assert not isinstance(open_local_tier(str(tmp_path), durable=True), VolatileStorage)
    if file_system_type("/dev/shm") == "tmpfs":
        assert isinstance(open_local_tier("/dev/shm/shardckpt-test-never-created"), VolatileStorage)


def test_a_failed_local_save_warns_and_training_goes_on(tmp_path) -> None:
    (tmp_path / "local").write_text("a file where the local root should be: every local write fails")
    with pytest.warns(LocalTierWarning, match="local save of step 1 failed"):
        run(tmp_path, range(1, 5))
    assert shardckpt.latest(str(tmp_path / "persistent")).endswith("step-00000004")


def test_a_state_that_does_not_fit_the_local_checkpoint_raises_rather_than_starting_over(tmp_path) -> None:
    run(tmp_path, range(1, 4))  # local steps only: no persistent checkpoint to fall back to
    wrong = {"w": torch.zeros(5, 4), "n": torch.tensor([0])}
    with pytest.raises(shardckpt.DistributedError, match="global shape"):
        manager(tmp_path).restore_latest(wrong)
    assert torch.equal(wrong["w"], torch.zeros(5, 4))


def test_two_jobs_sharing_a_local_root_keep_their_own_newest_local_checkpoints(tmp_path) -> None:
    # Job "a" holds local steps 2 and 3 (young: within the grace period); job "b" on the same local root runs to
    # step 5. Retention counts each job's copies alone: b's higher steps never push a's out, nor a's b's.
    run(tmp_path, range(1, 4), local_job="a", every_steps=100)
    run(tmp_path, range(4, 6), local_job="b", every_steps=100)
    run(tmp_path, range(1, 2), local_job="c", every_steps=100)  # a third job's lower step neither
    copies = inventory(open_storage(str(tmp_path / "local")))
    assert sorted((c.job, c.step) for c in copies) == [("a", 2), ("a", 3), ("b", 4), ("b", 5), ("c", 1)]
    restored = state(0)
    assert manager(tmp_path, local_job="a", every_steps=100).restore_latest(restored) == 3
    assert all(torch.equal(restored[k], state(3)[k]) for k in restored)


def test_a_local_root_whose_name_is_not_utf8_saves_and_resumes(tmp_path) -> None:
    # A directory name with a byte that is not UTF-8 (os.fsdecode gives a surrogate): the node's directory and the
    # file's path are recorded and exchanged all the same (msgpack refused the str: an untyped crash on every save).
    options = {"every_steps": 4, "local_every_steps": 1, "preemption_signals": ()}
    local = os.path.join(str(tmp_path), "local-\udcff")
    saver = shardckpt.Checkpointer(str(tmp_path / "persistent"), local_root=local, **options)
    saver.maybe_save(1, state(1))
    saver.close()
    restored = state(0)
    assert (
        shardckpt.Checkpointer(str(tmp_path / "persistent"), local_root=local, **options).restore_latest(restored) == 1
    )
    assert all(torch.equal(restored[k], state(1)[k]) for k in restored)


def test_gc_on_a_shared_local_root_keeps_the_newest_of_each_job(tmp_path) -> None:
    # As the Checkpointer's local retention: `gc --keep-last 1` on a node's local root keeps each job's newest local
    # checkpoint, however much newer another job's steps are (a root-wide count would delete job a's and c's only ones).
    from shardckpt.ops.gc import collect, plan_gc

    run(tmp_path, range(1, 4), local_job="a", every_steps=100)
    run(tmp_path, range(4, 6), local_job="b", every_steps=100)
    run(tmp_path, range(1, 2), local_job="c", every_steps=100)
    local = str(tmp_path / "local")
    plan = plan_gc(local, keep_last=1, grace=0)  # every copy just committed: no grace, as when no save is running
    assert sorted(action.reason for action in plan.actions) == ["committed, older than the newest 1 of its job"] * 2
    collect(plan)
    assert sorted((c.job, c.step) for c in inventory(open_storage(local))) == [("a", 3), ("b", 5), ("c", 1)]


def test_gc_on_a_local_root_keeps_a_copy_while_the_next_newer_one_is_young(tmp_path) -> None:
    # Each node commits its copy of a local save on its own. `gc --keep-last 1` on a node that had just committed
    # step 3 deleted step 2 there while other nodes had not committed step 3 yet: a kill then (a spot loss mid-save)
    # left step 3 incomplete across the nodes and step 2 too (peers=0, or 4+ nodes with gc on several): the local
    # tier lost. Within the grace period the older copy stays, and gc says why.
    import time

    from shardckpt.ops.gc import plan_gc

    run(tmp_path, range(1, 4), every_steps=100)  # local_keep=2: steps 2 and 3, just committed
    local = str(tmp_path / "local")
    names = sorted(os.listdir(local))
    plan = plan_gc(local, keep_last=1)
    assert plan.actions == [], plan.actions
    assert [skipped.checkpoint for skipped in plan.skipped] == [names[0]], plan.skipped
    assert "maybe not yet on every node" in plan.skipped[0].reason, plan.skipped[0].reason
    later = plan_gc(local, keep_last=1, now=time.time() + knobs.GC_GRACE + 1)
    assert [action.checkpoint for action in later.actions] == [names[0]], later.actions


def test_a_failed_local_save_leaves_nothing_behind_so_a_full_tmpfs_recovers(tmp_path, monkeypatch) -> None:
    # tmpfs full mid-save: the failed attempt's partial files, kept for the grace period, would keep it full and
    # fail every later local save (pruning runs only after a save that succeeds). The node deletes them at once.
    from shardckpt.distributed import tier_save

    saver = manager(tmp_path)
    for step in (1, 2):
        saver.maybe_save(step, state(step))
    real = tier_save.build_manifest

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tier_save, "build_manifest", full)  # after the data file and local manifest are written
    with pytest.warns(LocalTierWarning, match="local save of step 3 failed"):
        saver.maybe_save(3, state(3))
    assert sorted(name[:13] for name in os.listdir(tmp_path / "local")) == ["step-00000001", "step-00000002"]
    monkeypatch.setattr(tier_save, "build_manifest", real)
    saver.maybe_save(5, state(5))
    saver.close()
    assert local_steps(tmp_path) == [2, 5]


def test_a_local_copy_whose_committed_does_not_read_is_left_aside_with_a_warning(tmp_path) -> None:
    run(tmp_path, range(1, 7))
    newest = tmp_path / "local" / sorted(os.listdir(tmp_path / "local"))[-1]
    marker = newest / "COMMITTED"
    marker.chmod(0o644)
    marker.write_text("not a marker")  # the newest save resumes no more: the user must learn why
    restored = state(0)
    with pytest.warns(LocalTierWarning, match=f"{newest.name}.* left aside"):
        assert manager(tmp_path).restore_latest(restored) == 5
    assert all(torch.equal(restored[k], state(5)[k]) for k in restored)


def test_of_two_local_saves_of_one_step_a_restore_takes_the_later(tmp_path, monkeypatch) -> None:
    # A run resumed from the persistent step 2 (its local tier out of reach at the time) trains step 3 again, with
    # other data, and saves it locally beside the first run's step 3. The later save is the newest (SPEC 14's
    # order: step, then commit time), whatever the random attempt ids say.
    from shardckpt.format import layout

    monkeypatch.setattr(layout, "new_attempt", lambda: "f" * 16)
    run(tmp_path, range(1, 4), every_steps=2)  # persistent 2, local 1 and 3
    monkeypatch.setattr(layout, "new_attempt", lambda: "0" * 16)
    again = manager(tmp_path, every_steps=2)
    again.maybe_save(3, {"w": state(3)["w"] + 100, "n": torch.tensor([3])})
    again.close()
    restored = state(0)
    assert manager(tmp_path, every_steps=2).restore_latest(restored) == 3
    assert torch.equal(restored["w"], state(3)["w"] + 100)


def test_a_node_directory_wiped_mid_save_is_not_committed(tmp_path, monkeypatch) -> None:
    # The node's directory goes (an operator's rm -rf, a tmpfs cleaner) after the ranks wrote and before the node
    # commits: writing the manifests recreates it, and a COMMITTED there would report a save that cannot restore.
    import shutil

    from shardckpt.distributed import tier_save

    saver = manager(tmp_path)
    for step in (1, 2):
        saver.maybe_save(step, state(step))
    real = tier_save.build_manifest

    def wiped(*args, **kwargs):
        for name in os.listdir(tmp_path / "local"):
            if name.startswith("step-00000003-"):
                shutil.rmtree(tmp_path / "local" / name)
        return real(*args, **kwargs)

    monkeypatch.setattr(tier_save, "build_manifest", wiped)
    with pytest.warns(LocalTierWarning, match="local save of step 3 failed.*vanished"):
        saver.maybe_save(3, state(3))
    saver.close()
    assert local_steps(tmp_path) == [1, 2]


def killed_mid_save(tmp_path, monkeypatch, step: int, **kwargs) -> str:
    """A local save killed after its data file is written and before anything commits (a SIGKILL, a preemption):
    nothing of the dying process cleans up; the name of the save it leaves."""
    from shardckpt.distributed import tier_save

    class Killed(BaseException):
        pass

    def kill(*args, **kwargs):
        raise Killed

    before = set(os.listdir(tmp_path / "local")) if (tmp_path / "local").exists() else set()
    with monkeypatch.context() as patch:
        patch.setattr(tier_save, "build_manifest", kill)
        with pytest.raises(Killed):
            manager(tmp_path, **kwargs).maybe_save(step, state(step))
    (left,) = set(os.listdir(tmp_path / "local")) - before
    assert os.listdir(tmp_path / "local" / left / "data")  # its data file takes room on the node
    return left


def test_a_restarted_job_deletes_its_own_crash_leftovers_at_once_and_waits_for_other_jobs(
    tmp_path, monkeypatch
) -> None:
    # A tmpfs sized for local_keep + 1 checkpoints: a crashed save's files kept for the grace period (600 s) would
    # fail every local save of the restarted job with ENOSPC. Its name tells the job from the first file on.
    run(tmp_path, range(1, 3))
    others = killed_mid_save(tmp_path, monkeypatch, 7, local_job="another job")
    mine = killed_mid_save(tmp_path, monkeypatch, 3)
    restored = state(0)
    assert manager(tmp_path).restore_latest(restored) == 2  # at restore: gone before any save
    assert not (tmp_path / "local" / mine).exists() and (tmp_path / "local" / others).exists()
    mine = killed_mid_save(tmp_path, monkeypatch, 3)
    run(tmp_path, range(3, 4))  # a restart without a restore: before its first local save
    assert not (tmp_path / "local" / mine).exists() and (tmp_path / "local" / others).exists()
    assert local_steps(tmp_path) == [2, 3]
    monkeypatch.setattr(knobs, "LOCAL_TIER_GRACE", 0.0)
    run(tmp_path, range(5, 6))  # another job's leftover: once older than the grace period
    assert not (tmp_path / "local" / others).exists()
