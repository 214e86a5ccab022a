"""The protocols' collectives over a process group or over one process (Solo), so that each protocol is written
once: msgpack values in and out, and a peer's death or the group's timeout raised as a DistributedError.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack

from shardckpt.distributed.collectives import (
    Group,
    all_gather_bytes,
    all_gather_ints,
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


def agree_on_coordinator(
    group: Group | Solo, coordinator: int, operation: str, same: Mapping[str, object] | None = None
) -> int:
    """`coordinator`, once every rank named the same rank of the group and passed equal `same` arguments (name ->
    None, an integer, or bytes compared by digest); else the same ShardckptUsageError on every rank, before any
    byte is written. Ranks that named different coordinators would each wait in a broadcast from another rank until
    the group's timeout (and one whose value is out of range would raise alone); ranks that passed different steps
    or metadata would commit the coordinator's silently. So this one small all-gather comes first."""
    valid = isinstance(coordinator, int) and not isinstance(coordinator, bool) and -(1 << 63) <= coordinator < 1 << 63
    named = coordinator if valid else -1  # the others need a number; this rank says what it was given below
    mine = [named, *(number for value in (same or {}).values() for number in token(value))]
    gathered = [mine] if isinstance(group, Solo) else collective(lambda: all_gather_ints(group, mine), group)
    given = {"coordinator": [(_INT, v[0]) for v in gathered]}
    given.update({name: [(v[2 * i + 1], v[2 * i + 2]) for v in gathered] for i, name in enumerate(same or {})})
    refusal = disagreement(operation, given)
    if refusal is not None:
        raise refusal
    if not valid or not 0 <= named < group.size:
        raise ShardckptUsageError(f"coordinator {coordinator!r} is not a rank of the group of {group.size}")
    return named


# An argument as two 64-bit integers: (kind, value). A value each rank checks itself later (a bool step, a block
# size beyond 64 bits) is INVALID on every rank alike, so that its own check, not this one, names what is wrong.
_NONE, _INT, _DIGEST, _INVALID = 0, 1, 2, 3


def disagreement(operation: str, given: Mapping[str, list[tuple[int, int]]]) -> ShardckptUsageError | None:
    """The error naming every argument whose tokens (one per rank, from `token`) differ, each value and its ranks."""
    differing = [
        f"{name}= differs between the ranks of the group ({_choices(tokens)})"
        for name, tokens in given.items()
        if len(set(tokens)) > 1
    ]
    if not differing:
        return None
    return ShardckptUsageError(f"{operation}: {', and '.join(differing)}: pass the same value on every rank")


def token(value: object) -> tuple[int, int]:
    """`value` as two 64-bit integers that ranks can compare (and print) without the value itself."""
    if value is None:
        return _NONE, 0
    if isinstance(value, int) and not isinstance(value, bool) and -(1 << 63) <= value < 1 << 63:
        return _INT, value
    if isinstance(value, bytes):
        return _DIGEST, int.from_bytes(hashlib.blake2b(value, digest_size=8).digest(), "little", signed=True)
    return _INVALID, 0


def _choices(given: list[tuple[int, int]]) -> str:
    """'100 on rank 0; 101 on ranks 1-3': each value, then the ranks that passed it."""
    ranks_of: dict[tuple[int, int], list[int]] = {}
    for rank, token in enumerate(given):
        ranks_of.setdefault(token, []).append(rank)
    return "; ".join(f"{_shown(token)} on {rank_list(ranks)}" for token, ranks in sorted(ranks_of.items()))


def _shown(token: tuple[int, int]) -> str:
    kind, number = token
    if kind == _INT:
        return str(number)
    if kind == _DIGEST:  # the other ranks' values are not here: the BLAKE2b of its encoding tells them apart
        return f"a value with digest {number & ((1 << 64) - 1):016x}"
    return "None" if kind == _NONE else "a value that is not valid"


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
