"""Piece hashes computed on the writer's hash threads while it writes (issue 18): equal to BLAKE3's over the bytes
in the data file on every write path, for pieces crossing chunk, block and gathered-buffer boundaries, and the
writer never waits for a hash of a buffer it did not copy."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import blake3
import pytest
import torch

import shardckpt
import shardckpt.write.writer as writer_module
from shardckpt.format import layout
from shardckpt.format.local_manifest import LocalManifest, decode_local_manifest
from shardckpt.format.references import AUTO_THREADS
from shardckpt.storage import open_storage
from shardckpt.write.parent import open_parent
from shardckpt.write.writer import ShardWriter

pytestmark = pytest.mark.unit
BLOCK = 4096


def odd_state() -> dict[str, torch.Tensor]:
    """Pieces of 1 byte to ~25 blocks: whole blocks, a byte past one, tiny ones gathered, and a strided one."""
    gen = torch.Generator().manual_seed(18)
    state = {
        "big": torch.randint(0, 256, (100_003,), generator=gen, dtype=torch.uint8),
        "exact": torch.randn(BLOCK // 4, generator=gen),
        "block_and_a_byte": torch.randint(0, 256, (BLOCK + 1,), generator=gen, dtype=torch.uint8),
        "strided": torch.randn(96, 80, generator=gen).t(),  # hashed from the contiguous copy that is written
        "one_byte": torch.tensor([7], dtype=torch.uint8),
    }
    state.update({f"tiny.{i}": torch.randn(i + 1, generator=gen) for i in range(40)})
    return state


def write(url: str, state: dict[str, torch.Tensor], **options: Any) -> LocalManifest:
    writer = ShardWriter(url, rank=0, world_size=1, attempt="a", block_size=BLOCK, piece_hashes=True, **options)
    for name, tensor in state.items():
        writer.add(name, tensor)
    return writer.close()


@pytest.mark.parametrize(
    ("write_threads", "parallel_min_bytes"),
    [(1, writer_module.PARALLEL_MIN_BYTES), (2, 0)],
    ids=["one-stream", "multi-stream"],
)
def test_threaded_hashes_equal_blake3_on_the_bytes_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write_threads: int, parallel_min_bytes: int
) -> None:
    # Chunks of 3 blocks and gathered buffers of 3 blocks: most pieces cross several; copies held for hashing are
    # bounded to one block, so the writer also waits for hashes.
    monkeypatch.setattr(writer_module, "HOT_CHUNK", 3 * BLOCK)
    monkeypatch.setattr(writer_module, "WRITE_CHUNK", 3 * BLOCK)
    monkeypatch.setattr(writer_module, "PARALLEL_MIN_BYTES", parallel_min_bytes)
    monkeypatch.setattr(writer_module, "HASH_IN_FLIGHT", BLOCK)
    hashing_threads: set[str] = set()
    real_digest = writer_module.piece_digest

    def recording_digest(data: Any) -> bytes:
        hashing_threads.add(threading.current_thread().name)
        return real_digest(data)

    monkeypatch.setattr(writer_module, "piece_digest", recording_digest)
    state = odd_state()
    manifest = write(str(tmp_path / "ckpt"), state, write_threads=write_threads, hash_threads=3)
    if not all(name.startswith("shardckpt-hash") for name in hashing_threads):
        pytest.fail(f"pieces were hashed on {sorted(hashing_threads)}, not on the hash threads")
    data = (tmp_path / "ckpt" / manifest.data).read_bytes()
    assert manifest.references is not None and manifest.references.piece_hash is not None
    digests = manifest.references.piece_hash
    assert manifest.pieces.count == len(state)
    for row in range(manifest.pieces.count):
        name = manifest.tensors[int(manifest.pieces.tensor[row])].name
        at, size = int(manifest.pieces.offset[row]), int(manifest.pieces.nbytes[row])
        expected = blake3.blake3(data[at : at + size]).digest(16)
        if digests[16 * row : 16 * row + 16] != expected:
            pytest.fail(f"piece {name!r} ({size} bytes at {at}): recorded hash is not the written bytes' hash")
        written = state[name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert data[at : at + size] == written

    # The parent path hashes the same pieces on the hash threads (largest first, tiny ones batched): all equal.
    shardckpt.commit(str(tmp_path / "ckpt"), world_size=1, attempt="a")
    parent = open_parent(open_storage(str(tmp_path)), "ckpt", set(state))
    child = ShardWriter(str(tmp_path / "child"), rank=0, world_size=1, block_size=BLOCK, parent=parent, hash_threads=3)
    for name, tensor in state.items():
        child.add(name, tensor)
    child_manifest = child.close()
    assert child_manifest.pieces.count == 0
    assert child.stats is not None and child.stats.referenced_bytes == sum(t.nbytes for t in state.values())
    # The comparing hash pass comes before any write, and the writer reports its time (benchmarks split on it).
    if not 0 < child.stats.hash_seconds <= child.stats.seconds:
        pytest.fail(f"hash pass of {child.stats.hash_seconds} s in a close of {child.stats.seconds} s")


def test_large_pieces_are_split_over_blake3_threads_with_the_same_digest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From HASH_SPLIT_MIN bytes a piece is hashed by BLAKE3's own threads (one tensor of 1 GiB would otherwise hash on
    one core); smaller ones by one thread each. The digest is the same either way."""
    monkeypatch.setattr(writer_module, "HASH_SPLIT_MIN", 2 * BLOCK)
    calls: list[tuple[int, int]] = []
    real_hash = writer_module.piece_hash

    def recording_hash(data: Any, *, threads: int) -> bytes:
        calls.append((memoryview(data).nbytes, threads))
        return real_hash(data, threads=threads)

    monkeypatch.setattr(writer_module, "piece_hash", recording_hash)
    state = odd_state()
    manifest = write(str(tmp_path / "ckpt"), state, hash_threads=2)
    assert manifest.references is not None and manifest.references.piece_hash is not None
    data = (tmp_path / "ckpt" / manifest.data).read_bytes()
    offsets, sizes = manifest.pieces.offset.tolist(), manifest.pieces.nbytes.tolist()
    expected = b"".join(blake3.blake3(data[at : at + size]).digest(16) for at, size in zip(offsets, sizes))
    assert manifest.references.piece_hash == expected
    split = sorted(size for size, threads in calls if threads == AUTO_THREADS)
    assert split == sorted(size for size in sizes if size >= 2 * BLOCK) and len(split) == 2  # big, strided
    assert {threads for size, threads in calls if size < 2 * BLOCK} == {1}


