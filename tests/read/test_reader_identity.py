"""SPEC 8 step 4 on every read path: each piece the global manifest assigns to a file must be that same piece in
the file's local manifest, even when a hostile global manifest points two pieces at one file offset.

A hostile writer rewrites the global manifest (fixing COMMITTED's size and CRC32C) so that two pieces share the
bytes of one: reading must raise IntegrityError, never return duplicated values, whichever path reads them.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_hostile_manifests import ATTEMPT, Chain, _column

import shardckpt
from shardckpt.errors import IntegrityError
from shardckpt.format.columns import decode_int_column
from shardckpt.ops.verify import verify
from shardckpt.planner import Box
from shardckpt.read.streaming import chunk_arena, chunk_elements, open_streaming, read_chunks

W = torch.arange(12, dtype=torch.float32).reshape(4, 3)
A, B = torch.full((2, 3), 1.5), torch.full((2, 3), -7.0)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One rank: `w` as two row pieces (rows 0:2, then 2:4) and tensors `a`, `b` of equal size, one piece each."""
    root = tmp_path_factory.mktemp("identity") / "ck"
    writer = shardckpt.ShardWriter(str(root), rank=0, world_size=1, attempt=ATTEMPT, block_size=4096)
    writer.add("w", W[:2], global_shape=(4, 3), offsets=(0, 0))
    writer.add("w", W[2:], global_shape=(4, 3), offsets=(2, 0))
    writer.add("a", A)
    writer.add("b", B)
    writer.close()
    shardckpt.commit(str(root), world_size=1, attempt=ATTEMPT)
    return root


def _decode(column: dict) -> list[int]:
    return [int(x) for x in decode_int_column(column, "test").tolist()]


def _hostile(pristine: Path, tmp_path: Path, case: str) -> Path:
    """A copy whose global manifest points a second piece at the first one's offset."""
    root = tmp_path / "ck"
    shutil.copytree(pristine, root)
    chain = Chain(root)
    document = chain.global_()
    entries = {t["name"]: t for t in document["tensors"]}
    offsets = _decode(entries["w"]["pieces"]["offset"])
    if case == "rows 2:4 at 0:2":
        entries["w"]["pieces"]["offset"] = _column([offsets[0], offsets[0]])
    elif case == "rows 0:2 at 2:4":
        entries["w"]["pieces"]["offset"] = _column([offsets[1], offsets[1]])
    else:  # a claims b's bytes (same size, same file)
        entries["a"]["pieces"]["offset"] = entries["b"]["pieces"]["offset"]
    chain.write_global(document)
    return root


def _read_full(url: str) -> None:
    checkpoint = shardckpt.open(url)
    for name in ("w", "a", "b"):
        checkpoint.read(name)


def _everything() -> list[tuple[str, Box, torch.Tensor]]:
    shapes = {"w": (4, 3), "a": (2, 3), "b": (2, 3)}
    return [(name, Box((0, 0), shape), torch.empty(*shape)) for name, shape in shapes.items()]


def _read_together(url: str) -> None:
    shardckpt.open(url).read_into(_everything())


def _read_verify_first(url: str) -> None:
    shardckpt.open(url).read_into(_everything(), verify_first=True)


def _load(url: str) -> None:
    shardckpt.load({"w": torch.empty(4, 3), "a": torch.empty(2, 3), "b": torch.empty(2, 3)}, url)


def _stream(url: str) -> None:
    checkpoint = open_streaming(url, 1 << 20)
    arena = chunk_arena(1 << 20)
    for name in ("w", "a", "b"):
        for _ in read_chunks(checkpoint, name, chunk_elements(checkpoint, arena, 4), arena):
            pass


CASES = ["rows 2:4 at 0:2", "rows 0:2 at 2:4", "two tensors"]
PATHS: dict[str, Callable[[str], None]] = {
    "read": _read_full,
    "read_into": _read_together,
    "verify_first": _read_verify_first,
    "load": _load,
    "streaming": _stream,
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("path", sorted(PATHS))
def test_two_pieces_at_one_offset_are_refused_on_every_read_path(
    pristine: Path, tmp_path: Path, case: str, path: str
) -> None:
    root = _hostile(pristine, tmp_path, case)
    with pytest.raises(IntegrityError, match=r"tensor '(w|a)': the piece at byte \d+ is '(w|b)'"):
        PATHS[path](str(root))


@pytest.mark.parametrize("case", CASES)
def test_two_pieces_at_one_offset_are_reported_by_verify(pristine: Path, tmp_path: Path, case: str) -> None:
    report = verify(str(_hostile(pristine, tmp_path, case)))
    assert not report.ok
    assert any(p.tensor in ("w", "a") and "the piece at byte" in p.message for p in report.problems), report.problems


def test_the_pristine_checkpoint_reads_back(pristine: Path) -> None:
    for path in PATHS.values():
        path(str(pristine))
    checkpoint = shardckpt.open(str(pristine))
    assert torch.equal(checkpoint.read("w"), W) and torch.equal(checkpoint.read("a"), A)
    assert verify(str(pristine)).ok
