"""Byte-string collectives over a torch process group (gloo or NCCL), without pickle.

The protocol only ever exchanges bytes it encodes itself (msgpack), so nothing a peer sends can run code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Group:
    """A process group with this process's rank in it and the device its collectives run on."""

    handle: Any
    rank: int
    size: int
    device: torch.device

    @classmethod
    def of(cls, process_group: Any) -> Group:
        backend = dist.get_backend(process_group)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        return cls(process_group, dist.get_rank(process_group), dist.get_world_size(process_group), device)

    def global_rank(self, group_rank: int) -> int:
        return int(dist.get_global_rank(self.handle, group_rank)) if self.handle is not None else group_rank


def _to_tensor(data: bytes, size: int, device: torch.device) -> torch.Tensor:
    buffer = torch.zeros(size, dtype=torch.uint8)
    if data:
        buffer[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buffer.to(device)


def all_gather_sizes(group: Group, size: int) -> list[int]:
    return [values[0] for values in all_gather_ints(group, [size])]


def all_gather_ints(group: Group, values: list[int]) -> list[list[int]]:
    """Every rank's `values` (64-bit integers, as many on every rank): one collective."""
    mine = torch.tensor(values, dtype=torch.int64, device=group.device)
    gathered = [torch.zeros(len(values), dtype=torch.int64, device=group.device) for _ in range(group.size)]
    dist.all_gather(gathered, mine, group=group.handle)
    return [[int(v) for v in tensor.tolist()] for tensor in gathered]


def gather_bytes(group: Group, data: bytes, dst: int) -> list[bytes] | None:
    """Every rank's bytes at group rank `dst` (None elsewhere)."""
    sizes = all_gather_sizes(group, len(data))
    longest = max(sizes)
    mine = _to_tensor(data, longest, group.device)
    buffers = [torch.zeros(longest, dtype=torch.uint8, device=group.device) for _ in range(group.size)]
    dist.gather(mine, buffers if group.rank == dst else None, dst=group.global_rank(dst), group=group.handle)
    if group.rank != dst:
        return None
    return [bytes(buffer.cpu()[:size].numpy().tobytes()) for buffer, size in zip(buffers, sizes)]


def all_gather_bytes(group: Group, data: bytes) -> list[bytes]:
    sizes = all_gather_sizes(group, len(data))
    longest = max(sizes)
    mine = _to_tensor(data, longest, group.device)
    buffers = [torch.zeros(longest, dtype=torch.uint8, device=group.device) for _ in range(group.size)]
    dist.all_gather(buffers, mine, group=group.handle)
    return [bytes(buffer.cpu()[:size].numpy().tobytes()) for buffer, size in zip(buffers, sizes)]


def all_gather_fixed(group: Group, data: bytes, size: int) -> list[bytes]:
    """Every rank's `data` of at most `size` bytes (trailing zero bytes dropped): one collective."""
    if len(data) > size:
        raise ValueError(f"{len(data)} bytes do not fit a fixed gather of {size}")
    mine = _to_tensor(data, size, group.device)
    buffers = [torch.zeros(size, dtype=torch.uint8, device=group.device) for _ in range(group.size)]
    dist.all_gather(buffers, mine, group=group.handle)
    return [bytes(buffer.cpu().numpy().tobytes()).rstrip(b"\0") for buffer in buffers]


# A broadcast carries its length and up to this many bytes in one collective; longer data takes a second one.
INLINE_BYTES = 64 << 10


def broadcast_bytes(group: Group, data: bytes | None, src: int) -> bytes:
    """`data` of group rank `src`, on every rank: one collective when it fits INLINE_BYTES, else two."""
    mine = data if group.rank == src and data is not None else b""
    first = _to_tensor(len(mine).to_bytes(8, "little") + mine[:INLINE_BYTES], 8 + INLINE_BYTES, group.device)
    dist.broadcast(first, src=group.global_rank(src), group=group.handle)
    head = first.cpu().numpy().tobytes()
    length = int.from_bytes(head[:8], "little")
    if length <= INLINE_BYTES:
        return head[8 : 8 + length]
    rest = _to_tensor(mine[INLINE_BYTES:], length - INLINE_BYTES, group.device)
    dist.broadcast(rest, src=group.global_rank(src), group=group.handle)
    return head[8:] + rest.cpu().numpy().tobytes()


def any_ranks(group: Group, flags: list[bool]) -> list[bool]:
    """For each flag, True on every rank when it is true on any: one small collective for several questions."""
    value = torch.tensor([int(flag) for flag in flags], dtype=torch.int64, device=group.device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group.handle)
    return [bool(v) for v in value.tolist()]


def smallest(group: Group, value: int) -> int:
    """The smallest of every rank's `value`, on every rank: one small collective."""
    tensor = torch.tensor([value], dtype=torch.int64, device=group.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group.handle)
    return int(tensor.item())


def any_rank(group: Group, flag: bool) -> bool:
    """True on every rank when `flag` is true on any: one small collective."""
    value = torch.tensor([int(flag)], dtype=torch.int64, device=group.device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group.handle)
    return bool(value.item())


def any_and_least(group: Group, flag: bool, value: int) -> tuple[bool, int]:
    """(True when `flag` is true on any rank, the smallest of every rank's `value`), on every rank: one small
    collective."""
    tensor = torch.tensor([int(flag), -value], dtype=torch.int64, device=group.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group.handle)
    flagged, least = tensor.tolist()
    return bool(flagged), -int(least)
