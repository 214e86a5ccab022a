"""Retention (Checkpointer, shardckpt.catalog.retention) and gc under hostile roots: links, foreign files, older runs.

Both must keep the newest committed checkpoint, never delete through a link, never leave the root, never delete a
name the layout does not give, and agree with latest() on which checkpoint is the newest.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardckpt
from shardckpt.catalog.retention import prune
from shardckpt.format import layout
from shardckpt.format.manifest import CommitMarker, encode_commit_marker
from shardckpt.ops.gc import gc
from shardckpt.ops.verify import verify
from shardckpt.storage import LocalStorage, open_storage
from shardckpt.testing.faults import FaultyStorage
from tests.helpers.checkpoints import sample_state, save_sharded

OLD = 7200.0


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _loads(url: str | Path, step: int) -> bool:
    """True when the checkpoint at `url` verifies and holds sample_state(step) bit for bit."""
    if not verify(str(url)).ok:
        return False
    checkpoint = shardckpt.open(str(url))
    return all(torch.equal(checkpoint.read(name), tensor) for name, tensor in sample_state(step).items())


def _state(value: float) -> dict:
    return {"w": torch.full((8, 4), value), "meta": {"value": value}}


def _step_dir(step: int) -> str:
    return f"step-{step:08d}"


# ------------------------------------------------------------------- finding 1: a link to a checkpoint in the root


@pytest.fixture
def linked_root(tmp_path: Path) -> Path:
    """step-100 and step-200 committed, `latest -> step-00000200` (a relative link, as people make them)."""
    root = tmp_path / "root"
    for step in (100, 200):
        save_sharded(sample_state(step), str(root / _step_dir(step)), 2, step=step)
    os.symlink(_step_dir(200), root / "latest")
    return root


@pytest.mark.parametrize("path", ["gc", "retention"])
def test_a_link_to_the_newest_checkpoint_is_an_alias_never_a_second_checkpoint(linked_root: Path, path: str) -> None:
    if path == "gc":
        plan = gc(str(linked_root), keep_last=1, grace=0)
        assert plan.ok and plan.kept == [_step_dir(200)]
        assert any(s.checkpoint == "latest" and "alias" in s.reason for s in plan.skipped), plan.skipped
    else:
        assert prune(open_storage(str(linked_root)), keep_last=1) == [_step_dir(100)]
    assert _loads(linked_root / _step_dir(200), 200) and _loads(linked_root / "latest", 200)
    assert sorted(os.listdir(linked_root)) == ["latest", _step_dir(200)]
    assert os.readlink(linked_root / "latest") == _step_dir(200)  # the link itself is not ours either


def test_gc_command_line_with_a_latest_link_keeps_the_newest(linked_root: Path) -> None:
    command = [sys.executable, "-m", "shardckpt.cli", "gc", str(linked_root), "--keep-last", "1", "--grace", "0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "latest: kept" in result.stdout and "alias" in result.stdout, result.stdout
    assert f"{_step_dir(100)}: deleted" in result.stdout
    assert _loads(linked_root / _step_dir(200), 200)
    again = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "deleted 0 object(s)" in again.stdout, again.stdout
    assert _loads(linked_root / _step_dir(200), 200)


def test_latest_returns_the_checkpoint_not_its_alias(linked_root: Path) -> None:
    os.symlink(_step_dir(200), linked_root / "zz-newest")  # sorts after the real name
    assert shardckpt.latest(str(linked_root)) == str(linked_root / _step_dir(200))


def test_checkpointer_keep_last_1_with_a_link_to_the_step_it_writes(tmp_path: Path) -> None:
    """A script that points `latest` at the path the next save writes: retention must not see two newest."""
    root = tmp_path / "ck"
    checkpointer = shardckpt.Checkpointer(str(root), every_steps=1, keep_last=1, preemption_signals=())
    checkpointer.maybe_save(1, _state(1.0))
    os.symlink(_step_dir(2), root / "latest")
    os.symlink(_step_dir(2), root / "the-newest")  # a name that sorts after step-...
    assert checkpointer.maybe_save(2, _state(2.0))
    checkpointer.close()
    assert sorted(os.listdir(root)) == ["latest", _step_dir(2), "the-newest"]
    assert torch.equal(shardckpt.open(str(root / _step_dir(2))).read("w"), torch.full((8, 4), 2.0))
    assert shardckpt.latest(str(root)) == str(root / _step_dir(2))


def test_checkpointer_keep_last_2_with_a_link_to_the_older_one(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    checkpointer = shardckpt.Checkpointer(str(root), every_steps=1, keep_last=2, preemption_signals=())
    checkpointer.maybe_save(1, _state(1.0))
    os.symlink(_step_dir(1), root / "best")
    checkpointer.maybe_save(2, _state(2.0))
    checkpointer.close()
    for step in (1, 2):  # both of the newest two load
        assert torch.equal(shardckpt.open(str(root / _step_dir(step))).read("w"), torch.full((8, 4), float(step)))


# ---------------------------------------------------- finding 2: links out of the root, foreign names in a checkpoint


@pytest.fixture
def escaping_root(tmp_path: Path) -> tuple[Path, Path]:
    """Under root: step-1 a link to a committed checkpoint outside; step-2 a real directory whose data/ is a link to
    another checkpoint's data outside; step-3 real, with a user's ranks/README and data/NOTES; step-4 the newest."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    for step in (1, 2):
        save_sharded(sample_state(step), str(outside / _step_dir(step)), 2, step=step)
    os.makedirs(root)
    os.symlink(outside / _step_dir(1), root / _step_dir(1))
    save_sharded(sample_state(2), str(root / _step_dir(2)), 2, step=2)
    save_sharded(sample_state(99), str(outside / "other"), 2, step=2)
    for child in (root / _step_dir(2) / "data").iterdir():
        os.replace(child, outside / "other" / "data" / child.name)  # same attempt names: the manifest still names them
    os.rmdir(root / _step_dir(2) / "data")
    os.symlink(outside / "other" / "data", root / _step_dir(2) / "data")
    for step in (3, 4):
        save_sharded(sample_state(step), str(root / _step_dir(step)), 2, step=step)
    (root / _step_dir(3) / "ranks" / "README").write_text("what these ranks were")
    (root / _step_dir(3) / "data" / "NOTES").write_text("mine")
    return root, outside


