"""Corruption, truncation and uncommitted checkpoints: reads raise IntegrityError naming file and tensor."""

from __future__ import annotations

import glob
import os
import shutil

import pytest
import torch
from conftest import sample_state, save_sharded

import shardckpt
from shardckpt.cli import main as cli_main
from shardckpt.storage import Fault, FaultyStorage, LocalStorage
from shardckpt.verify import verify


@pytest.fixture
def checkpoint_dir(tmp_path) -> str:
    url = str(tmp_path / "ck")
    save_sharded(sample_state(), url, 3, block_size=4096)
    return url


def _read_everything(url: str) -> None:
    checkpoint = shardckpt.open(url)
    for name in checkpoint.tensors:
        checkpoint.read(name)


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0x01]))


def test_every_corrupted_data_byte_is_caught(checkpoint_dir: str) -> None:
    """Flip each byte of the data region of one file in turn: verify exits 1 and reading raises IntegrityError."""
    data_file = sorted(glob.glob(f"{checkpoint_dir}/data/*.safetensors"))[1]
    header = 8 + int.from_bytes(open(data_file, "rb").read(8), "little")
    size = os.path.getsize(data_file)
    pristine = open(data_file, "rb").read()
    for offset in range(header, size, max(1, (size - header) // 40)):
        _flip(data_file, offset)
        with pytest.raises(shardckpt.IntegrityError, match=os.path.basename(data_file)):
            _read_everything(checkpoint_dir)
        report = verify(checkpoint_dir)
        assert not report.ok
        assert any(os.path.basename(data_file) in str(p) and p.tensor for p in report.problems)
        with open(data_file, "wb") as handle:
            handle.write(pristine)
    assert verify(checkpoint_dir).ok


def test_flipped_header_byte_is_reported_by_verify(checkpoint_dir: str) -> None:
    data_file = sorted(glob.glob(f"{checkpoint_dir}/data/*.safetensors"))[0]
    _flip(data_file, 20)
    report = verify(checkpoint_dir)
    assert not report.ok
    assert any("safetensors header" in p.message for p in report.problems)


def test_read_of_a_corrupt_region_names_the_tensor_and_block(checkpoint_dir: str) -> None:
    checkpoint = shardckpt.open(checkpoint_dir)
    entry = checkpoint.manifest.tensor("w")
    file_index, offset = int(entry.pieces.file[0]), int(entry.pieces.offset[0])
    path = os.path.join(checkpoint_dir, checkpoint.manifest.files[file_index].data)
    _flip(path, offset + 3)
    with pytest.raises(shardckpt.IntegrityError, match=r"tensor 'w': block 0"):
        shardckpt.open(checkpoint_dir).read("w", (0, 0), (1, 1))
    # A region of another tensor that shares no checksum block is still readable.
    assert torch.equal(shardckpt.open(checkpoint_dir).read("s"), sample_state()["s"])


def test_truncated_data_file(checkpoint_dir: str) -> None:
    data_file = sorted(glob.glob(f"{checkpoint_dir}/data/*.safetensors"))[2]
    size = os.path.getsize(data_file)
    os.truncate(data_file, size - 10)
    with pytest.raises(shardckpt.IntegrityError):
        _read_everything(checkpoint_dir)
    assert cli_main(["verify", "--quiet", checkpoint_dir]) == 1


def test_data_file_replaced_by_another_checkpoints_file(tmp_path, checkpoint_dir: str) -> None:
    other = str(tmp_path / "other")
    save_sharded(sample_state(seed=1), other, 3, block_size=4096)
    mine = sorted(glob.glob(f"{checkpoint_dir}/data/*.safetensors"))[0]
    theirs = sorted(glob.glob(f"{other}/data/*.safetensors"))[0]
    shutil.copyfile(theirs, mine)
    with pytest.raises(shardckpt.IntegrityError):
        _read_everything(checkpoint_dir)


@pytest.mark.parametrize("victim", ["COMMITTED", "manifest", "ranks"])
def test_tampered_metadata_is_refused(checkpoint_dir: str, victim: str) -> None:
    if victim == "COMMITTED":
        os.remove(os.path.join(checkpoint_dir, "COMMITTED"))
        with pytest.raises(shardckpt.NotCommittedError):
            shardckpt.open(checkpoint_dir)
        with pytest.raises(shardckpt.NotCommittedError):
            shardckpt.load({"w": torch.empty(37, 11)}, checkpoint_dir)
        assert cli_main(["verify", checkpoint_dir]) == 1
        return
    pattern = "manifest-*.msgpack" if victim == "manifest" else "ranks/*.msgpack"
    target = sorted(glob.glob(os.path.join(checkpoint_dir, pattern)))[0]
    _flip(target, os.path.getsize(target) // 2)
    with pytest.raises(shardckpt.IntegrityError):
        _read_everything(checkpoint_dir)


def test_short_and_corrupt_reads_from_storage_are_caught(checkpoint_dir: str) -> None:
    for kind in ("short", "corrupt"):
        faulty = FaultyStorage(LocalStorage(checkpoint_dir), [Fault("read_range", "data/*", kind=kind, times=0)])
        with pytest.raises(shardckpt.IntegrityError):
            _read_everything(faulty)


def test_reads_fetch_only_needed_bytes(tmp_path) -> None:
    """A one-row read of a tensor on 4 ranks touches one data file, for about one row plus block rounding."""
    url = str(tmp_path / "ck")
    state = {"w": torch.randn(400, 256)}
    save_sharded(state, url, 4, block_size=4096)
    storage = FaultyStorage(LocalStorage(url))
    checkpoint = shardckpt.open(storage)
    storage.calls.clear()
    row = checkpoint.read("w", (150, 0), (1, 256))
    assert torch.equal(row, state["w"][150:151])
    data_reads = [path for op, path in storage.calls if op == "read_range" and path.startswith("data/")]
    assert len(data_reads) == 1 and data_reads[0].startswith("data/00001-")
    plan = checkpoint.plan({"w": [((150, 0), (1, 256))]})
    assert plan.needed_bytes == plan.exact_bytes == 1024
    assert plan.fetch_bytes <= 2 * 4096
