"""Flat ZeRO partitions: one flat buffer per rank that cuts parameters at arbitrary element offsets (DeepSpeed).

A FlatPartition in a state dict saves as FQN-keyed flat pieces of each parameter and loads from any layout.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from shardckpt.errors import ShardckptUsageError
from shardckpt.planner.box import Box, linear_range_boxes


@dataclass
class FlatPartition:
    """Elements [start, start + buffer.numel()) of the concatenation of `params` (name, shape), in order."""

    buffer: torch.Tensor
    params: Sequence[tuple[str, tuple[int, ...]]]
    start: int
    shardckpt_leaf = True

    def __post_init__(self) -> None:
        if self.buffer.dim() != 1:
            raise ShardckptUsageError(f"a flat partition buffer must be 1-D, got shape {list(self.buffer.shape)}")
        total = sum(math.prod(shape) for _, shape in self.params)
        if not 0 <= self.start <= self.start + self.buffer.numel() <= total:
            raise ShardckptUsageError(
                f"flat partition [{self.start}, {self.start + self.buffer.numel()}) lies outside the {total} "
                "elements of its parameters"
            )

    def slices(self) -> Iterator[tuple[str, tuple[int, ...], int, torch.Tensor]]:
        """(name, global shape, first element within the parameter, this rank's elements of it)."""
        end = self.start + self.buffer.numel()
        base = 0
        for name, shape in self.params:
            numel = math.prod(shape)
            lo, hi = max(self.start, base), min(end, base + numel)
            if lo < hi:
                yield name, tuple(shape), lo - base, self.buffer[lo - self.start : hi - self.start]
            base += numel

    def boxes(self) -> Iterator[tuple[str, Box, torch.Tensor]]:
        """Boxes of each parameter whose row-major elements fill a contiguous part of the buffer."""
        for name, shape, first, piece in self.slices():
            position = 0
            for box in linear_range_boxes(shape, first, first + piece.numel()):
                yield name, box, piece[position : position + box.volume].view(box.shape)
                position += box.volume
