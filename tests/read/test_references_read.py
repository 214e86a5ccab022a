"""Reading a format 1.1 checkpoint that stores pieces by reference (SPEC 6.2, 8): loads follow references on any
world size and read the bytes a full checkpoint's load reads; hostile references are typed errors naming the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import fsspec
import pytest
import torch

import shardckpt
from shardckpt.catalog.chain import read_opening
from shardckpt.errors import FormatError, IntegrityError, NotCommittedError
from shardckpt.format.layout import data_path
from shardckpt.ops.verify import verify
from shardckpt.planner import Box
from shardckpt.read.checkpoint import Checkpoint
from shardckpt.storage import LocalStorage, open_storage
from tests.helpers.checkpoints import save_sharded
from tests.helpers.references import CHILD, PARENT, save_incremental

VECTORS = Path(__file__).resolve().parents[2] / "spec" / "vectors"


def _states() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(18)
    parent = {
        "base.w": torch.randn(64, 48, generator=generator),  # 12 KiB: several 4 KiB blocks per rank
        "emb": torch.randn(30, 8, generator=generator).to(torch.bfloat16),
        "head": torch.randn(6, 5, generator=generator),
    }
    return parent, {"head": torch.randn(6, 5, generator=generator)}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    parent, changed = _states()
    save_incremental(tmp_path / "root", parent, changed, 2)
    return tmp_path / "root"


def _expected() -> dict[str, torch.Tensor]:
    parent, changed = _states()
    return {**parent, **changed}


def test_a_two_rank_incremental_checkpoint_loads_in_one_process_with_its_references(root: Path) -> None:
    expected = _expected()
    state = {name: torch.zeros_like(tensor) for name, tensor in expected.items()}
    shardckpt.load(state, str(root / CHILD))  # world size 1 reads what ranks 0 and 1 saved
    for name, tensor in expected.items():
        if not torch.equal(state[name], tensor):
            pytest.fail(f"{name} differs after loading the incremental checkpoint")
    # A box across both ranks' referenced pieces, not aligned to anything they wrote.
    checkpoint = shardckpt.open(str(root / CHILD))
    if not torch.equal(checkpoint.read("base.w", (20, 7), (30, 9)), expected["base.w"][20:50, 7:16]):
        pytest.fail("a box across the two ranks' referenced pieces differs")
    assert checkpoint.marker.references == ((PARENT, checkpoint.source(2)[1].split("-")[-1].split(".")[0]),)


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Bytes read from data files through the local backend, by file name."""
    counted: dict[str, int] = {}
    original = LocalStorage.pread_into

    def pread_into(self: LocalStorage, fd: int, path: str, start: int, out: memoryview) -> None:
        counted[path.rsplit("/", 1)[-1]] = counted.get(path.rsplit("/", 1)[-1], 0) + memoryview(out).nbytes
        original(self, fd, path, start, out)

    monkeypatch.setattr(LocalStorage, "pread_into", pread_into)
    return counted


