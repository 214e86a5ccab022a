"""Retention and gc on a root whose checkpoints reference others (SPEC 14, format 1.1): what a kept checkpoint
references stays, a save in progress keeps its parent, referencing checkpoints go first, and nothing committed goes
while a marker is unreadable."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import crc32c
import msgpack
import pytest
import torch

import shardckpt
from shardckpt.catalog.listing import list_root
from shardckpt.catalog.retention import prune
from shardckpt.ops.gc import gc
from shardckpt.ops.verify import verify
from shardckpt.storage import LocalStorage, open_storage

HOUR = 3600.0


def _state(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    frozen = torch.randn(32, 16, generator=generator)
    return {"frozen": frozen, "trained": torch.full((4,), float(step))}


def _save(root: Path, step: int, parent: int | None, value: int | None = None) -> None:
    parent_url = str(root / f"step-{parent}") if parent is not None else None
    state = _state(step if value is None else value)
    shardckpt.save(state, str(root / f"step-{step}"), step=step, block_size=4096, parent=parent_url, piece_hashes=True)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """step-1 full; step-2 and step-3 incremental (frozen referenced in step-1); step-4 full; step-5 on step-4."""
    for step, parent in ((1, None), (2, 1), (3, 2), (4, None), (5, 4)):
        _save(tmp_path, step, parent)
    return tmp_path


def _age_markers(root: Path, seconds: float) -> None:
    """Move every checkpoint's creation time back: its global manifest's and COMMITTED's, which must agree (SPEC C),
    with COMMITTED's size and CRC32C of the rewritten manifest."""
    for marker_file in root.glob("*/COMMITTED"):
        marker = json.loads(marker_file.read_text())
        manifest_file = marker_file.parent / marker["manifest"]
        document = manifest_file.read_bytes()
        manifest = msgpack.unpackb(document, raw=False, strict_map_key=False, ext_hook=msgpack.ExtType)
        manifest["created"] -= seconds
        raw = msgpack.packb(manifest, use_bin_type=True)
        manifest_file.chmod(0o644)
        manifest_file.write_bytes(raw)
        marker["created"] -= seconds
        marker["manifest_size"], marker["manifest_crc32c"] = len(raw), crc32c.crc32c(raw)
        marker_file.write_text(json.dumps(marker))


def _committed(root: Path) -> list[str]:
    return sorted(path.parent.name for path in root.glob("*/COMMITTED"))


def _all_verify(root: Path) -> None:
    for name in _committed(root):
        report = verify(str(root / name))
        if not report.ok:
            pytest.fail(f"{name}: {[str(problem) for problem in report.problems]}")


def test_retention_keeps_what_kept_checkpoints_reference_and_deletes_referencing_ones_first(root: Path) -> None:
    listing = list_root(str(root))
    assert listing.committed()[2].marker is not None and listing.committed()[2].marker.references == (
        ("step-1", json.loads((root / "step-1" / "COMMITTED").read_text())["attempt"]),
    )
    # keep_last=3 keeps step-3..5; step-3 references step-1 (its frozen piece, through no chain): step-2 alone goes.
    assert [entry.name for entry in listing.to_prune(3)] == ["step-2"]
    # keep_last=1 keeps step-5, which references step-4: the rest go, step-3 and step-2 before step-1.
    order = [entry.name for entry in listing.to_prune(1)]
    assert order.index("step-3") < order.index("step-1") and order.index("step-2") < order.index("step-1")
    assert sorted(order) == ["step-1", "step-2", "step-3"]
    assert prune(open_storage(str(root)), 3) == ["step-2"]
    assert _committed(root) == ["step-1", "step-3", "step-4", "step-5"]
    _all_verify(root)


def test_gc_keeps_a_recent_parent_and_the_parent_of_a_save_in_progress(root: Path) -> None:
    # Fresh checkpoints: a save may have chosen any of them as its parent while it was the newest (rule 2).
    planned = gc(str(root), keep_last=1, grace=HOUR, dry_run=True)
    assert [action.checkpoint for action in planned.actions if action.kind == "prune"] == []
    _age_markers(root, 2 * HOUR)
    # step-6, uncommitted and being written now, holds step-3's values: its manifest (written; COMMITTED is not)
    # references step-3 for trained and step-1 for frozen, where the bytes lie.
    _save(root, 6, 3, value=3)
    (root / "step-6" / "COMMITTED").unlink()
    plan = gc(str(root), keep_last=1, grace=HOUR)
    assert plan.ok
    assert sorted(action.checkpoint for action in plan.actions if action.kind == "prune") == ["step-2"]
    # step-3 and step-1 stay for step-6; step-4 is what step-5 references.
    assert _committed(root) == ["step-1", "step-3", "step-4", "step-5"]
    _all_verify(root)


