"""Named crash points for fault-injection tests: SHARDCKPT_CRASH_AT=<point>[:<rank>][@<n>] kills this process there.

The points mark the protocol's phases (see protocol.py and SPEC.md section 9); `@n` kills at the nth time this
process reaches the point (default: the first). Unset, a point costs one dict lookup.
"""

from __future__ import annotations

import os
import signal
from collections import Counter

POINTS = (
    "writing_data",  # a rank has written part of its data file
    "after_local_manifest",  # a rank's data file and local manifest are durable
    "before_global_manifest",  # the coordinator validated the local manifests
    "before_commit",  # the global manifest is durable, COMMITTED not yet written
    "during_retention",  # retention deleted a COMMITTED marker, not yet the files
    "during_gc",  # gc has just deleted one object (use @n to pick which)
)

_reached: Counter[str] = Counter()  # per process: how often each point was reached while armed


def crash_point(point: str, rank: int | None = None) -> None:
    """SIGKILL this process if SHARDCKPT_CRASH_AT names `point` (and this rank, when a rank is given there)."""
    wanted = os.environ.get("SHARDCKPT_CRASH_AT")
    if not wanted:
        return
    target, _, nth = wanted.partition("@")
    name, _, only_rank = target.partition(":")
    if name != point or (only_rank and rank is not None and int(only_rank) != rank):
        return
    _reached[point] += 1
    if _reached[point] >= int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
