"""Loads of a checkpoint with a piece index (format 1.2, SPEC 11.1) read the metadata of the tensors they load only."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch

import shardckpt
from shardckpt import knobs
from shardckpt.errors import FormatError, IntegrityError
from shardckpt.statedict.flat import FlatPartition
from shardckpt.storage import Storage, open_storage
from shardckpt.storage.local import LocalStorage

COUNT = 1200


def _state() -> dict[str, torch.Tensor]:
    return {f"model.layers.{i:04d}.weight": torch.full((2, 3), float(i)) for i in range(COUNT)}


def _counting(url: str) -> tuple[Storage, Counter[str]]:
    """A storage that counts the bytes read from each object (range reads; whole reads go through them)."""
    storage = open_storage(url)
    counts: Counter[str] = Counter()
    read_range = storage.read_range

    def counted(path: str, start: int, end: int) -> bytes:
        data = read_range(path, start, end)
        counts[path] += len(data)
        return data

    storage.read_range = counted  # type: ignore[method-assign]
    return storage, counts


@pytest.fixture
def indexed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(knobs, "PIECE_INDEX_MIN_TENSORS", 1000)
    url = str(tmp_path / "ck")
    shardckpt.save(_state(), url, step=1)
    return url


def _manifest(url: str) -> tuple[str, int]:
    path = next(p.name for p in Path(url).iterdir() if p.name.startswith("manifest-"))
    return path, (Path(url) / path).stat().st_size


def test_a_load_of_one_tensor_of_many_reads_a_small_part_of_the_manifest(indexed: str) -> None:
    name = "model.layers.1111.weight"
    storage, counts = _counting(indexed)
    wanted = {name: torch.zeros(2, 3)}
    shardckpt.load(wanted, storage)
    assert torch.equal(wanted[name], torch.full((2, 3), 1111.0))
    path, size = _manifest(indexed)
    # The head (files, objects, the fence of ~30 blocks) and one 4 KiB block, of a ~120 KiB manifest.
    assert 0 < counts[path] < size / 10, (counts[path], size)
    # Everything else still loads bit-exact, and open() reads the whole manifest (every tensor listed).
    state = {key: torch.zeros(2, 3) for key in _state()}
    shardckpt.load(state, indexed)
    assert all(torch.equal(state[key], value) for key, value in _state().items())
    assert len(shardckpt.open(indexed).tensors) == COUNT


def test_a_corrupt_index_block_is_an_integrity_error_naming_it_and_verify_reports_it(indexed: str) -> None:
    path, _ = _manifest(indexed)
    opened = shardckpt.open(indexed)
    head = opened.marker.head
    index = opened.manifest.piece_index
    assert head is not None and index is not None
    number = index.blocks_for(["model.layers.1111.weight"])[0]
    raw = bytearray((Path(indexed) / path).read_bytes())
    raw[head[0] + index.offsets()[number] + 5] ^= 0x10
    (Path(indexed) / path).write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match=rf"piece index block {number} \(tensors from "):
        shardckpt.load({"model.layers.1111.weight": torch.zeros(2, 3)}, indexed)
    with pytest.raises(IntegrityError, match="COMMITTED promises"):  # a whole read checks the whole object
        shardckpt.open(indexed)
    from shardckpt.ops.verify import verify

    assert not verify(indexed).ok


def test_names_the_index_does_not_hold_are_missing_as_before(indexed: str) -> None:
    state: dict[str, Any] = {
        "aaa": torch.zeros(1),
        "model.layers.0007.weight": torch.zeros(2, 3),
        "zzz": torch.zeros(1),
    }
    with pytest.raises(shardckpt.errors.ShardckptUsageError, match="lacks 2 entries"):
        shardckpt.load(state, indexed)
    shardckpt.load(state, indexed, strict=False)
    assert torch.equal(state["model.layers.0007.weight"], torch.full((2, 3), 7.0))


def test_an_incremental_save_reads_the_parents_index_blocks_of_its_own_tensors_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(knobs, "PIECE_INDEX_MIN_TENSORS", 1000)
    shardckpt.save(_state(), str(tmp_path / "step-1"), step=1, piece_hashes=True)
    counts: Counter[str] = Counter()
    read_range = LocalStorage.read_range

    def counted(self: LocalStorage, path: str, start: int, end: int) -> bytes:
        data = read_range(self, path, start, end)
        counts[f"{self.url}/{path}"] += len(data)
        return data

    monkeypatch.setattr(LocalStorage, "read_range", counted)
    name = "model.layers.0042.weight"
    manifest = shardckpt.save(
        {name: torch.full((2, 3), 42.0)}, str(tmp_path / "step-2"), step=2, parent=str(tmp_path / "step-1")
    )
    assert manifest.references  # the unchanged piece is stored by reference to step-1's data file
    path, size = _manifest(str(tmp_path / "step-1"))
    read = sum(count for where, count in counts.items() if where.endswith(f"step-1/{path}"))
    assert 0 < read < size / 10, (read, size)
    wanted = {name: torch.zeros(2, 3)}
    shardckpt.load(wanted, str(tmp_path / "step-2"))
    assert torch.equal(wanted[name], torch.full((2, 3), 42.0))


def test_an_empty_destination_of_another_shape_is_refused_as_from_a_whole_manifest(indexed: str) -> None:
    """An empty destination asks for no bytes, yet its shape is checked against the entry: read for it too."""
    with pytest.raises(shardckpt.errors.ShardckptUsageError, match=r"global shape \[0\].*shape \[2, 3\]"):
        partition = FlatPartition(torch.zeros(0), [("model.layers.0007.weight", (0,))], 0)
        shardckpt.load({"model.layers.0007.weight": partition}, indexed)


def test_a_manifest_that_grew_or_shrank_is_refused_by_a_load_that_reads_part_of_it(indexed: str) -> None:
    path, _ = _manifest(indexed)
    raw = (Path(indexed) / path).read_bytes()
    for changed in (raw + b"\x00", raw[:-1]):  # the blocks a load reads are intact either way
        (Path(indexed) / path).write_bytes(changed)
        with pytest.raises(IntegrityError, match=f"{len(changed)} bytes, but COMMITTED promises {len(raw)}"):
            shardckpt.load({"model.layers.0001.weight": torch.zeros(2, 3)}, indexed)


def test_bytes_after_the_blocks_or_missing_from_them_are_refused_by_a_load_as_by_open(indexed: str) -> None:
    """The manifest object and COMMITTED rewritten alike (sizes and CRC32Cs fixed up), the head and every block intact:
    the object is not head + blocks, which a whole read refuses (SPEC 11.1); a load that reads one block refuses it
    too (before: loaded from it, while open() and verify called the checkpoint broken)."""
    path, _ = _manifest(indexed)
    raw = (Path(indexed) / path).read_bytes()
    marker = json.loads((Path(indexed) / "COMMITTED").read_text())
    for changed in (raw + bytes(7), raw[:-3]):
        (Path(indexed) / path).write_bytes(changed)
        fixed = {**marker, "manifest_size": len(changed), "manifest_crc32c": crc32c.crc32c(changed)}
        (Path(indexed) / "COMMITTED").write_text(json.dumps(fixed))
        with pytest.raises(FormatError, match=r"bytes follow the head, its piece index has"):
            shardckpt.open(indexed)
        with pytest.raises(FormatError, match=r"bytes follow the head, its piece index has"):
            shardckpt.load({"model.layers.0001.weight": torch.zeros(2, 3)}, indexed)


def test_tensors_of_the_same_boxes_are_checked_for_cover_once_and_load_exactly(tmp_path: Path, monkeypatch) -> None:
    """Under FSDP every tensor of one shape has the same boxes (shared columns, format/piece_columns.py): a load checks
    their cover once, not once per tensor (at 16,384 ranks: thousands of sorts of 16,384 pieces), and reads them
    exactly, rows split unevenly over 20 files, into a box that crosses 14 of them."""
    from shardckpt.catalog import stored

    state = {f"w{i:02d}": torch.arange(40 * 7, dtype=torch.float32).reshape(40, 7) + i for i in range(12)}
    url = str(tmp_path / "ckpt")
    bounds = [0, 1, 3, 4, *range(6, 41, 2)]  # 20 files (a table of more pieces than a scan takes), rows uneven
    for rank in range(len(bounds) - 1):
        writer = shardckpt.ShardWriter(url, rank=rank, world_size=len(bounds) - 1, attempt="a")
        for name, tensor in state.items():
            lo, hi = bounds[rank], bounds[rank + 1]
            writer.add(name, tensor[lo:hi].clone(), global_shape=(40, 7), offsets=(lo, 0))
        writer.close()
    shardckpt.commit(url, world_size=len(bounds) - 1, attempt="a", piece_index=True)
    checked: list[str] = []
    real = stored.check_cover
    monkeypatch.setattr(stored, "check_cover", lambda name, *rest: checked.append(name) or real(name, *rest))
    checkpoint = shardckpt.open(url)
    for name, tensor in state.items():
        assert torch.equal(checkpoint.read(name, offsets=(2, 2), shape=(25, 4)), tensor[2:27, 2:6])
    assert checked == ["w00"]
