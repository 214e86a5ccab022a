"""Many small pieces (a MoE state, issue 15) reach the backend as a few large writes, on both of the writer's
paths (one stream, and the multi-stream path a large file would take), and read back bit-exact."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import shardckpt
import shardckpt.write.writer as writer_module
from shardckpt.storage import open_storage
from shardckpt.write.writer import ShardWriter

PIECES = 1000  # of 1 KiB each: every one smaller than a checksum block


class _CountingFile:
    """A new file that counts the writes handed to it and passes everything else through."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.writes = inner, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __enter__(self) -> _CountingFile:
        self.inner.__enter__()
        return self

    def __exit__(self, *exc: object) -> Any:
        return self.inner.__exit__(*exc)

    def write(self, data: Any) -> Any:
        self.writes += 1
        return self.inner.write(data)

    def write_at(self, data: Any, offset: int) -> Any:
        self.writes += 1
        return self.inner.write_at(data, offset)


@pytest.mark.parametrize("parallel_min_bytes", [writer_module.PARALLEL_MIN_BYTES, 0], ids=["one-stream", "large-file"])
def test_small_pieces_are_written_in_few_buffers(tmp_path, monkeypatch, parallel_min_bytes: int) -> None:
    monkeypatch.setattr(writer_module, "PARALLEL_MIN_BYTES", parallel_min_bytes)
    storage = open_storage(str(tmp_path / "ckpt"))
    opened: list[_CountingFile] = []
    open_new = storage.open_new

    def counting_open_new(path: str) -> _CountingFile:
        opened.append(_CountingFile(open_new(path)))
        return opened[-1]

    monkeypatch.setattr(storage, "open_new", counting_open_new)
    state = {f"layers.0.experts.{i}.w1": torch.full((8, 32), float(i)) for i in range(PIECES)}
    writer = ShardWriter(storage, rank=0, world_size=1, attempt="a", write_threads=2)
    for name, tensor in state.items():
        writer.add(name, tensor)
    writer.close()
    data_file = opened[0]  # the data file; the local manifest follows it
    assert data_file.writes <= 4, f"{PIECES} pieces of 1 KiB took {data_file.writes} writes"
    shardckpt.commit(str(tmp_path / "ckpt"), world_size=1, attempt="a")
    checkpoint = shardckpt.open(str(tmp_path / "ckpt"))
    for name in (f"layers.0.experts.{i}.w1" for i in (0, 1, 517, PIECES - 1)):
        assert torch.equal(checkpoint.read(name), state[name])
