"""Named crash points for fault-injection tests: SHARDCKPT_CRASH_AT=<point>[:<rank>] kills this process there.

The points mark the protocol's phases (see protocol.py and SPEC.md section 9). Unset, a point costs one dict lookup.
"""

from __future__ import annotations

import os
import signal

POINTS = (
    "writing_data",  # a rank has written part of its data file
    "after_local_manifest",  # a rank's data file and local manifest are durable
    "before_global_manifest",  # the coordinator validated the local manifests
    "before_commit",  # the global manifest is durable, COMMITTED not yet written
    "during_retention",  # retention deleted a COMMITTED marker, not yet the files
)


def crash_point(point: str, rank: int | None = None) -> None:
    """SIGKILL this process if SHARDCKPT_CRASH_AT names `point` (and this rank, when a rank is given there)."""
    wanted = os.environ.get("SHARDCKPT_CRASH_AT")
    if not wanted:
        return
    name, _, only_rank = wanted.partition(":")
    if name == point and (not only_rank or rank is None or int(only_rank) == rank):
        os.kill(os.getpid(), signal.SIGKILL)
