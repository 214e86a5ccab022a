"""Staging for asynchronous saves: a host copy of everything a rank will write, in reusable buffers.

The training step only pays for the copies; the write, commit and retention run in the background from them.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from shardckpt.statedict.dtensor import is_dtensor, local_box
from shardckpt.statedict.flat import FlatPartition
from shardckpt.statedict.flatten import flatten
from shardckpt.statedict.leaves import PerRank, StagedShard, check_savable
from shardckpt.statedict.stateful import saved_states
from shardckpt.torch_bytes import host_staging


class StagingBuffers:
    """Host buffers kept across saves (pinned for CUDA sources) so each save copies into warm memory."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def copy(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        source = tensor.detach()
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            buffer = host_staging(tuple(source.shape), source.dtype, source.device)
            self._buffers[name] = buffer
        buffer.copy_(source)
        return buffer

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def stage(state: Mapping[str, Any], buffers: StagingBuffers) -> dict[str, Any]:
    """A flat state dict (same names as `state` flattens to) whose tensors are host copies in `buffers`."""
    staged: dict[str, Any] = {}
    leaves = flatten(saved_states(state))
    check_savable(leaves)  # a tensor that cannot be stored is named here, not by a failing staging copy
    for leaf in leaves:
        value = leaf.value
        if is_dtensor(value):
            box = local_box(leaf.name, value)
            local = buffers.copy(leaf.name, box.local) if box.writes else box.local[:0]
            staged[leaf.name] = StagedShard(local, box.global_shape, box.offsets, box.writes)
        elif isinstance(value, torch.Tensor):
            staged[leaf.name] = buffers.copy(leaf.name, value)
        elif isinstance(value, FlatPartition):
            staged[leaf.name] = FlatPartition(buffers.copy(leaf.name, value.buffer), value.params, value.start)
        elif isinstance(value, PerRank):
            staged[leaf.name] = PerRank(copy.deepcopy(value.value), value.missing)
        else:
            staged[leaf.name] = copy.deepcopy(value)
    return staged
