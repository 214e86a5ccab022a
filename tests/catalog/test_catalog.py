"""shardckpt.catalog: torch-free; one marker reader, one listing and order, one SPEC-14 deletion routine.

Hostile roots (link loops, dangling links, a FIFO as COMMITTED, files named like the layout's directories) get a
typed error or are left alone, never an unrelated exception, never a deletion of what the layout does not name.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import uuid
import warnings
from pathlib import Path

import fsspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shardckpt
from shardckpt.catalog import delete_objects, list_root, order_key, read_commit_marker
from shardckpt.catalog.deletion import deletion_order
from shardckpt.catalog.retention import prune
from shardckpt.errors import FormatError, StorageError
from shardckpt.format import layout
from shardckpt.format.manifest import CommitMarker, encode_commit_marker
from shardckpt.ops.gc import gc
from shardckpt.storage import LocalStorage, open_storage
from shardckpt.testing.faults import FaultyStorage

PACKAGE = Path(shardckpt.__file__).resolve().parent


def _marker(attempt: str, step: int | None, created: float = 0.0) -> bytes:
    return encode_commit_marker(CommitMarker(attempt, f"manifest-{attempt}.msgpack", 1, 0, 1, 8, step, created))


def _checkpoint(storage_root: str, name: str, attempt: str, step: int | None, created: float = 0.0) -> None:
    """A committed checkpoint as far as listing and deletion can tell, through the storage interface."""
    checkpoint = open_storage(storage_root).child(name)
    checkpoint.write_new(f"manifest-{attempt}.msgpack", b"\x80")
    checkpoint.write_new(f"data/00000-{attempt}.safetensors", b"d" * 8)
    checkpoint.write_new(f"ranks/00000-{attempt}.msgpack", b"r")
    checkpoint.write_new(layout.COMMITTED, _marker(attempt, step, created))


def test_the_catalog_imports_without_torch() -> None:
    """Imported through a stand-in root package (the real one imports the torch layers eagerly)."""
    program = f"""
import sys, types
sys.modules["torch"] = None  # any import of torch raises ImportError
package = types.ModuleType("shardckpt")
package.__path__ = [{str(PACKAGE)!r}]
sys.modules["shardckpt"] = package
import shardckpt.catalog
assert "shardckpt.read.checkpoint" not in sys.modules, sorted(sys.modules)
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_order_ties_are_broken_by_name_for_every_caller() -> None:
    url = f"memory://catalog-tests/{uuid.uuid4().hex}"
    for name in ("b", "a", "c"):
        _checkpoint(url, name, f"x{name}", None)  # no step, no time: only the name orders them
    _checkpoint(url, "old", "xold", 0)  # any known step is newer than none
    listing = list_root(url)
    assert [entry.name for entry in listing.committed()] == ["a", "b", "c", "old"]
    assert shardckpt.latest(url) == f"{url}/old"
    assert order_key(listing.committed()[0].marker, "a") < order_key(listing.committed()[1].marker, "b")
    assert prune(open_storage(url), 2) == ["a", "b"]
    assert gc(url, keep_last=1, grace=0).kept == ["old"]
    assert open_storage(url).list() == ["old"]
    fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)


@pytest.fixture
def hostile_root(tmp_path: Path) -> Path:
    """A committed step-1 and step-2 among a link loop, a dangling link, a FIFO as COMMITTED, a plain file, a
    link to a file, and a checkpoint whose `ranks` and `data` are a user's files, not directories."""
    root = tmp_path / "root"
    _checkpoint(str(root), "step-1", "a1", 1)
    _checkpoint(str(root), "step-2", "a2", 2)
    os.symlink("loop", root / "loop")
    os.symlink("nowhere", root / "dangling")
    (root / "fifo").mkdir()
    os.mkfifo(root / "fifo" / layout.COMMITTED)
    (root / "README").write_text("runs")
    os.symlink("README", root / "readme-link")
    (root / "files").mkdir()
    (root / "files" / layout.COMMITTED).write_bytes(_marker("a0", 0))
    (root / "files" / "manifest-a0.msgpack").write_bytes(b"\x80")
    (root / "files" / "ranks").write_text("a file named ranks")
    (root / "files" / "data").write_text("a file named data")
    return root


