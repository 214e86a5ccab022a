"""`shardckpt gc ROOT` and shardckpt.ops.gc: what it deletes, what it never deletes, and crashes in the middle of it.

Never: the newest committed checkpoint, a file of a committed attempt, a name the layout does not give, anything
modified within the grace period, anything of unknown age, anything outside ROOT (links included).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import fsspec
import pytest
import torch

import shardckpt
import shardckpt.ops.gc as gc_module
from shardckpt.cli import main as cli_main
from shardckpt.format import layout
from shardckpt.ops.gc import collect, gc, plan_gc
from shardckpt.ops.verify import verify
from shardckpt.storage import LocalStorage, open_storage
from shardckpt.testing.faults import Fault, FaultyStorage
from tests.helpers.checkpoints import sample_state, save_sharded

OLD, HOUR = 7200.0, 3600.0


def _age(path: Path, seconds: float) -> None:
    """Make everything below `path` (and `path`) look last modified `seconds` ago."""
    stamp = time.time() - seconds
    for item in [path, *path.rglob("*")]:
        os.utime(item, (stamp, stamp), follow_symlinks=False)


def _failed_attempt(url: str, attempt: str, step: int) -> None:
    writer = shardckpt.ShardWriter(url, rank=0, world_size=2, attempt=attempt, step=step)
    writer.add("w", torch.ones(2, 3), global_shape=(4, 3), offsets=(0, 0))
    writer.close()


def build_root(root: Path) -> None:
    """step-1..4 committed (step-1 also holds a user's notes.txt); step-4 holds an old failed attempt, step-3 a
    fresh one; step-5 is an old failed save, step-6 a save in progress; broken has a garbage COMMITTED; logs/ and
    README are not checkpoints."""
    for step in range(1, 5):
        save_sharded(sample_state(step), str(root / f"step-{step}"), 2, step=step)
    _failed_attempt(str(root / "step-4"), "deadold", 4)
    _failed_attempt(str(root / "step-5"), "deadsave", 5)
    (root / "step-1" / "notes.txt").write_text("my notes")
    save_sharded(sample_state(9), str(root / "broken"), 1, step=9)
    (root / "broken" / "COMMITTED").write_text("{not json")
    (root / "logs").mkdir()
    (root / "logs" / "train.log").write_text("loss 1.0")
    (root / "README").write_text("my runs")
    _age(root, OLD)
    _failed_attempt(str(root / "step-3"), "deadfresh", 3)
    _failed_attempt(str(root / "step-6"), "running", 6)


@pytest.fixture
def root(tmp_path) -> Path:
    path = tmp_path / "root"
    build_root(path)
    return path


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _assert_committed_load(root: Path) -> list[str]:
    """Every committed checkpoint under `root` verifies and reads back bit-exact; returns their names."""
    names = []
    for child in sorted(root.iterdir()):
        if child.name == "broken" or not (child / layout.COMMITTED).exists():
            continue
        step = int(child.name.split("-")[1])
        assert verify(str(child)).ok, child
        checkpoint = shardckpt.open(str(child))
        for name, tensor in sample_state(step).items():
            assert torch.equal(checkpoint.read(name), tensor), (child, name)
        names.append(child.name)
    return names


def test_gc_deletes_exactly_what_it_may(root: Path) -> None:
    before = _tree(root)
    plan = gc(str(root), keep_last=2)
    assert plan.ok
    done = {(a.checkpoint, a.kind) for a in plan.actions}
    assert done == {("step-1", "prune"), ("step-2", "prune"), ("step-4", "leftovers"), ("step-5", "incomplete")}
    after = _tree(root)
    assert sorted(p for p in after if p.startswith("step-1")) == ["step-1/notes.txt"]  # not ours: kept, dir too
    assert not (root / "step-2").exists() and not (root / "step-5").exists()
    assert not any("deadold" in p for p in after)  # leftovers of a failed attempt in a committed checkpoint
    assert any("deadfresh" in p for p in after)  # ... unless younger than the grace period
    assert any(p.startswith("step-6/") for p in after)  # a save in progress
    for kept in ("broken/", "logs/", "README", "step-3/", "step-4/", "step-6/"):
        assert {p: b for p, b in before.items() if p.startswith(kept) and "deadold" not in p} == {
            p: b for p, b in after.items() if p.startswith(kept)
        }, kept
    assert _assert_committed_load(root) == ["step-3", "step-4"]
    with pytest.warns(UserWarning, match="broken"):
        assert shardckpt.latest(str(root)) == str(root / "step-4")
    skipped = {s.checkpoint: s.reason for s in plan.skipped}
    assert "unreadable" in skipped["broken"] and "grace" in skipped["step-6"] and "younger" in skipped["step-3"]
    assert plan.kept == ["step-3", "step-4"]


def test_the_newest_committed_checkpoint_is_never_deleted(root: Path) -> None:
    with pytest.raises(shardckpt.ShardckptUsageError):
        plan_gc(str(root), keep_last=0)
    gc(str(root), keep_last=1, grace=0)
    assert _assert_committed_load(root) == ["step-4"]
    assert not (root / "step-6").exists()  # with no grace period a stale save goes too
    gc(str(root), keep_last=1, grace=0)  # idempotent
    assert _assert_committed_load(root) == ["step-4"]


def test_without_keep_last_only_leftovers_go(root: Path) -> None:
    plan = gc(str(root), grace=HOUR)
    assert {a.kind for a in plan.actions} == {"leftovers", "incomplete"}
    assert _assert_committed_load(root) == ["step-1", "step-2", "step-3", "step-4"]


def test_objects_of_unknown_age_are_kept(root: Path, monkeypatch) -> None:
    monkeypatch.setattr(LocalStorage, "modified", lambda self, path: None)
    plan = plan_gc(str(root), keep_last=10, grace=0)
    assert plan.actions == []
    assert "unknown age" in {s.checkpoint: s.reason for s in plan.skipped}["step-5"]


def test_nothing_outside_root_is_touched(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    for step in (1, 2, 3):
        save_sharded(sample_state(step), str(outside / f"step-{step}"), 2, step=step)
    save_sharded(sample_state(4), str(root / "step-4"), 2, step=4)
    _failed_attempt(str(outside / "stale"), "deadsave", 5)
    _age(outside, OLD)
    os.symlink(outside / "step-1", root / "step-1")  # a committed checkpoint elsewhere, older than keep_last
    os.symlink(outside / "stale", root / "step-5")  # a stale failed save elsewhere
    (root / "step-2").mkdir()
    os.symlink(outside / "step-2" / "data", root / "step-2" / "data")  # a data directory elsewhere
    before = _tree(outside)
    storage = FaultyStorage(LocalStorage(str(root)))
    plan = gc(storage, keep_last=1, grace=0)
    assert plan.ok and _tree(outside) == before
    skipped = {s.checkpoint for s in plan.skipped}
    assert {"step-1", "step-2", "step-5"} <= skipped
    for op, path in storage.calls:
        if op == "delete":
            resolved = os.path.realpath(root / path)
            assert resolved.startswith(str(root.resolve()) + os.sep), path


def test_dry_run_and_json(root: Path) -> None:
    before = _tree(root)
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        assert cli_main(["gc", str(root), "--keep-last", "2", "--dry-run", "--json"]) == 0
    planned = json.loads(output.getvalue())
    assert planned["dry_run"] and _tree(root) == before
    paths = {(a["checkpoint"], p) for a in planned["actions"] for p in a["paths"]}
    assert ("step-1", "COMMITTED") in paths and ("step-4", "data/00000-deadold.safetensors") in paths
    assert not any(checkpoint in ("step-3", "step-6", "broken", "logs") for checkpoint, _ in paths)
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        assert cli_main(["gc", str(root), "--keep-last", "2", "--json"]) == 0
    done = json.loads(output.getvalue())
    assert {(a["checkpoint"], p) for a in done["actions"] for p in a["paths"]} == paths
    assert all(a["deleted"] == len(a["paths"]) and a["error"] is None for a in done["actions"])
    for path in before:
        assert ((root / path).exists()) == (not any(path == f"{c}/{p}" for c, p in paths)), path


def test_cli_table_exit_codes_and_usage(root: Path, capsys) -> None:
    assert cli_main(["gc", str(root), "--keep-last", "3"]) == 0
    out = capsys.readouterr().out
    assert "step-1: deleted" in out and "prune" in out and "step-6: kept" in out
    for bad in (["--keep-last", "0"], ["--grace", "-1"], ["--grace", "soon"]):
        with pytest.raises(SystemExit) as exit_info:
            cli_main(["gc", str(root), *bad])
        assert exit_info.value.code == 2
    failing = FaultyStorage(LocalStorage(str(root)), [Fault("delete", "step-3/data/*", times=0)])
    plan = gc(failing, grace=0)
    assert not plan.ok and any(a.error and "injected" in a.error for a in plan.actions)
    assert _assert_committed_load(root)[-2:] == ["step-3", "step-4"]


def test_a_checkpoint_committed_while_gc_runs_is_left_alone(root: Path) -> None:
    plan = plan_gc(str(root), grace=0)
    assert any(a.checkpoint == "step-6" and a.kind == "incomplete" for a in plan.actions)
    writer = shardckpt.ShardWriter(str(root / "step-6"), rank=1, world_size=2, attempt="running", step=6)
    writer.add("w", torch.ones(2, 3), global_shape=(4, 3), offsets=(2, 0))
    writer.close()
    shardckpt.commit(str(root / "step-6"), world_size=2, attempt="running")
    collect(plan)
    action = next(a for a in plan.actions if a.checkpoint == "step-6")
    assert action.deleted == 0 and action.note and plan.ok
    assert torch.equal(shardckpt.open(str(root / "step-6")).read("w"), torch.ones(4, 3))


class _Crash(BaseException):
    """Stands for SIGKILL: nothing after it runs, no except clause of the library catches it."""


@pytest.mark.slow
def test_a_crash_at_any_point_of_gc_leaves_every_surviving_checkpoint_loadable(tmp_path, monkeypatch) -> None:
    template = tmp_path / "template"
    build_root(template)
    clean = tmp_path / "clean"
    shutil.copytree(template, clean, symlinks=True)
    total = gc(str(clean), keep_last=2).objects
    assert total >= 12
    for crash_at in range(1, total + 1):
        root = tmp_path / f"crash{crash_at}"
        shutil.copytree(template, root, symlinks=True)
        deletions = iter(range(1, total + 1))

        def crash_point(point: str, rank: int | None = None, at: int = crash_at, seen=deletions) -> None:
            if point == "during_gc" and next(seen) == at:
                raise _Crash

        monkeypatch.setattr(gc_module, "crash_point", crash_point)
        with pytest.raises(_Crash):
            gc(str(root), keep_last=2)
        survivors = _assert_committed_load(root)
        assert {"step-3", "step-4"} <= set(survivors)  # the ones keep_last keeps are always there
        monkeypatch.undo()
        gc(str(root), keep_last=2)  # the next run finishes the job ...
        assert _assert_committed_load(root) == ["step-3", "step-4"]
        assert _tree(root) == _tree(clean)
        # ... but for directories the crash emptied just now: they go once the grace period has passed.
        gc(str(root), keep_last=2, now=time.time() + 2 * HOUR)
        assert sorted(os.listdir(root)) == ["README", "broken", "logs", "step-1", "step-3", "step-4"]
        assert _assert_committed_load(root) == ["step-3", "step-4"]


def test_sigkill_in_the_middle_of_gc_then_gc_again(root: Path) -> None:
    env = {**os.environ, "SHARDCKPT_CRASH_AT": "during_gc@8"}
    command = [sys.executable, "-m", "shardckpt.cli", "gc", str(root), "--keep-last", "2", "--json"]
    killed = subprocess.run(command, env=env, capture_output=True, timeout=120)
    assert killed.returncode == -9, killed.stderr.decode(errors="replace")
    assert {"step-3", "step-4"} <= set(_assert_committed_load(root))
    listing = io.StringIO()
    with contextlib.redirect_stdout(listing):
        assert cli_main(["ls", "--json", str(root)]) == 0
    statuses = {row["name"]: row["status"] for row in json.loads(listing.getvalue())["checkpoints"]}
    # Deletions 1-4 were step-4's leftovers and the stale step-5, 5 was step-1's COMMITTED: step-1 is half gone.
    assert statuses == {
        "step-1": "incomplete",
        "step-2": "committed",
        "step-3": "committed",
        "step-4": "committed",
        "step-6": "incomplete",
        "broken": "broken",
    }
    assert cli_main(["gc", str(root), "--keep-last", "2", "-q"]) == 0
    assert _assert_committed_load(root) == ["step-3", "step-4"]


def test_gc_on_an_fsspec_memory_root() -> None:
    url = f"memory://gc-tests/{uuid.uuid4().hex}"
    for step in (1, 2, 3):
        save_sharded(sample_state(step), f"{url}/step-{step}", 2, step=step)
    _failed_attempt(f"{url}/step-4", "deadsave", 4)
    storage = open_storage(url)
    assert storage.modified("step-1/COMMITTED") is not None
    plan = gc(url, keep_last=1, grace=0)
    assert plan.ok and {(a.checkpoint, a.kind) for a in plan.actions} == {
        ("step-1", "prune"),
        ("step-2", "prune"),
        ("step-4", "incomplete"),
    }
    assert shardckpt.latest(url) == f"{url}/step-3"
    assert storage.list() == ["step-3"]
    fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)


def test_gc_on_s3_dates_objects_through_fsspec_info(s3_url: str) -> None:
    for step in (1, 2):
        save_sharded(sample_state(step), f"{s3_url}/step-{step}", 2, step=step)
    _failed_attempt(f"{s3_url}/step-3", "deadsave", 3)
    storage = open_storage(s3_url)
    stamp = storage.modified("step-3/data/00000-deadsave.safetensors")
    assert stamp is not None and abs(stamp - time.time()) < 600
    planned = plan_gc(s3_url, keep_last=1)  # default grace: the failed save, seconds old, may be running
    assert [(a.checkpoint, a.kind) for a in planned.actions] == [("step-1", "prune")]
    plan = gc(s3_url, keep_last=1, grace=0)
    assert plan.ok and {(a.checkpoint, a.kind) for a in plan.actions} == {("step-1", "prune"), ("step-3", "incomplete")}
    assert storage.list() == ["step-2"]
    assert shardckpt.latest(s3_url) == f"{s3_url}/step-2"
    checkpoint = shardckpt.open(f"{s3_url}/step-2")
    for name, tensor in sample_state(2).items():
        assert torch.equal(checkpoint.read(name), tensor), name


def _start_upload(storage, path: str) -> str:
    """An unfinished multipart upload of `path` with one 5 MiB part, as a save killed while uploading leaves."""

    async def begin() -> str:
        key = storage.key(path)
        started = await storage.requests.call("create_multipart_upload", Bucket=storage.bucket, Key=key)
        upload_id = started["UploadId"]
        body = b"\0" * (5 << 20)
        await storage.requests.call(
            "upload_part", Bucket=storage.bucket, Key=key, UploadId=upload_id, PartNumber=1, Body=body
        )
        return str(upload_id)

    return storage.run(begin)


def test_gc_aborts_the_unfinished_uploads_a_killed_save_left_on_s3_once_the_grace_period_passed(s3_url) -> None:
    shardckpt.save(sample_state(), f"{s3_url}/step-1", step=1)
    root = open_storage(s3_url)
    ours = f"step-2/{layout.data_path(0, layout.new_attempt())}"
    _start_upload(root, ours)
    _start_upload(root, "step-2/notes.txt")  # not a name the layout gives: never touched
    young = plan_gc(s3_url, grace=3600)
    assert not young.actions and any("unfinished upload(s) with a part" in s.reason for s in young.skipped)
    plan = plan_gc(s3_url, grace=3600, now=time.time() + 7200)
    (action,) = plan.actions
    assert (action.checkpoint, action.kind, [d.path for d in action.objects]) == ("step-2", "uploads", [ours[7:]])
    assert action.bytes == 5 << 20 and plan.kept == ["step-1"]
    collect(plan)
    assert plan.ok and action.deleted == 1
    assert [upload.path for upload in root.unfinished_uploads()] == ["step-2/notes.txt"]
    shardckpt.load(sample_state(), f"{s3_url}/step-1")  # the committed checkpoint is untouched


def test_a_store_that_cannot_list_unfinished_uploads_still_gets_the_rest_of_gc(root: Path, monkeypatch) -> None:
    def refuse(self) -> tuple:
        raise shardckpt.StorageError("injected: ListMultipartUploads not implemented")

    monkeypatch.setattr(LocalStorage, "unfinished_uploads", refuse)
    plan = plan_gc(str(root), grace=0)
    assert plan.actions and any(s.checkpoint == "(unfinished uploads)" and "injected" in s.reason for s in plan.skipped)
