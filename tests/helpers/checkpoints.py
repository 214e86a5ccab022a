"""Checkpoints for tests: a sample state of every dtype and shape class, and a writer that saves it as W ranks.

Shared by the test folders (import from tests.helpers.checkpoints, never from conftest).
"""

from __future__ import annotations

import math

import torch

import shardckpt
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
    piece_hashes: bool | None = None,
    compression: str | None = None,
) -> str:
    """Write `state` as `world` ranks (Shard(0) rows; flat ranges for names in `flat`) and commit."""
    attempt = attempt or new_attempt()
    for rank in range(world):
        writer = shardckpt.ShardWriter(
            url,
            rank=rank,
            world_size=world,
            attempt=attempt,
            block_size=block_size,
            step=step,
            piece_hashes=piece_hashes,
            compression=compression,
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
