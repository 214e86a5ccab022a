"""Named crash points for fault-injection tests: SHARDCKPT_CRASH_AT=<point>[:<rank>][@<n>] kills this process there.

The points mark the protocol's phases (see protocol.py and SPEC.md section 9); `@n` kills at the nth time this
process reaches the point (default: the first). Unset, a point costs one dict lookup.
"""

from __future__ import annotations

import functools
import os
import signal
from collections import Counter

from shardckpt.errors import ShardckptUsageError

POINTS = (
    "writing_data",  # a rank has written part of its data file
    "after_local_manifest",  # a rank's data file and local manifest are durable
    "before_global_manifest",  # the coordinator validated the local manifests
    "before_commit",  # the global manifest is durable, COMMITTED not yet written
    "during_retention",  # retention deleted a COMMITTED marker, not yet the files
    "during_gc",  # gc has just deleted one object (use @n to pick which)
)

_reached: Counter[str] = Counter()  # per process: how often each point was reached while armed


@functools.lru_cache(maxsize=4)
def _armed(wanted: str) -> tuple[str, int | None, int]:
    """SHARDCKPT_CRASH_AT's (point, rank or None, n), or a ShardckptUsageError: a misspelt point would otherwise
    never fire, and a test that expects a crash would pass without one."""
    target, at, nth = wanted.partition("@")
    name, colon, only_rank = target.partition(":")
    if name in POINTS and (not colon or only_rank.isdigit()) and (not at or (nth.isdigit() and int(nth) >= 1)):
        return name, int(only_rank) if colon else None, int(nth or 1)
    raise ShardckptUsageError(
        f"SHARDCKPT_CRASH_AT={wanted!r} is not valid: <point>[:<rank>][@<n>], n >= 1, the point one of "
        f"{', '.join(POINTS)}; unset it"
    )


def check_crash_at() -> None:
    """Refuse a malformed SHARDCKPT_CRASH_AT now: what reaches a crash point calls this before any work, so a typo
    fails there rather than at the first point, after part of a save's files or a retention's deletions."""
    wanted = os.environ.get("SHARDCKPT_CRASH_AT")
    if wanted:
        _armed(wanted)


def crash_point(point: str, rank: int | None = None) -> None:
    """SIGKILL this process if SHARDCKPT_CRASH_AT names `point` (and this rank, when a rank is given there)."""
    wanted = os.environ.get("SHARDCKPT_CRASH_AT")
    if not wanted:
        return
    name, only_rank, nth = _armed(wanted)
    if name != point or (only_rank is not None and rank is not None and only_rank != rank):
        return
    _reached[point] += 1
    if _reached[point] >= nth:
        os.kill(os.getpid(), signal.SIGKILL)
