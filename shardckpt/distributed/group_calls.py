"""The protocols' collectives over a process group or over one process (Solo), so that each protocol is written
once: msgpack values in and out, and a peer's death or the group's timeout raised as a DistributedError.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack

from shardckpt.distributed.collectives import (
    Group,
    all_gather_bytes,
    all_gather_sizes,
    any_rank,
    broadcast_bytes,
    gather_bytes,
)
from shardckpt.errors import DistributedError, ShardckptUsageError, rank_list

T = TypeVar("T")


@dataclass(frozen=True)
class Solo:
    """The trivial group of one process, so both protocols are written once."""

    rank: int = 0
    size: int = 1


def broadcast(group: Group | Solo, data: bytes | None, src: int) -> bytes:
    if isinstance(group, Solo):
        assert data is not None
        return data
    return collective(lambda: broadcast_bytes(group, data, src), group)


def gather(group: Group | Solo, data: bytes, dst: int) -> list[bytes] | None:
    if isinstance(group, Solo):
        return [data]
    return collective(lambda: gather_bytes(group, data, dst), group)


def vote(group: Group | Solo, flag: bool) -> bool:
    """True on every rank when `flag` is true on any."""
    if isinstance(group, Solo):
        return flag
    return collective(lambda: any_rank(group, flag), group)


def all_gather(group: Group | Solo, data: bytes) -> list[bytes]:
    if isinstance(group, Solo):
        return [data]
    return collective(lambda: all_gather_bytes(group, data), group)


def agree_on_coordinator(group: Group | Solo, coordinator: int, operation: str) -> int:
    """`coordinator`, once every rank named the same rank of the group; else the same ShardckptUsageError on every
    rank. Ranks that named different coordinators would each wait in a broadcast from another rank until the
    group's timeout (and one whose value is out of range would raise alone), so this small all-gather comes first."""
    valid = isinstance(coordinator, int) and not isinstance(coordinator, bool)
    named = coordinator if valid else -1  # the others need a number; this rank says what it was given below
    named_by = [named] if isinstance(group, Solo) else collective(lambda: all_gather_sizes(group, named), group)
    if len(set(named_by)) > 1:
        ranks_of: dict[int, list[int]] = {}
        for rank, value in enumerate(named_by):
            ranks_of.setdefault(value, []).append(rank)
        choices = "; ".join(f"{value} on {rank_list(ranks)}" for value, ranks in sorted(ranks_of.items()))
        raise ShardckptUsageError(
            f"{operation}: coordinator= differs between the ranks of the group ({choices}): pass the same rank "
            "on every rank"
        )
    if not valid or not 0 <= named < group.size:
        raise ShardckptUsageError(f"coordinator {coordinator!r} is not a rank of the group of {group.size}")
    return named


def collective(run: Callable[[], T], group: Group) -> T:
    """`run`'s result; its RuntimeError (a peer died, or the group's timeout passed) a DistributedError."""
    try:
        return run()
    except RuntimeError as exc:
        raise DistributedError("a collective", {group.rank: f"{type(exc).__name__}: {exc}"}) from exc


def describe(exc: BaseException | None) -> str:
    return f"{type(exc).__name__}: {exc}"


def pack(value: Any) -> bytes:
    packed: bytes = msgpack.packb(value, use_bin_type=True)
    return packed


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)
