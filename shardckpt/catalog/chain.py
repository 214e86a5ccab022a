"""The commit chain of one checkpoint directory: its COMMITTED marker, read and decoded (torch-free).

A checkpoint exists for readers exactly when this marker does (SPEC section 9); everything else follows from it.
"""

from __future__ import annotations

from shardckpt.errors import NotFoundError
from shardckpt.format import layout, limits
from shardckpt.format.manifest import CommitMarker, decode_commit_marker
from shardckpt.storage import Storage


def read_marker_bytes(storage: Storage) -> bytes | None:
    """The raw COMMITTED marker, or None when the checkpoint is not committed."""
    try:
        return storage.read_small(layout.COMMITTED, limits.MAX_COMMIT_MARKER_BYTES)
    except NotFoundError:
        return None


def read_commit_marker(storage: Storage) -> CommitMarker | None:
    """The decoded COMMITTED marker, None when absent; FormatError (or StorageError) when unreadable."""
    raw = read_marker_bytes(storage)
    return None if raw is None else decode_commit_marker(raw, storage.describe(layout.COMMITTED))
