"""References spelled through links and other spellings (issue 23.1): a save records the real checkpoint of its
root, refuses a parent that lies elsewhere, and retention/gc keep what references name however they spell it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import shardckpt
from shardckpt.catalog.listing import list_root
from shardckpt.catalog.retention import prune
from shardckpt.errors import ShardckptUsageError
from shardckpt.ops.gc import gc
from shardckpt.storage import open_storage
from tests.helpers.checkpoints import save_sharded
from tests.helpers.references import reference_tensors

pytestmark = pytest.mark.unit


def _state(value: float) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"frozen": torch.randn(32, 16, generator=generator), "trained": torch.full((4,), value)}


def _save(url: Path, step: int, parent: Path | str | None = None) -> None:
    shardckpt.save(
        _state(float(step)), str(url), step=step, block_size=4096, piece_hashes=True,
        parent=None if parent is None else str(parent),
    )  # fmt: skip


def _references(ckpt: Path) -> list[str]:
    return [entry["checkpoint"] for entry in json.loads((ckpt / "COMMITTED").read_text())["references"]]


def _loads(url: Path, step: int) -> None:
    out = {"frozen": torch.empty(32, 16), "trained": torch.empty(4)}
    shardckpt.load(out, str(url))
    expected = _state(float(step))
    if not all(torch.equal(out[name], expected[name]) for name in out):
        pytest.fail(f"{url} loaded other values than step {step} saved")


def test_a_parent_reached_through_a_link_is_recorded_by_its_real_name_and_gc_keeps_it(tmp_path: Path) -> None:
    _save(tmp_path / "step-1", 1)
    os.symlink("step-1", tmp_path / "latest")
    _save(tmp_path / "step-2", 2, parent=tmp_path / "latest")
    assert _references(tmp_path / "step-2") == ["step-1"]
    plan = gc(str(tmp_path), keep_last=1, grace=0)
    assert plan.ok and [action.checkpoint for action in plan.actions] == []
    os.remove(tmp_path / "latest")
    os.symlink("step-2", tmp_path / "latest")  # the alias moves on: nothing depends on it
    prune(open_storage(str(tmp_path)), 1)
    _loads(tmp_path / "step-2", 2)


def test_a_parent_spelled_through_a_linked_root_or_with_dots_is_the_same_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(root, tmp_path / "alias-of-root")
    _save(root / "step-1", 1)
    _save(root / "step-2", 2, parent=tmp_path / "alias-of-root" / "step-1")
    _save(root / "step-3", 3, parent=f"{root}/./sub/../step-2/")
    assert (_references(root / "step-2"), _references(root / "step-3")) == (["step-1"], ["step-1"])
    _loads(root / "step-3", 3)


def test_a_parent_linked_in_from_another_root_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    (tmp_path / "other").mkdir()
    (tmp_path / "root").mkdir()
    _save(tmp_path / "other" / "step-1", 1)
    os.symlink(tmp_path / "other" / "step-1", tmp_path / "root" / "base")
    with pytest.raises(ShardckptUsageError, match="not in the root") as caught:
        _save(tmp_path / "root" / "step-2", 2, parent=tmp_path / "root" / "base")
    for fragment in ("other/step-1", "copy the parent", "full save"):
        if fragment not in str(caught.value):
            pytest.fail(f"{fragment!r} not in: {caught.value}")
    assert not (tmp_path / "root" / "step-2").exists()


def test_a_parent_behind_a_dangling_link_is_refused_with_a_typed_error(tmp_path: Path) -> None:
    _save(tmp_path / "step-1", 1)
    os.symlink("gone", tmp_path / "latest")
    with pytest.raises(ShardckptUsageError, match="not a directory"):
        _save(tmp_path / "step-2", 2, parent=tmp_path / "latest")
    assert not (tmp_path / "step-2").exists()


def test_gc_and_retention_keep_what_a_reference_names_through_an_alias(tmp_path: Path) -> None:
    """A checkpoint whose references name a link (as a release before this fix recorded them) keeps the real one."""
    parent_attempt = save_sharded(_state(1.0), str(tmp_path / "step-1"), 1, block_size=4096, step=1, piece_hashes=True)
    os.symlink("step-1", tmp_path / "latest")
    save_sharded({"trained": _state(2.0)["trained"]}, str(tmp_path / "step-2"), 1, block_size=4096, step=2)
    reference_tensors(tmp_path / "step-2", tmp_path / "latest", parent_attempt, ["frozen"])
    assert _references(tmp_path / "step-2") == ["latest"]
    listing = list_root(str(tmp_path))
    assert listing.to_prune(1) == [] and listing.kept_names({"step-2"}) >= {"step-1"}
    assert gc(str(tmp_path), keep_last=1, grace=0).actions == []
    assert prune(open_storage(str(tmp_path)), 1) == []
    _loads(tmp_path / "step-2", 2)


def test_another_spelling_of_a_listed_directory_is_that_checkpoint(tmp_path: Path, monkeypatch) -> None:
    """A case-insensitive file system (macOS, Windows) opens ROOT/STEP-1 as ROOT/step-1 while listing step-1:
    emulated by resolving any case of a name under the root to the listed one."""
    _save(tmp_path / "step-1", 1)
    real_stat, real_lstat = os.stat, os.lstat

    def folded(path: object) -> object:
        text = os.fspath(path)  # type: ignore[arg-type]
        if isinstance(text, str) and os.path.dirname(text) == str(tmp_path):
            for name in os.listdir(tmp_path):
                if name.lower() == os.path.basename(text).lower():
                    return os.path.join(tmp_path, name)
        return path

    from shardckpt.catalog.identity import home  # here: the other tests also run on a tree without it

    monkeypatch.setattr(os, "stat", lambda path, *a, **k: real_stat(folded(path), *a, **k))
    monkeypatch.setattr(os, "lstat", lambda path, *a, **k: real_lstat(folded(path), *a, **k))
    root, name = home(open_storage(str(tmp_path / "STEP-1")))
    assert (root.url, name) == (str(tmp_path), "step-1")
    assert list_root(str(tmp_path)).canonical("STEP-1") == "step-1"
    _save(tmp_path / "step-2", 2, parent=tmp_path / "STEP-1")
    assert _references(tmp_path / "step-2") == ["step-1"]


@pytest.mark.parametrize("spelled", ["s3://bucket/root//step-1", "s3://bucket/root/./step-1", "s3://b/r/x/../step-1"])
def test_an_object_store_key_with_empty_or_dot_segments_is_refused_as_a_parent(spelled: str) -> None:
    with pytest.raises(ShardckptUsageError, match="keeps literally"):
        shardckpt.save(_state(2.0), "s3://bucket/root/step-2", parent=spelled, storage_options={"anon": True})


def test_an_incremental_checkpoint_opened_through_a_link_from_elsewhere_reads_its_references_in_its_root(
    tmp_path: Path,
) -> None:
    (tmp_path / "root").mkdir()
    (tmp_path / "elsewhere").mkdir()
    _save(tmp_path / "root" / "step-1", 1)
    _save(tmp_path / "root" / "step-2", 2, parent=tmp_path / "root" / "step-1")
    os.symlink(tmp_path / "root" / "step-2", tmp_path / "elsewhere" / "best")
    _loads(tmp_path / "elsewhere" / "best", 2)
    os.symlink("step-2", tmp_path / "root" / "latest")
    _loads(tmp_path / "root" / "latest", 2)


def test_a_reference_through_an_alias_that_moved_on_still_keeps_the_checkpoint_of_its_attempt(tmp_path: Path) -> None:
    parent_attempt = save_sharded(_state(1.0), str(tmp_path / "step-1"), 1, block_size=4096, step=1, piece_hashes=True)
    os.symlink("step-1", tmp_path / "latest")
    save_sharded({"trained": _state(2.0)["trained"]}, str(tmp_path / "step-2"), 1, block_size=4096, step=2)
    reference_tensors(tmp_path / "step-2", tmp_path / "latest", parent_attempt, ["frozen"])
    _save(tmp_path / "step-3", 3)
    os.remove(tmp_path / "latest")
    os.symlink("step-3", tmp_path / "latest")  # step-2 now reads wrong: pointing the alias back must still work
    plan = gc(str(tmp_path), keep_last=2, grace=0)
    assert plan.ok and [action.checkpoint for action in plan.actions] == []
    os.remove(tmp_path / "latest")
    os.symlink("step-1", tmp_path / "latest")
    _loads(tmp_path / "step-2", 2)