@pytest.mark.parametrize("path", ["gc", "retention", "checkpointer"])
def test_retention_never_follows_a_link_out_of_root_nor_deletes_foreign_names(
    escaping_root: tuple[Path, Path], path: str
) -> None:
    root, outside = escaping_root
    before = _tree(outside)
    storage = FaultyStorage(LocalStorage(str(root)))  # records every call
    if path == "gc":
        assert gc(storage, keep_last=1, grace=0).ok
    elif path == "retention":
        prune(storage, keep_last=1)
    else:
        checkpointer = shardckpt.Checkpointer(str(root), every_steps=1, keep_last=2, preemption_signals=())
        checkpointer.maybe_save(5, _state(5.0))  # keeps step-4 and step-5
        checkpointer.close()
    assert _tree(outside) == before
    for op, name in storage.calls:
        if op == "delete":
            assert name.startswith(_step_dir(3) + "/"), name
    assert (root / _step_dir(3) / "ranks" / "README").read_text() == "what these ranks were"
    assert (root / _step_dir(3) / "data" / "NOTES").read_text() == "mine"
    assert not (root / _step_dir(3) / layout.COMMITTED).exists()  # pruned: its own files are gone
    assert not [p for p in _tree(root / _step_dir(3)) if p.endswith((".safetensors", ".msgpack"))]
    assert _loads(root / _step_dir(4), 4) and _loads(outside / _step_dir(1), 1) and _loads(outside / _step_dir(2), 2)


