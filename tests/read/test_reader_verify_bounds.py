"""verify's work is bounded by the manifests' size: each local manifest is read once (broken or not), every piece
is matched against its file's index by vectorised lookups, and a global manifest that assigns a file more pieces
than its local manifest holds is refused with a typed problem instead of being matched piece by piece.
"""

from __future__ import annotations

import shutil
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from test_hostile_manifests import ATTEMPT, Chain, _column

import shardckpt
from shardckpt.format.columns import decode_int_column
from shardckpt.ops.verify import verify
from shardckpt.storage import LocalStorage

PIECES = 2_000


@pytest.fixture(scope="module")
def many_pieces(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two ranks; `w` (PIECES x 2) stored as one-row pieces, alternating ranks; `x` stored whole by rank 1."""
    root = tmp_path_factory.mktemp("bounds") / "ck"
    w = torch.arange(PIECES * 2, dtype=torch.float32).reshape(PIECES, 2)
    for rank in range(2):
        writer = shardckpt.ShardWriter(str(root), rank=rank, world_size=2, attempt=ATTEMPT, block_size=4096)
        for row in range(rank, PIECES, 2):
            writer.add("w", w[row : row + 1], global_shape=(PIECES, 2), offsets=(row, 0))
        if rank == 1:
            writer.add("x", torch.ones(3))
        writer.close()
    shardckpt.commit(str(root), world_size=2, attempt=ATTEMPT)
    return root


def _copy(source: Path, tmp_path: Path) -> Path:
    root = tmp_path / "ck"
    shutil.copytree(source, root)
    return root


def test_a_broken_local_manifest_is_read_once(many_pieces: Path, tmp_path: Path, monkeypatch) -> None:
    root = _copy(many_pieces, tmp_path)
    chain = Chain(root)
    document = chain.global_()
    document["files"][0]["index_crc32c"] ^= 1  # rank 0's local manifest no longer matches its promised CRC32C
    chain.write_global(document)
    reads: Counter[str] = Counter()
    original = LocalStorage.read_range

    def counting(self, path: str, start: int, end: int) -> bytes:
        reads[path] += 1
        return original(self, path, start, end)

    monkeypatch.setattr(LocalStorage, "read_range", counting)
    report = verify(str(root))
    assert not report.ok
    assert any("CRC32C" in p.message for p in report.problems)
    index_reads = {path: n for path, n in reads.items() if path.startswith("ranks/")}
    assert index_reads and max(index_reads.values()) == 1, index_reads


def test_every_local_manifest_is_read_once_by_a_clean_verify(many_pieces: Path, monkeypatch) -> None:
    reads: Counter[str] = Counter()
    original = LocalStorage.read_range

    def counting(self, path: str, start: int, end: int) -> bytes:
        reads[path] += 1
        return original(self, path, start, end)

    monkeypatch.setattr(LocalStorage, "read_range", counting)
    report = verify(str(many_pieces))
    assert report.ok, report.problems
    assert {path: n for path, n in reads.items() if path.startswith("ranks/")} == {
        f"ranks/0000{r}-{ATTEMPT}.msgpack": 1 for r in range(2)
    }


def test_more_pieces_for_a_file_than_its_local_manifest_holds_is_one_typed_problem(
    many_pieces: Path, tmp_path: Path
) -> None:
    """All of w's pieces reassigned to rank 1's file: with x, 2,001 claims against 1,001 local pieces."""
    root = _copy(many_pieces, tmp_path)
    chain = Chain(root)
    document = chain.global_()
    entry = next(t for t in document["tensors"] if t["name"] == "w")
    count = entry["pieces"]["count"]
    entry["pieces"]["file"] = _column([1] * count)
    chain.write_global(document)
    report = verify(str(root))
    assert not report.ok
    claims = [p for p in report.problems if "assigns" in p.message]
    assert len(claims) == 1 and f"{count + 1} pieces" in claims[0].message and "holds 1001" in claims[0].message
    assert len(report.problems) < 30, report.problems


def test_mismatched_pieces_are_reported_per_tensor_not_per_piece(many_pieces: Path, tmp_path: Path) -> None:
    """Every start of w shifted by one row (still a valid cover if rotated): each piece now disagrees with its
    file's index; verify names the first disagreement and counts the rest."""
    root = _copy(many_pieces, tmp_path)
    chain = Chain(root)
    document = chain.global_()
    entry = next(t for t in document["tensors"] if t["name"] == "w")
    count = entry["pieces"]["count"]
    starts = decode_int_column(entry["pieces"]["start"], "start").tolist()
    rows = starts[:count]
    entry["pieces"]["start"] = _column([(r + 1) % count for r in rows] + starts[count:])
    chain.write_global(document)
    report = verify(str(root))
    mismatches = [p for p in report.problems if p.tensor == "w" and "the piece at byte" in p.message]
    assert len(mismatches) == 1 and f"and {count - 1} more" in mismatches[0].message, report.problems


@pytest.mark.slow
def test_verify_of_many_pieces_scales(tmp_path: Path) -> None:
    """200,000 one-element pieces of one tensor on one rank: verify finishes (the time is printed, -s)."""
    count = 200_000
    root = tmp_path / "ck"
    writer = shardckpt.ShardWriter(str(root), rank=0, world_size=1, attempt=ATTEMPT, block_size=4096)
    values = torch.arange(count, dtype=torch.float32)
    for i in range(count):
        writer.add("v", values[i : i + 1], global_shape=(count,), offsets=(i,))
    writer.close()
    shardckpt.commit(str(root), world_size=1, attempt=ATTEMPT)
    began = time.perf_counter()
    report = verify(str(root))
    print(f"\nverify of {count} pieces: {time.perf_counter() - began:.2f} s")
    assert report.ok, report.problems[:3]
