"""An incremental save checks the holder bytes it would reference (issue 23, 'also found'): a flipped bit in a holder
file is written anew with a warning instead of spreading to every later child while each save reports success."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import fsspec
import pytest
import torch

import shardckpt
from shardckpt import knobs
from shardckpt.errors import IntegrityError
from shardckpt.ops.verify import verify

BLOCK = 4096


@pytest.fixture(autouse=True)
def _check_at_every_save(monkeypatch) -> None:
    """These tests damage a holder after a save in this process found it intact: check again at once."""
    monkeypatch.setattr(knobs, "VERIFY_REFERENCED_EVERY", 0.0)


def _state(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"frozen": torch.randn(64, 130, generator=generator), "trained": torch.full((16,), float(step))}


def _save(root: Path, step: int, parent: int | None) -> None:
    url, parent_url = str(root / f"step-{step}"), None if parent is None else str(root / f"step-{parent}")
    shardckpt.save(_state(step), url, step=step, block_size=BLOCK, parent=parent_url, piece_hashes=True)


def _flip_a_bit_of(ckpt: Path, tensor: str) -> Path:
    """Flip one bit in the middle of `tensor`'s bytes in the checkpoint's (only) data file, as a disk might."""
    (data,) = (ckpt / "data").iterdir()
    raw = bytearray(data.read_bytes())
    (size,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8 : 8 + size])[tensor]["data_offsets"]
    raw[8 + size + (begin + end) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    return data


def _referenced(ckpt: Path) -> list[str]:
    return [entry["checkpoint"] for entry in json.loads((ckpt / "COMMITTED").read_text()).get("references", [])]


def _load(url: Path) -> dict[str, torch.Tensor]:
    out = {"frozen": torch.empty(64, 130), "trained": torch.empty(16)}
    shardckpt.load(out, str(url))
    return out


def test_a_flipped_bit_in_a_holder_is_written_anew_and_every_later_child_loads(tmp_path: Path) -> None:
    _save(tmp_path, 1, None)
    _save(tmp_path, 2, 1)
    assert _referenced(tmp_path / "step-2") == ["step-1"]  # frozen lies in step-1's file
    _flip_a_bit_of(tmp_path / "step-1", "frozen")
    with pytest.warns(UserWarning, match="damaged in their holder files") as caught:
        _save(tmp_path, 3, 2)
    assert "step-1/data/" in str(caught[0].message)
    assert _referenced(tmp_path / "step-3") == []  # trained changed, frozen written anew: nothing referenced
    for name, tensor in _load(tmp_path / "step-3").items():
        assert torch.equal(tensor, _state(3)[name]), name
    _save(tmp_path, 4, 3)  # the next child references the healthy copy
    assert _referenced(tmp_path / "step-4") == ["step-3"]
    assert torch.equal(_load(tmp_path / "step-4")["frozen"], _state(4)["frozen"])
    assert verify(str(tmp_path / "step-4")).ok and not verify(str(tmp_path / "step-2")).ok


def test_a_holder_file_gone_is_written_anew_too(tmp_path: Path) -> None:
    _save(tmp_path, 1, None)
    _save(tmp_path, 2, 1)
    (data,) = (tmp_path / "step-1" / "data").iterdir()
    data.unlink()
    with pytest.warns(UserWarning, match="cannot read"):
        _save(tmp_path, 3, 2)
    assert torch.equal(_load(tmp_path / "step-3")["frozen"], _state(3)["frozen"])


def test_with_the_check_off_the_damage_is_referenced_and_found_when_loading(tmp_path: Path, monkeypatch) -> None:
    """SHARDCKPT_VERIFY_REFERENCED=0 trusts the holders (a save reads nothing back); the reader still refuses."""
    monkeypatch.setattr(knobs, "VERIFY_REFERENCED", 0)
    _save(tmp_path, 1, None)
    _flip_a_bit_of(tmp_path / "step-1", "frozen")
    _save(tmp_path, 2, 1)
    assert _referenced(tmp_path / "step-2") == ["step-1"]
    with pytest.raises(IntegrityError, match="step-1"):
        _load(tmp_path / "step-2")


@pytest.mark.s3
def test_the_holder_check_reads_through_the_object_store_too(s3_url: str) -> None:
    fs = fsspec.filesystem("s3")
    for step, parent in ((1, None), (2, 1)):
        parent_url = None if parent is None else f"{s3_url}/step-{parent}"
        url = f"{s3_url}/step-{step}"
        shardckpt.save(_state(step), url, step=step, block_size=BLOCK, parent=parent_url, piece_hashes=True)
    (key,) = fs.ls(f"{s3_url.removeprefix('s3://')}/step-1/data")
    raw = bytearray(fs.cat_file(key))
    (size,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8 : 8 + size])["frozen"]["data_offsets"]
    raw[8 + size + (begin + end) // 2] ^= 0x10
    fs.rm(key)
    fs.pipe_file(key, bytes(raw))
    with pytest.warns(UserWarning, match="damaged in their holder files"):
        shardckpt.save(_state(3), f"{s3_url}/step-3", step=3, block_size=BLOCK, parent=f"{s3_url}/step-2")
    out = {"frozen": torch.empty(64, 130), "trained": torch.empty(16)}
    shardckpt.load(out, f"{s3_url}/step-3")
    assert torch.equal(out["frozen"], _state(3)["frozen"])


def test_a_holder_found_intact_is_not_read_again_within_the_window(tmp_path: Path, monkeypatch) -> None:
    """A run's saves that reference one frozen base read it once per VERIFY_REFERENCED_EVERY, not once per save."""
    from shardckpt.write import holders

    monkeypatch.setattr(knobs, "VERIFY_REFERENCED_EVERY", 3600.0)
    checked: list[int] = []
    original = holders.damaged_holders

    def counting(root, wanted):  # type: ignore[no-untyped-def]
        checked.append(len(wanted))
        return original(root, wanted)

    monkeypatch.setattr("shardckpt.write.writer.damaged_holders", counting)
    _save(tmp_path, 1, None)
    _save(tmp_path, 2, 1)  # reads step-1's frozen bytes and finds them intact
    _save(tmp_path, 3, 2)  # references the same holder range: trusted for the hour
    assert checked == [1, 0]
    monkeypatch.setattr(knobs, "VERIFY_REFERENCED_EVERY", 0.0)
    _save(tmp_path, 4, 3)
    assert checked == [1, 0, 1]