def test_gc_command_line_never_follows_links_out_of_root(escaping_root: tuple[Path, Path]) -> None:
    root, outside = escaping_root
    before = _tree(outside)
    command = [sys.executable, "-m", "shardckpt.cli", "gc", str(root), "--keep-last", "1", "--grace", "0", "--json"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    skipped = {s["checkpoint"]: s["reason"] for s in summary["skipped"]}
    assert "outside ROOT" in skipped[_step_dir(1)] and "data/ is a link" in skipped[_step_dir(2)]
    assert [a["checkpoint"] for a in summary["actions"]] == [_step_dir(3)] and summary["kept"] == [_step_dir(4)]
    assert _tree(outside) == before and (root / _step_dir(3) / "ranks" / "README").exists()


# ---------------------------------------------------------- finding 0: a new run saving into a root of an older run


def test_checkpointer_into_an_old_root_keeps_what_it_just_saved_and_warns(tmp_path: Path) -> None:
    root = tmp_path / "old"
    for step in (70, 80, 90):
        save_sharded(sample_state(step), str(root / _step_dir(step)), 2, step=step)
    checkpointer = shardckpt.Checkpointer(str(root), every_steps=5, keep_last=3, preemption_signals=())
    records = []
    checkpointer.on_save = records.append
    with pytest.warns(UserWarning, match=r"step 5 is below step 90"):
        assert checkpointer.maybe_save(5, _state(5.0))
    with pytest.warns(UserWarning, match=r"step 10 is below step 90"):
        assert checkpointer.maybe_save(10, _state(10.0))
    checkpointer.close()
    assert sorted(os.listdir(root)) == [_step_dir(10), _step_dir(70), _step_dir(80), _step_dir(90)]
    assert torch.equal(shardckpt.open(str(root / _step_dir(10))).read("w"), torch.full((8, 4), 10.0))
    assert all(_loads(root / _step_dir(step), step) for step in (70, 80, 90))
    assert [r.step for r in records] == [5, 10] and "below step 90" in (records[-1].warning or "")


def test_checkpointer_async_into_an_old_root_keeps_what_it_just_saved(tmp_path: Path) -> None:
    root = tmp_path / "old"
    save_sharded(sample_state(90), str(root / _step_dir(90)), 2, step=90)
    checkpointer = shardckpt.Checkpointer(str(root), every_steps=1, keep_last=1, async_save=True, preemption_signals=())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpointer.maybe_save(1, _state(1.0))
        checkpointer.maybe_save(2, _state(2.0))
        checkpointer.close()
    assert sum("below step 90" in str(w.message) for w in caught) == 2
    assert sorted(os.listdir(root)) == [_step_dir(2), _step_dir(90)]
    assert _loads(root / _step_dir(90), 90)


# ------------------------------------------------------ property: gc, retention and latest() agree on the newest


def _fake_checkpoint(path: Path, step: int | None, created: float, attempt: str) -> None:
    """A committed checkpoint as far as listing and deletion can tell (COMMITTED names a manifest of 1 byte)."""
    (path / "data").mkdir(parents=True)
    (path / "ranks").mkdir()
    (path / f"manifest-{attempt}.msgpack").write_bytes(b"\x80")
    (path / "data" / f"00000-{attempt}.safetensors").write_bytes(b"d" * 8)
    (path / "ranks" / f"00000-{attempt}.msgpack").write_bytes(b"r")
    marker = CommitMarker(attempt, f"manifest-{attempt}.msgpack", 1, 0, 1, 8, step, created)
    (path / layout.COMMITTED).write_bytes(encode_commit_marker(marker))


NAMES = ["a", "b", "latest", "step-1", "step-2", "step-3", "zz"]
populations = st.lists(
    st.tuples(st.sampled_from(NAMES), st.one_of(st.none(), st.integers(0, 3)), st.sampled_from([0.0, 1.0])),
    min_size=1,
    max_size=5,
    unique_by=lambda item: item[0],
)


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(
    population=populations,
    links=st.lists(st.tuples(st.sampled_from(["al", "latest", "zz-link"]), st.integers(0, 4)), max_size=2),
    keep_last=st.integers(1, 3),
    path=st.sampled_from(["gc", "retention"]),
)
def test_gc_retention_and_latest_agree_on_the_newest(population, links, keep_last, path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "root"
        for index, (name, step, created) in enumerate(population):
            _fake_checkpoint(root / name, step, created, f"a{index}")
        made = []
        for link, target in links:
            if not (root / link).exists() and not (root / link).is_symlink():
                os.symlink(population[target % len(population)][0], root / link)
                made.append(link)
        newest = shardckpt.latest(str(root))
        assert newest is not None and not Path(newest).is_symlink()
        newest_files = _tree(Path(newest))
        if path == "gc":
            kept = gc(str(root), keep_last=keep_last, grace=0).kept
        else:
            prune(open_storage(str(root)), keep_last)
            kept = [p.name for p in sorted(root.iterdir()) if (p / layout.COMMITTED).exists() and not p.is_symlink()]
        assert len(kept) == min(keep_last, len(population)) and Path(newest).name in kept
        assert _tree(Path(newest)) == newest_files
        assert shardckpt.latest(str(root)) == newest
        assert all((root / link).is_symlink() for link in made)  # links are never deleted


# ------------------------------------------------------------------- crash at any point of retention, then again


class _Crash(BaseException):
    """Stands for SIGKILL: nothing after it runs, no except clause of the library catches it."""


def test_a_crash_at_any_deletion_of_retention_loses_nothing_kept(tmp_path: Path, monkeypatch) -> None:
    template = tmp_path / "template"
    for step in (1, 2, 3):
        save_sharded(sample_state(step), str(template / _step_dir(step)), 2, step=step)
    (template / _step_dir(1) / "ranks" / "README").write_text("mine")
    os.symlink(_step_dir(3), template / "latest")
    total = sum(1 for p in (template / _step_dir(1)).rglob("*") if p.is_file()) - 1  # README is not deleted
    assert total >= 5
    real_delete = LocalStorage.delete
    for crash_at in range(1, total + 1):
        root = tmp_path / f"crash{crash_at}"
        shutil.copytree(template, root, symlinks=True)
        calls = iter(range(1, 10_000))

        def delete(self, path: str, at: int = crash_at, seen=calls) -> None:
            if next(seen) == at:
                raise _Crash
            real_delete(self, path)

        monkeypatch.setattr(LocalStorage, "delete", delete)
        with pytest.raises(_Crash):
            prune(open_storage(str(root)), keep_last=2)
        monkeypatch.undo()
        assert _loads(root / _step_dir(2), 2) and _loads(root / _step_dir(3), 3)
        assert shardckpt.latest(str(root)) == str(root / _step_dir(3))
        status = "committed" if (root / _step_dir(1) / layout.COMMITTED).exists() else "gone for readers"
        assert status == "committed" or crash_at > 1  # COMMITTED is the first deletion, nothing before it
        prune(open_storage(str(root)), keep_last=2)  # a half-deleted checkpoint is gc's: retention leaves it
        assert gc(str(root), keep_last=2, grace=0).ok
        assert sorted(os.listdir(root)) == ["latest", _step_dir(1), _step_dir(2), _step_dir(3)]
        assert _tree(root / _step_dir(1)) == {"ranks/README": b"mine"}
        assert _loads(root / _step_dir(2), 2) and _loads(root / _step_dir(3), 3)