@pytest.mark.parametrize("path", ["latest", "gc", "retention"])
def test_hostile_roots_get_typed_errors_or_are_left_alone(hostile_root: Path, path: str) -> None:
    if path == "latest":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert shardckpt.latest(str(hostile_root)) == str(hostile_root / "step-2")
        skipped = sorted(str(w.message).split(":")[0] for w in caught)
        assert skipped == [f"skipping {hostile_root / 'fifo'}", f"skipping {hostile_root / 'loop'}"]
        return
    if path == "gc":
        plan = gc(str(hostile_root), keep_last=1, grace=0)
        assert plan.ok, [a.error for a in plan.actions]
        skipped = {s.checkpoint: s.reason for s in plan.skipped}
        assert "does not resolve" in skipped["loop"] and "does not resolve" in skipped["dangling"]
        assert "unreadable" in skipped["fifo"]
    else:
        assert prune(open_storage(str(hostile_root)), 1) == ["files", "step-1"]
    assert sorted(os.listdir(hostile_root)) == [
        "README",
        "dangling",
        "fifo",
        "files",
        "loop",
        "readme-link",
        "step-2",
    ]
    assert sorted(os.listdir(hostile_root / "files")) == ["data", "ranks"]  # the user's files, not directories
    assert (hostile_root / "files" / "ranks").read_text() == "a file named ranks"
    assert (hostile_root / "README").read_text() == "runs"
    assert read_commit_marker(LocalStorage(str(hostile_root / "step-2"))) is not None


def test_delete_objects_refuses_links_and_foreign_names_before_deleting_anything(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    for name, attempt in (("plain", "a1"), ("target", "a2")):
        _checkpoint(str(root), name, attempt, 1)
    _checkpoint(str(outside), "elsewhere", "a3", 1)
    os.symlink("target", root / "alias")
    os.symlink(outside / "elsewhere", root / "out")
    _checkpoint(str(root), "data-link", "a4", 1)
    os.rename(root / "data-link" / "data", outside / "data4")
    os.symlink(outside / "data4", root / "data-link" / "data")
    storage = FaultyStorage(LocalStorage(str(root)))
    paths = [layout.COMMITTED, "data/00000-a3.safetensors"]
    for name in ("alias", "out", "data-link", "..", "a/b", ""):
        with pytest.raises(StorageError, match="refusing to delete"):
            delete_objects(storage, name, paths)
    for foreign in ("ranks/README", "notes.txt", "data", "../outside", "data/../../x"):
        with pytest.raises(FormatError, match="only layout names"):
            delete_objects(storage, "plain", [layout.COMMITTED, foreign])
    assert not [call for call in storage.calls if call[0] == "delete"]
    assert delete_objects(storage, "plain", ["manifest-a1.msgpack", layout.COMMITTED]) == 2
    deleted = [path for op, path in storage.calls if op == "delete"]
    assert deleted[:2] == ["plain/COMMITTED", "plain/manifest-a1.msgpack"]


LAYOUT_PATHS = [
    layout.COMMITTED,
    "manifest-a1.msgpack",
    "manifest-b2.msgpack",
    "ranks/00000-a1.msgpack",
    "ranks/00001-b2.msgpack",
    "data/00000-a1.safetensors",
    "data/00001-b2.safetensors",
    f"{layout.COMMITTED}.tmp-1234",
]


@settings(max_examples=40, deadline=None)
@given(subset=st.lists(st.sampled_from(LAYOUT_PATHS), min_size=1, unique=True), seed=st.integers(0, 2**16))
def test_deletion_runs_in_spec_14_order_whatever_order_it_is_given(subset: list[str], seed: int) -> None:
    url = f"memory://catalog-order/{uuid.uuid4().hex}"
    checkpoint = open_storage(url).child("step-1")
    for path in LAYOUT_PATHS:
        checkpoint.write_new(path, b"x")
    random.Random(seed).shuffle(subset)
    storage = FaultyStorage(open_storage(url))
    assert delete_objects(storage, "step-1", subset) == len(subset)
    deleted = [path.removeprefix("step-1/") for op, path in storage.calls if op == "delete"][: len(subset)]
    assert deleted == sorted(subset, key=deletion_order)
    ranks = [LAYOUT_PATHS.index(path) for path in deleted]  # LAYOUT_PATHS is written in SPEC 14 order
    assert ranks == sorted(ranks)
    assert sorted(open_storage(url).child("step-1").list()) == sorted(
        {p.split("/")[0] for p in LAYOUT_PATHS if p not in subset}
    )
    memory = fsspec.filesystem("memory")
    if memory.exists(url.removeprefix("memory://")):
        memory.rm(url.removeprefix("memory://"), recursive=True)
