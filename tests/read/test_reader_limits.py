"""SPEC 4 and 10 limits checked where untrusted values are decoded, before any work or allocation they size:
a data header larger than safetensors allows (a sparse file can claim 400 MiB), on verify and on commit.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from test_hostile_manifests import ATTEMPT, Chain, _pack, _unpack

import shardckpt
from shardckpt.errors import FormatError
from shardckpt.format import layout
from shardckpt.format.local_manifest import decode_local_manifest
from shardckpt.ops.verify import verify
from shardckpt.storage import LocalStorage

HUGE_HEADER = 400 << 20  # 400 MiB: over the 100,000,000-byte JSON limit of SPEC 4


def _write_ranks(root: Path) -> None:
    """Two ranks; rank 1 stores no piece, so its data file is only its header."""
    for rank in range(2):
        writer = shardckpt.ShardWriter(str(root), rank=rank, world_size=2, attempt=ATTEMPT, block_size=4096)
        if rank == 0:
            writer.add("w", torch.ones(4, 3))
        else:
            writer.add("w", torch.ones(0, 3), global_shape=(4, 3), offsets=(4, 0))
        writer.close()


def _grow_rank1_header(root: Path) -> bytes:
    """Rank 1's local manifest claims a 400 MiB header (its data file made that size, sparse); returns it."""
    path = root / layout.local_manifest_path(1, ATTEMPT)
    document = _unpack(path.read_bytes())
    document["header_size"] = document["data_size"] = HUGE_HEADER
    os.truncate(root / layout.data_path(1, ATTEMPT), HUGE_HEADER)
    raw = _pack(document)
    path.write_bytes(raw)
    return raw


def test_the_decoder_refuses_a_header_over_the_safetensors_limit(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    _write_ranks(root)
    raw = _grow_rank1_header(root)
    with pytest.raises(FormatError, match=r"header_size.*100000008"):
        decode_local_manifest(raw, "rank 1")


def test_verify_refuses_a_huge_header_without_reading_it(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "ck"
    _write_ranks(root)
    shardckpt.commit(str(root), world_size=2, attempt=ATTEMPT)
    chain = Chain(root)
    raw = _grow_rank1_header(root)
    chain.write_local(1, _unpack(raw))
    document = chain.global_()
    document["files"][1]["data_size"] = HUGE_HEADER
    chain.write_global(document)
    largest = [0]
    original = LocalStorage.read_range

    def measured(self, path: str, start: int, end: int) -> bytes:
        largest[0] = max(largest[0], end - start)
        return original(self, path, start, end)

    monkeypatch.setattr(LocalStorage, "read_range", measured)
    report = verify(str(root))
    assert not report.ok
    assert any("header_size" in p.message for p in report.problems), report.problems
    assert largest[0] < 1 << 20


def test_commit_refuses_a_huge_header(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    _write_ranks(root)
    _grow_rank1_header(root)
    with pytest.raises(FormatError, match=r"header_size"):
        shardckpt.commit(str(root), world_size=2, attempt=ATTEMPT)
    assert not (root / layout.COMMITTED).exists()
    shutil.rmtree(root)


# ------------------------------------------------------------------------ allocations from declared sizes


@pytest.fixture
def one_piece(tmp_path: Path) -> Path:
    root = tmp_path / "one"
    writer = shardckpt.ShardWriter(str(root), rank=0, world_size=1, attempt=ATTEMPT, block_size=4096)
    writer.add("w", torch.arange(12, dtype=torch.float32).reshape(4, 3))
    writer.close()
    shardckpt.commit(str(root), world_size=1, attempt=ATTEMPT)
    return root


def _claim_a_petabyte(root: Path) -> None:
    """The global manifest says `w` is 2^48 F32 elements (2^50 bytes) in one piece of a 2^62-byte data file."""
    chain = Chain(root)
    document = chain.global_()
    (entry,) = document["tensors"]
    entry["shape"] = [1 << 48]
    entry["pieces"]["start"] = _column_of([0])
    entry["pieces"]["length"] = _column_of([1 << 48])
    document["files"][0]["data_size"] = (1 << 62) - 1
    chain.write_global(document)


def _column_of(values: list[int]) -> dict:
    from test_hostile_manifests import _column

    return _column(values)


def test_read_checks_the_chain_before_allocating_the_declared_tensor(one_piece: Path, monkeypatch) -> None:
    _claim_a_petabyte(one_piece)
    allocated: list[tuple[int, ...]] = []
    empty = torch.empty

    def watched(*shape, **kwargs):
        allocated.append(tuple(shape[0]) if shape and isinstance(shape[0], tuple) else tuple(shape))
        return empty(*shape, **kwargs)

    monkeypatch.setattr(torch, "empty", watched)
    with pytest.raises(shardckpt.ShardckptError, match="does not describe"):
        shardckpt.open(str(one_piece)).read("w")
    assert (1 << 48,) not in allocated


def test_a_tensor_too_large_for_memory_is_a_typed_error(one_piece: Path, monkeypatch) -> None:
    """Everything checks out but the allocation fails: a ShardckptError naming the tensor and size, not RuntimeError."""

    def failing(*shape, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    checkpoint = shardckpt.open(str(one_piece))
    monkeypatch.setattr(torch, "empty", failing)
    with pytest.raises(shardckpt.ShardckptError, match=r"tensor 'w'.*48 bytes"):
        checkpoint.read("w")


@pytest.mark.parametrize(("offsets", "shape"), [((-1, 0), (1, 3)), ((0, 0), (-2, 3)), ((0,), (1,)), ((0, 0), (5, 3))])
def test_bad_read_boxes_are_usage_errors(one_piece: Path, offsets, shape) -> None:
    with pytest.raises(shardckpt.ShardckptUsageError):
        shardckpt.open(str(one_piece)).read("w", offsets, shape)