def test_nothing_committed_goes_on_a_root_with_references_while_a_marker_is_unreadable(root: Path) -> None:
    (root / "step-9").mkdir()
    (root / "step-9" / "COMMITTED").write_text("{not json")
    listing = list_root(str(root))
    assert listing.to_prune(1) == []
    plan = gc(str(root), keep_last=1, grace=0)
    assert [action for action in plan.actions if action.kind == "prune"] == []
    assert _committed(root) == ["step-1", "step-2", "step-3", "step-4", "step-5", "step-9"]
    shutil.rmtree(root / "step-9")  # once every marker reads, what no kept checkpoint references goes
    assert prune(open_storage(str(root)), 1) == ["step-2", "step-3", "step-1"]  # step-1, which both reference, last
    assert _committed(root) == ["step-4", "step-5"]
    _all_verify(root)


def test_an_unreadable_marker_of_the_only_referencing_checkpoint_still_stops_pruning(tmp_path: Path) -> None:
    """When the one checkpoint that references others is the one whose COMMITTED cannot be read, the root's readable
    markers look like format 1.0; its global manifest still says it references step-1 (SPEC 14: a collector that
    cannot read a COMMITTED does not know what it references), so nothing committed goes. Before, step-1 was
    deleted and step-2, once its marker was repaired, had lost its bytes."""
    for step, parent in ((1, None), (2, 1), (3, None)):
        _save(tmp_path, step, parent)
    marker = tmp_path / "step-2" / "COMMITTED"
    good = marker.read_bytes()
    marker.write_bytes(good + b"garbage")  # bit rot, or a hand edit gone wrong: a person must judge it
    assert list_root(str(tmp_path)).to_prune(1) == []
    plan = gc(str(tmp_path), keep_last=1, grace=0)
    assert [action for action in plan.actions if action.kind == "prune"] == []
    assert prune(open_storage(str(tmp_path)), 1) == []
    marker.write_bytes(good)
    _all_verify(tmp_path)  # step-2 reads whole again
    (tmp_path / "step-2" / "COMMITTED").write_bytes(b"{not json")  # a 1.0 root keeps the 1.0 behaviour:
    shutil.rmtree(tmp_path / "step-2" / "ranks")
    for manifest in (tmp_path / "step-2").glob("manifest-*.msgpack"):
        manifest.unlink()  # no global manifest left that could reference anything
    assert [entry.name for entry in list_root(str(tmp_path)).to_prune(1)] == ["step-1"]


class _Crash(Exception):
    pass


def test_a_crash_at_any_deletion_leaves_every_committed_checkpoint_whole(
    root: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """prune(keep_last=1) deletes step-3, step-2 (which reference step-1), then step-1: a crash before any deletion
    never leaves a committed checkpoint whose referenced files are gone, and the next run finishes the job."""
    total = sum(1 for name in ("step-1", "step-2", "step-3") for p in (root / name).rglob("*") if p.is_file())
    real_delete = LocalStorage.delete
    for crash_at in range(1, total + 1):  # at each deletion, data files and manifests alike
        copy = tmp_path_factory.mktemp(f"crash{crash_at}") / "root"
        shutil.copytree(root, copy)
        calls = iter(range(1, 10_000))

        def delete(self: LocalStorage, path: str, at: int = crash_at, seen: Iterator[int] = calls) -> None:
            if next(seen) == at:
                raise _Crash
            real_delete(self, path)

        monkeypatch.setattr(LocalStorage, "delete", delete)
        with pytest.raises(_Crash):
            prune(open_storage(str(copy)), 1)
        monkeypatch.undo()
        _all_verify(copy)  # every checkpoint still committed reads whole, its referenced files included
        prune(open_storage(str(copy)), 1)
        assert _committed(copy) == ["step-4", "step-5"], crash_at
