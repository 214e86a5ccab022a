"""Corruption, truncation and uncommitted checkpoints: reads raise IntegrityError naming file and tensor."""

from __future__ import annotations

import glob
import os
import shutil
import threading

import pytest
import torch

import shardckpt
from shardckpt.cli import main as cli_main
from shardckpt.ops.verify import verify
from shardckpt.storage import LocalStorage
from shardckpt.testing.faults import Fault, FaultyStorage
from tests.helpers.checkpoints import sample_state, save_sharded


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


@pytest.mark.slow
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


def test_a_lying_short_read_into_a_reused_slot_is_caught(tmp_path) -> None:
    """A backend that fills half of a reused read slot and reports success leaves the slot's previous bytes in
    the other half: the checksums catch it, and no destination holds anything but its old or its saved value."""
    url = str(tmp_path / "ck")
    state = {f"t{i}": torch.randn(64, 1024, generator=torch.Generator().manual_seed(i)) for i in range(6)}
    save_sharded(state, url, 2, block_size=4096)
    for nth in (2, 5):
        faulty = FaultyStorage(LocalStorage(url), [Fault("read_range", "data/*", kind="short", nth=nth)])
        destination = {name: torch.full_like(tensor, 7.0) for name, tensor in state.items()}
        # 64 KiB requests through a 128 KiB budget: every slot is reused several times over.
        checkpoint = shardckpt.open(faulty, max_in_flight=128 << 10, max_request=64 << 10)
        items = [(name, shardckpt.Box((0, 0), (64, 1024)), destination[name]) for name in state]
        with pytest.raises(shardckpt.IntegrityError, match="fails its checksum"):
            checkpoint.read_into(items)
        for name, tensor in state.items():
            assert bool(((destination[name] == 7.0) | (destination[name] == tensor)).all()), name


def test_one_checkpoint_reuses_its_read_buffer_and_serves_concurrent_reads(checkpoint_dir: str) -> None:
    checkpoint = shardckpt.open(checkpoint_dir, max_request=4096)
    expected = sample_state()
    names = [name for name, info in checkpoint.tensors.items() if info.nbytes]
    first = {name: checkpoint.read(name) for name in names}
    buffer = checkpoint._buffer
    assert buffer is not None
    again = {name: checkpoint.read(name) for name in names}
    assert checkpoint._buffer is buffer  # faulted in once, reused by every later read
    results: list[dict[str, torch.Tensor]] = []

    def read_all() -> None:
        results.append({name: checkpoint.read(name) for name in names})

    threads = [threading.Thread(target=read_all) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 3
    for got in (first, again, *results):
        for name in names:
            assert torch.equal(got[name], expected[name]), name


@pytest.mark.parametrize("verify_first", [False, True])
def test_memory_backend_reads_through_the_default_copying_path(tmp_path, verify_first: bool) -> None:
    """A backend without its own read_range_into (fsspec memory) streams through read_range plus a copy."""
    url = f"memory://integrity-{tmp_path.name}-{verify_first}/ck"
    state = sample_state()
    save_sharded(state, url, 3, block_size=4096)
    fresh = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
    shardckpt.load(fresh, url, verify_first=verify_first, strict=False, max_in_flight=8192)
    for name, tensor in state.items():
        assert torch.equal(fresh[name], tensor), name


def test_the_read_buffer_stays_within_max_in_flight(tmp_path) -> None:
    url = str(tmp_path / "ck")
    state = {"w": torch.randn(256, 1024, generator=torch.Generator().manual_seed(1))}  # 1 MiB in 64 KiB+ requests
    save_sharded(state, url, 2, block_size=4096)
    checkpoint = shardckpt.open(url, max_in_flight=96 << 10, max_request=32 << 10)
    got = torch.empty(256, 1024)
    stats = checkpoint.read_into([("w", shardckpt.Box((0, 0), (256, 1024)), got)])
    assert torch.equal(got, state["w"]) and stats.requests >= 32
    assert checkpoint._buffer is not None and checkpoint._buffer.size <= 96 << 10
