"""Retention: keep the newest N committed checkpoints under a root and delete older ones safely.

COMMITTED goes first (the checkpoint stops existing for readers at once), then its files; the newest committed
checkpoint is never deleted, nor anything outside the checkpoints being pruned.
"""

from __future__ import annotations

from shardckpt.crashpoints import crash_point
from shardckpt.errors import ShardckptError, ShardckptUsageError
from shardckpt.format import layout
from shardckpt.restorer import read_commit_marker
from shardckpt.storage import Storage


def committed_checkpoints(root: Storage) -> list[tuple[tuple[bool, int, float], str]]:
    """(sort key, name) of every committed checkpoint directly under `root`, oldest first."""
    found = []
    for name in root.list():
        try:
            marker = read_commit_marker(root.child(name))
        except ShardckptError:
            continue  # a broken marker: not ours to judge here (verify/gc report it)
        if marker is not None:
            found.append(((marker.step is not None, marker.step or 0, marker.created), name))
    return sorted(found)


def delete_checkpoint(storage: Storage) -> None:
    """Delete one checkpoint: its COMMITTED marker first, then every file the layout names, then directories."""
    storage.delete(layout.COMMITTED)
    crash_point("during_retention")
    for name in storage.list():
        # Global manifests of every attempt, and the temporary file of a local commit that crashed midway.
        if name.startswith(("manifest-", f"{layout.COMMITTED}.tmp-")):
            storage.delete(name)
    for directory in (layout.RANKS_DIR, layout.DATA_DIR):
        for name in storage.list(directory):
            storage.delete(f"{directory}/{name}")
        storage.delete(directory)
    storage.delete("")


def prune(root: Storage, keep_last: int) -> list[str]:
    """Delete all but the newest `keep_last` committed checkpoints under `root`; returns the deleted names."""
    if keep_last < 1:
        raise ShardckptUsageError(f"keep_last must be >= 1 (the newest checkpoint is never deleted), got {keep_last}")
    committed = committed_checkpoints(root)
    doomed = [name for _, name in committed[: max(0, len(committed) - keep_last)]]
    for name in doomed:
        delete_checkpoint(root.child(name))
    return doomed
