"""`du` walks a checkpoint without following links: loops, links out of the checkpoint and hard links each count
what is really there once, and the walk is bounded."""

from __future__ import annotations

import os

import torch

import shardckpt
from shardckpt import knobs
from shardckpt.cli import main as cli_main
from shardckpt.ops.du import disk_usage


def _checkpoint(root) -> str:
    url = str(root / "step-1")
    shardckpt.save({"w": torch.arange(1000, dtype=torch.float32)}, url, step=1)
    return url


def _plain(root) -> tuple[int, int]:
    usage = disk_usage(str(root)).checkpoints[0]
    return usage.committed_bytes, usage.data_bytes


def test_links_inside_a_checkpoint_are_never_followed(tmp_path) -> None:
    root = tmp_path / "root"
    _checkpoint(root)
    committed, data = _plain(root)
    loop = root / "step-1" / "loop"
    loop.mkdir()
    (loop / "note.txt").write_bytes(b"n" * 100)
    for i in range(12):  # 12^8 directories through the links on a walk that follows them
        os.symlink(".", loop / f"self-{i}")
    os.symlink("..", loop / "up")
    os.symlink("/", loop / "disk")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "big.bin").write_bytes(b"b" * 100_000)
    os.symlink(outside, root / "step-1" / "elsewhere")
    os.symlink(outside / "big.bin", root / "step-1" / "big.bin")
    usage = disk_usage(str(root)).checkpoints[0]
    assert (usage.committed_bytes, usage.data_bytes) == (committed, data)
    assert usage.other_bytes == 100 and usage.error is None  # the note once; links are 0 bytes, never entered


def test_a_hard_linked_file_counts_once(tmp_path) -> None:
    root = tmp_path / "root"
    _checkpoint(root)
    committed, _ = _plain(root)
    data = root / "step-1" / "data"
    (root / "step-1" / "copies").mkdir()
    for name in os.listdir(data):
        os.link(data / name, root / "step-1" / "copies" / name)
    usage = disk_usage(str(root)).checkpoints[0]
    assert usage.committed_bytes == committed and usage.other_bytes == 0


def test_the_walk_is_bounded_and_says_what_it_left_out(tmp_path, monkeypatch, capsys) -> None:
    root = tmp_path / "root"
    _checkpoint(root)
    many = root / "step-1" / "many"
    many.mkdir()
    for i in range(50):
        (many / f"f{i:02d}").write_bytes(b"x" * 10)
    monkeypatch.setattr(knobs, "DU_MAX_ENTRIES", 20)
    usage = disk_usage(str(root)).checkpoints[0]
    assert usage.error is not None and "over 20 entries" in usage.error and "'many'" in usage.error
    assert usage.other_bytes < 500
    assert cli_main(["du", str(root)]) == 0
    assert "over 20 entries" in capsys.readouterr().out
