"""gc against a save that is only paused (issue 23.10, SPEC 14 claims): a commit held up past gc's grace period and
the gc that takes it for an abandoned save never both win, whichever acts first, on local disk and on S3.

The pause is a hook, not a sleep: gc runs inside the save (just before its commit, or just before COMMITTED) with a
clock 4 s ahead and a grace of 2 s, as `shardckpt gc --grace 2` would during a commit stalled 4 s."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import shardckpt
import shardckpt.ops.gc as gc_module
import shardckpt.write.commit as commit_module
from shardckpt.errors import CommitConflictError, ShardckptError
from shardckpt.ops.gc import GcPlan, gc
from shardckpt.storage import open_storage
from tests.helpers.checkpoints import sample_state

STALL, GRACE = 4.0, 2.0


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return str(tmp_path / "root") if request.param == "local" else str(request.getfixturevalue("s3_url"))


def _gc_during_stall(root: str) -> GcPlan:
    return gc(root, keep_last=1, grace=GRACE, now=time.time() + STALL)


def _loads(url: str, seed: int) -> bool:
    checkpoint = shardckpt.open(url)
    return all(torch.equal(checkpoint.read(name), tensor) for name, tensor in sample_state(seed).items())


def _save_with(root: str, monkeypatch: pytest.MonkeyPatch, hook: Callable[[], None], where: str) -> str:
    """Save step-2 with `hook` run just before the commit claims its attempt ('before_commit') or just before
    COMMITTED is created ('marker'); step-1 is an older committed checkpoint."""
    shardckpt.save(sample_state(1), f"{root}/step-1", step=1)
    if where == "before_commit":
        real_point = commit_module.crash_point

        def point(name: str, rank: int | None = None) -> None:
            if name == "before_commit":
                hook()
            real_point(name, rank)

        monkeypatch.setattr(commit_module, "crash_point", point)
    else:
        cls = type(open_storage(root))
        real_marker = cls.commit_marker

        def marker(self, path: str, data: bytes) -> None:  # type: ignore[no-untyped-def]
            if path == "COMMITTED" and self.url.endswith("/step-2"):
                hook()
            real_marker(self, path, data)

        monkeypatch.setattr(cls, "commit_marker", marker)
    return f"{root}/step-2"


def test_gc_collects_a_save_paused_before_its_commit_and_the_save_then_commits_nothing(
    root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    plans: list[GcPlan] = []
    url = _save_with(root, monkeypatch, lambda: plans.append(_gc_during_stall(root)), "before_commit")
    with pytest.raises(CommitConflictError, match="nothing was committed") as caught:
        shardckpt.save(sample_state(2), url, step=2)
    assert "grace period" in str(caught.value)
    assert [(a.checkpoint, a.kind) for a in plans[0].actions] == [("step-2", "incomplete")] and plans[0].ok
    assert shardckpt.latest(root) == f"{root}/step-1" and _loads(f"{root}/step-1", 1)
    assert not open_storage(url).exists("COMMITTED")


def test_a_save_whose_commit_claimed_first_commits_whole_and_gc_leaves_it(
    root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    plans: list[GcPlan] = []
    url = _save_with(root, monkeypatch, lambda: plans.append(_gc_during_stall(root)), "marker")
    shardckpt.save(sample_state(2), url, step=2)
    assert [a.checkpoint for a in plans[0].actions] == []
    assert any(s.checkpoint == "step-2" and "claimed by their commit" in s.reason for s in plans[0].skipped)
    assert shardckpt.latest(root) == url and _loads(url, 2)
    assert "claim-" not in " ".join(open_storage(url).list())  # released once COMMITTED exists
    plan = gc(root, keep_last=1, grace=GRACE, now=time.time() + STALL)
    assert plan.ok and [(a.checkpoint, a.kind) for a in plan.actions] == [("step-1", "prune")]
    assert _loads(url, 2)


class _Crash(BaseException):
    """Stands for SIGKILL of gc: nothing after it runs."""


def test_a_collection_interrupted_mid_way_keeps_its_claim_so_the_paused_save_still_commits_nothing(
    root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crashing_gc() -> None:
        def point(name: str, rank: int | None = None) -> None:
            if name == "during_gc":
                raise _Crash

        monkeypatch.setattr(gc_module, "crash_point", point)
        with pytest.raises(_Crash):
            _gc_during_stall(root)
        monkeypatch.setattr(gc_module, "crash_point", lambda name, rank=None: None)

    url = _save_with(root, monkeypatch, crashing_gc, "before_commit")
    with pytest.raises(CommitConflictError, match="a collector claimed"):
        shardckpt.save(sample_state(2), url, step=2)
    assert not open_storage(url).exists("COMMITTED")
    plan = gc(root, grace=3600)  # the interrupted collection resumes at once: that attempt can never commit
    assert plan.ok and [(a.checkpoint, a.kind) for a in plan.actions] == [("step-2", "incomplete")]
    assert shardckpt.latest(root) == f"{root}/step-1"


def test_a_commit_that_crashed_holding_its_claim_is_left_whole_and_said_so(tmp_path: Path, monkeypatch) -> None:
    url = str(tmp_path / "step-1")

    def crash(*args: object, **kwargs: object) -> None:
        raise _Crash

    monkeypatch.setattr(commit_module, "missing_files", crash)  # killed right after claiming: nothing released
    monkeypatch.setattr(commit_module, "release", lambda *args: None)
    with pytest.raises(_Crash):
        shardckpt.save(sample_state(1), url, step=1)
    monkeypatch.undo()
    before = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    assert "step-1/claim-" in " ".join(before)
    plan = gc(str(tmp_path), grace=0)
    assert plan.actions == [] and "claimed by their commit" in plan.skipped[0].reason
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == before
    with pytest.raises(ShardckptError):
        shardckpt.open(url)


def test_gc_collects_an_uncommitted_checkpoint_holding_a_temporary_commit_marker(tmp_path: Path) -> None:
    """A save killed while committing leaves COMMITTED's temporary file (`COMMITTED.tmp-<hex>`, no attempt in its
    name) in an uncommitted checkpoint: gc collects it instead of failing on an empty attempt id (seen in the
    incremental soak)."""
    root = tmp_path / "run"
    shardckpt.save({"w": torch.ones(2)}, str(root / "step-00000001"), step=1)
    leftover = root / "step-00000002"
    leftover.mkdir()
    (leftover / "COMMITTED.tmp-0123abcd").write_bytes(b"{")
    gc(str(root), keep_last=3, grace=0)
    assert not leftover.exists() and (root / "step-00000001" / "COMMITTED").exists()
