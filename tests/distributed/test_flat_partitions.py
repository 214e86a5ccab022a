"""Flat ZeRO partitions (one flat buffer per rank cutting parameters anywhere) to FSDP-style row shards and back."""

from __future__ import annotations

import math

import torch

import shardckpt
from shardckpt.format.layout import new_attempt
from shardckpt.statedict import FlatPartition
from shardckpt.statedict.flatten import flatten
from shardckpt.statedict.leaves import save_items
from tests.helpers.checkpoints import chunk_bounds

PARAMS = [("layer.weight", (5, 7)), ("layer.bias", (7,)), ("head.weight", (3, 4)), ("scale", ())]


def _full() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    return {name: torch.randn(shape, generator=generator) for name, shape in PARAMS}


def _flat_partitions(full: dict[str, torch.Tensor], world: int) -> list[FlatPartition]:
    flat = torch.cat([full[name].reshape(-1) for name, _ in PARAMS])
    partitions = []
    for rank in range(world):
        lo, hi = chunk_bounds(flat.numel(), world, rank)
        partitions.append(FlatPartition(flat[lo:hi].clone(), PARAMS, lo))
    return partitions


def _save_ranks(states: list[dict], url: str) -> None:
    """Each simulated rank writes what the adapters say it owns, then one commit."""
    attempt = new_attempt()
    for rank, state in enumerate(states):
        writer = shardckpt.ShardWriter(url, rank=rank, world_size=len(states), attempt=attempt, block_size=4096)
        items = save_items(flatten(state), rank, len(states))
        for name, tensor, placement in items.pieces:
            writer.add(name, tensor, **placement)
        writer.close()
    shardckpt.commit(url, world_size=len(states), attempt=attempt)


def test_zero_partitions_restore_into_row_shards_and_back(tmp_path) -> None:
    full = _full()
    zero_url, rows_url = str(tmp_path / "zero"), str(tmp_path / "rows")
    _save_ranks([{"flat": p} for p in _flat_partitions(full, 3)], zero_url)
    checkpoint = shardckpt.open(zero_url)
    assert {e.layout for e in checkpoint.manifest.tensors} == {"flat"}
    # Read as FSDP2 would hold it on 4 ranks: row chunks of every parameter.
    row_states = []
    for rank in range(4):
        state = {}
        for name, shape in PARAMS:
            if not shape:
                state[name] = checkpoint.read(name)
                continue
            lo, hi = chunk_bounds(shape[0], 4, rank)
            piece = checkpoint.read(name, (lo,) + (0,) * (len(shape) - 1), (hi - lo, *shape[1:]))
            assert torch.equal(piece, full[name][lo:hi])
            state[name] = piece
        row_states.append(state)
    # Save those row shards as a box-layout checkpoint (scalars replicated) ...
    attempt = new_attempt()
    for rank, state in enumerate(row_states):
        writer = shardckpt.ShardWriter(rows_url, rank=rank, world_size=4, attempt=attempt, block_size=4096)
        for name, shape in PARAMS:
            if not shape:
                if rank == 0:
                    writer.add(name, state[name])
                continue
            lo, _ = chunk_bounds(shape[0], 4, rank)
            writer.add(name, state[name], global_shape=shape, offsets=(lo,) + (0,) * (len(shape) - 1))
        writer.close()
    shardckpt.commit(rows_url, world_size=4, attempt=attempt)
    # ... and back into flat partitions of a different world size, through the adapter's load path.
    total = sum(math.prod(shape) for _, shape in PARAMS)
    expected = torch.cat([full[name].reshape(-1) for name, _ in PARAMS])
    for world in (1, 2, 5):
        for rank in range(world):
            lo, hi = chunk_bounds(total, world, rank)
            partition = FlatPartition(torch.zeros(hi - lo), PARAMS, lo)
            shardckpt.load({"flat": partition}, rows_url)
            assert torch.equal(partition.buffer, expected[lo:hi]), (world, rank)


def test_mixed_flat_and_box_pieces_of_one_tensor(tmp_path) -> None:
    """One rank stores contiguous rows as a box, another a flat range: the commit describes the tensor flat."""
    full = torch.arange(20.0).reshape(4, 5)
    url = str(tmp_path / "mixed")
    attempt = new_attempt()
    writer = shardckpt.ShardWriter(url, rank=0, world_size=2, attempt=attempt)
    writer.add("w", full[:2], global_shape=(4, 5), offsets=(0, 0))
    writer.close()
    writer = shardckpt.ShardWriter(url, rank=1, world_size=2, attempt=attempt)
    writer.add("w", full.reshape(-1)[10:], global_shape=(4, 5), flat_offset=10)
    writer.close()
    shardckpt.commit(url, world_size=2, attempt=attempt)
    checkpoint = shardckpt.open(url)
    assert checkpoint.manifest.tensor("w").layout == "flat"
    assert torch.equal(checkpoint.read("w"), full)
    assert torch.equal(checkpoint.read("w", (1, 2), (3, 2)), full[1:4, 2:4])
    from shardckpt.ops.verify import verify

    assert verify(url).ok
