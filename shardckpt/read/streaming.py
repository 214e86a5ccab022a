"""Reading whole tensors of a checkpoint under a memory bound: consecutive row-major element ranges, in order.

Export and diff stream through these chunks, so their memory stays bounded whatever the size of a tensor.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

from shardckpt.errors import ShardckptUsageError
from shardckpt.planner.box import linear_range_boxes
from shardckpt.read.checkpoint import Checkpoint, open_checkpoint
from shardckpt.storage import Storage
from shardckpt.torch_bytes import torch_dtype

MIN_MEMORY_LIMIT = 1 << 20


def open_streaming(
    url: str | Storage, memory_limit: int, *, storage_options: dict[str, Any] | None = None
) -> Checkpoint:
    """Open a checkpoint for streaming reads whose fetched bytes stay within a quarter of `memory_limit`.

    The limit splits as: 3/8 for the chunk buffers (chunk_arena), a quarter for fetched bytes (waves of an
    eighth: the restorer may hold one wave while it fetches the next), and 3/8 for checksum-block rounding,
    the interpreter's first-use allocations (thread pools, manifests, plans) and allocator slack.
    """
    if memory_limit < MIN_MEMORY_LIMIT:
        raise ShardckptUsageError(f"a memory limit of {memory_limit} bytes is too small; use at least 1 MiB")
    fetch = memory_limit // 8
    return open_checkpoint(url, storage_options=storage_options, max_in_flight=fetch, max_request=fetch)


def chunk_arena(memory_limit: int) -> torch.Tensor:
    """The bytes a stream's chunk buffers live in: 3/8 of the limit, allocated once and reused for every chunk.

    Reusing one allocation keeps the allocator from holding freed chunk buffers of every size it has seen.
    """
    return torch.empty(memory_limit * 3 // 8, dtype=torch.uint8)


def chunk_elements(checkpoint: Checkpoint, arena: torch.Tensor, bytes_per_element: int) -> int:
    """Elements per chunk so that buffers of `bytes_per_element` bytes per element fit in the arena."""
    usable = arena.numel() - 64  # room to align each buffer of the arena to 8 bytes
    if usable < bytes_per_element:
        raise ShardckptUsageError(
            f"the memory limit is too small for {checkpoint.url}: one element needs {bytes_per_element} bytes"
        )
    return usable // bytes_per_element


def arena_view(arena: torch.Tensor, offset: int, count: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """`count` elements of `dtype` in the arena at the first 8-byte boundary from `offset`, and the next offset."""
    start = -(-offset // 8) * 8
    end = start + count * dtype.itemsize
    if end > arena.numel():
        raise ShardckptUsageError(f"chunk buffers need {end} bytes, the arena holds {arena.numel()}")
    return arena[start:end].view(dtype), end


def read_chunks(
    checkpoint: Checkpoint, name: str, elements: int, arena: torch.Tensor, offset: int = 0
) -> Iterator[torch.Tensor]:
    """Tensor `name` as consecutive 1-D chunks of at most `elements` elements, in row-major order.

    Each chunk is a view of the arena at `offset` that the next chunk overwrites: use (or copy) it before
    advancing. Every chunk is one planned read, verified against its checksums like any other read.
    """
    entry = checkpoint.entry(name)
    numel = math.prod(entry.shape)
    if numel == 0:
        return
    size = min(numel, max(1, elements))
    buffer, _ = arena_view(arena, offset, size, torch_dtype(entry.dtype))
    for start in range(0, numel, size):
        stop = min(numel, start + size)
        items, position = [], 0
        for box in linear_range_boxes(entry.shape, start, stop):
            items.append((name, box, buffer[position : position + box.volume].view(box.shape)))
            position += box.volume
        checkpoint.read_into(items)
        yield buffer[: stop - start]