def test_the_writer_writes_on_while_the_hashes_of_its_pieces_are_pending(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every hash is held until the data file holds all its bytes: only a writer that never waits for a hash of a
    piece it writes (the tensors' own memory) finishes writing; one that hashes in line would hold the first hash."""
    state = {f"w{i}": torch.full((3 * BLOCK,), float(i)) for i in range(3)}
    total = sum(tensor.nbytes for tensor in state.values())
    storage = open_storage(str(tmp_path / "ckpt"))
    all_written = threading.Event()
    written = [0]
    open_new = storage.open_new

    class CountingFile:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def __enter__(self) -> CountingFile:
            self.inner.__enter__()
            return self

        def __exit__(self, *exc: object) -> Any:
            return self.inner.__exit__(*exc)

        def write(self, data: Any) -> Any:
            result = self.inner.write(data)
            written[0] += len(data)
            if written[0] >= total:
                all_written.set()
            return result

    monkeypatch.setattr(storage, "open_new", lambda path: CountingFile(open_new(path)))
    held: list[bool] = []
    real_digest = writer_module.piece_digest

    def held_digest(data: Any) -> bytes:
        # A guard against hanging on the old in-line design, not a timing bound: it fails the test, whatever the speed.
        held.append(all_written.wait(20))
        all_written.set()
        return real_digest(data)

    monkeypatch.setattr(writer_module, "piece_digest", held_digest)
    writer = ShardWriter(
        storage, rank=0, world_size=1, attempt="a", block_size=BLOCK, write_threads=1, piece_hashes=True
    )
    for name, tensor in state.items():
        writer.add(name, tensor)
    manifest = writer.close()
    if held != [True] * len(state):
        pytest.fail(f"hashes waited for the writer {held}: the writer waited for a hash before writing on")
    own = decode_local_manifest((tmp_path / "ckpt" / layout.local_manifest_path(0, "a")).read_bytes())
    assert own.references is not None and manifest.references is not None
    assert own.references.piece_hash == manifest.references.piece_hash
    assert len(own.references.piece_hash or b"") == 16 * len(state)