def test_loading_an_incremental_checkpoint_reads_the_bytes_a_full_one_does(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = _expected()
    full = str(tmp_path / "full")
    save_sharded(expected, full, 2, block_size=4096, step=2)
    counted = _count_reads(monkeypatch)
    results = {}
    for url in (full, str(root / CHILD)):
        counted.clear()
        checkpoint = shardckpt.open(url)
        items = [(name, Box((0,) * t.dim(), tuple(t.shape)), torch.empty_like(t)) for name, t in expected.items()]
        stats = checkpoint.read_into(items)
        for name, _, tensor in items:
            if not torch.equal(tensor, expected[name]):
                pytest.fail(f"{url}: {name} differs")
        results[url] = (stats.fetched_bytes, stats.requests, sum(counted.values()))
    assert results[full][2] == results[full][0] > 0  # every planned byte, and nothing else, was read
    assert results[str(root / CHILD)][0] == results[full][0]
    assert results[str(root / CHILD)][2] == results[full][2]


def test_a_reference_to_a_checkpoint_without_committed_is_refused_at_open(root: Path) -> None:
    attempt = json.loads((root / PARENT / "COMMITTED").read_text())["attempt"]
    (root / PARENT / "COMMITTED").unlink()
    with pytest.raises(NotCommittedError) as caught:
        shardckpt.open(str(root / CHILD))
    for fragment in (str(root / PARENT), str(root / CHILD), attempt, "no COMMITTED"):
        if fragment not in str(caught.value):
            pytest.fail(f"{fragment!r} not in: {caught.value}")


def test_a_reference_to_another_attempt_is_refused_also_when_opened_from_a_received_manifest(root: Path) -> None:
    marker = json.loads((root / PARENT / "COMMITTED").read_text())
    referenced = marker["attempt"]
    marker["attempt"] = "0123456789abcdef"  # a retry of step-1 committed instead of the referenced attempt
    (root / PARENT / "COMMITTED").write_text(json.dumps(marker))
    with pytest.raises(NotCommittedError) as caught:
        shardckpt.open(str(root / CHILD))
    for fragment in (referenced, "0123456789abcdef", str(root / PARENT)):
        if fragment not in str(caught.value):
            pytest.fail(f"{fragment!r} not in: {caught.value}")
    # Ranks of a distributed load build the checkpoint from the coordinator's opening: the check runs on first use.
    storage = open_storage(str(root / CHILD))
    opening = read_opening(storage)
    checkpoint = Checkpoint(storage, opening.marker, opening.manifest)
    with pytest.raises(NotCommittedError):
        checkpoint.read("base.w")
    assert torch.equal(checkpoint.read("head"), _expected()["head"])  # its own pieces need no referenced one


def _parent_file(root: Path, rank: int) -> Path:
    attempt = json.loads((root / PARENT / "COMMITTED").read_text())["attempt"]
    return root / PARENT / data_path(rank, attempt)


def test_a_shorter_referenced_file_is_an_integrity_error_naming_it(root: Path) -> None:
    path = _parent_file(root, 1)
    path.write_bytes(path.read_bytes()[:-4])
    checkpoint = shardckpt.open(str(root / CHILD))
    with pytest.raises(IntegrityError) as caught:
        checkpoint.read("base.w")
    if f"{PARENT}/{data_path(1, path.name.split('-')[1].split('.')[0])}" not in str(caught.value):
        pytest.fail(f"the referenced file is not named in: {caught.value}")
    assert "truncated" in str(caught.value)


def test_a_changed_byte_in_referenced_bytes_fails_the_carried_checksum(root: Path) -> None:
    path = _parent_file(root, 0)
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    data[header + 5] ^= 0x40  # in the first piece of rank 0's file, base.w, which step-2 references
    path.write_bytes(bytes(data))
    checkpoint = shardckpt.open(str(root / CHILD))
    assert torch.equal(checkpoint.read("head"), _expected()["head"])
    with pytest.raises(IntegrityError) as caught:
        checkpoint.read("base.w")
    message = str(caught.value)
    for fragment in (str(path), "fails its checksum"):
        if fragment not in message:
            pytest.fail(f"{fragment!r} not in: {message}")


def test_references_are_followed_on_an_fsspec_memory_root(root: Path) -> None:
    url = "memory://shardckpt-references/run"
    fs = fsspec.filesystem("memory")
    try:
        fs.put(str(root), "/shardckpt-references/run", recursive=True)
        checkpoint = shardckpt.open(f"{url}/{CHILD}")
        assert checkpoint.data_storage.url == url
        for name, tensor in _expected().items():
            if not torch.equal(checkpoint.read(name), tensor):
                pytest.fail(f"{name} differs when read from memory://")
    finally:
        fs.rm("/shardckpt-references", recursive=True)


@pytest.mark.s3
def test_references_are_followed_on_s3(root: Path, s3_url: str) -> None:
    fs = fsspec.filesystem("s3")
    fs.put(str(root), s3_url.removeprefix("s3://"), recursive=True)
    checkpoint = shardckpt.open(f"{s3_url}/{CHILD}")
    assert checkpoint.data_storage.url == s3_url
    state = {name: torch.zeros_like(tensor) for name, tensor in _expected().items()}
    shardckpt.load(state, f"{s3_url}/{CHILD}")
    for name, tensor in _expected().items():
        if not torch.equal(state[name], tensor):
            pytest.fail(f"{name} differs when loaded from S3")


def test_the_golden_root_reads_from_a_copy_too(tmp_path: Path) -> None:
    shutil.copytree(VECTORS / "valid" / "references_basic", tmp_path / "copy")
    checkpoint = shardckpt.open(str(tmp_path / "copy" / "step-2"))
    assert checkpoint.read("w").shape == (4, 3)
    assert checkpoint.describe_file(2) == str(tmp_path / "copy" / "step-1" / data_path(0, "golden1"))


def test_a_chain_of_incremental_saves_loads_and_verifies_each_step(tmp_path: Path) -> None:
    """shardckpt.save(parent=) of the write side: step-3 references step-1 for base (unchanged twice) and step-2
    for emb (changed once); every step loads and verifies, reading each piece from its physical holder."""
    parent, changed = _states()
    steps = [parent, {**parent, **changed}, {**parent, **changed, "emb": parent["emb"] + 1}]
    previous = None
    for number, state in enumerate(steps, start=1):
        url = str(tmp_path / f"step-{number}")
        shardckpt.save(state, url, step=number, block_size=4096, parent=previous, piece_hashes=True)
        previous = url
    checkpoint = shardckpt.open(previous)
    holders = {checkpoint.source(file)[1].split("/")[0] for file in range(1, 1 + len(checkpoint.manifest.references))}
    assert holders == {"step-1", "step-2"}
    for number, state in enumerate(steps, start=1):
        url = str(tmp_path / f"step-{number}")
        loaded = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
        shardckpt.load(loaded, url)
        for name, tensor in state.items():
            if not torch.equal(loaded[name], tensor):
                pytest.fail(f"step-{number}: {name} differs")
        report = verify(url)
        assert report.ok, [str(problem) for problem in report.problems]


def test_a_checkpoint_whose_references_name_itself_is_refused(tmp_path: Path) -> None:
    """Renamed so that it bears the name it references: SPEC 6.2 refuses a reference to the checkpoint itself."""
    root = tmp_path / "root"
    shutil.copytree(VECTORS / "valid" / "references_basic", root)
    (root / "step-1").rename(root / "old")
    (root / "step-2").rename(root / "step-1")
    with pytest.raises(FormatError) as caught:
        shardckpt.open(str(root / "step-1"))
    assert "references name the checkpoint itself" in str(caught.value)
