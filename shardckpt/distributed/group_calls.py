"""The protocols' collectives over a process group or over one process (Solo), so that each protocol is written
once: msgpack values in and out, and a peer's death or the group's timeout raised as a DistributedError.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack

from shardckpt.distributed.collectives import Group, all_gather_bytes, any_rank, broadcast_bytes, gather_bytes
from shardckpt.errors import DistributedError

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
