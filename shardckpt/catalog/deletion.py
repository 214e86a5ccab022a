"""SPEC section 14 deletion, the one routine Checkpointer retention and gc both call.

COMMITTED first (the checkpoint stops existing for readers at once), then the other files in layout order; only
names the layout gives; never through a link, never outside the root.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from shardckpt.catalog.listing import local_path, not_owned_reason
from shardckpt.errors import FormatError, StorageError
from shardckpt.format import layout
from shardckpt.storage import Storage

TEMP_PREFIX = f"{layout.COMMITTED}.tmp-"  # the local commit's temporary marker (a crash can leave one behind)
# Directories a deletion removes once empty, after the files: "" is the checkpoint directory itself. Anything
# the layout does not name keeps its directory (and the checkpoint's) in place.
DIRECTORIES = (layout.RANKS_DIR, layout.DATA_DIR, "")
# Global manifests go right after COMMITTED, so a crash mid-way never leaves a manifest whose local manifests or
# data are gone while the manifest itself still looks committable; data last.
# The successor markers of a superseded checkpoint (SPEC 14.2) go after COMMITTED, which alone makes it exist.
# Claims (SPEC 14) go last: a collector's claim keeps a paused commit of its attempt from committing until every
# file of the attempt is gone.
_ORDER = {
    layout.COMMITTED: 0,
    "successor": 1,
    "manifest": 2,
    layout.RANKS_DIR: 3,
    layout.DATA_DIR: 4,
    "temp": 5,
    "claim": 6,
}


def is_temp_marker(path: str) -> bool:
    """True for the temporary file of a local commit of COMMITTED or a successor marker (`<marker>.tmp-<hex>`)."""
    marker, separator, _ = path.partition(".tmp-")
    return bool(separator) and "/" not in path and layout.marker_generation(marker) is not None


def attempt_of(path: str) -> str:
    """The attempt a layout path belongs to ("" for commit markers and temporary markers); FormatError for any other
    name."""
    if layout.marker_generation(path) is not None or is_temp_marker(path):
        return ""
    if path.startswith(f"{layout.RANKS_DIR}/"):
        return layout.parse_local_manifest_path(path)[1]
    if path.startswith(f"{layout.DATA_DIR}/"):
        return layout.parse_data_path(path)[1]
    if path.startswith("claim-"):
        return layout.parse_claim_path(path)
    return layout.parse_global_manifest_path(path)


def deletion_order(path: str) -> tuple[int, str]:
    """Sort key of a layout path in SPEC 14 order: COMMITTED, global manifests, ranks/, data/, temporary markers,
    claims."""
    if path == layout.COMMITTED:
        return _ORDER[path], path
    if layout.marker_generation(path) is not None:
        return _ORDER["successor"], path
    if is_temp_marker(path):
        return _ORDER["temp"], path
    if path.startswith("claim-"):
        return _ORDER["claim"], path
    return _ORDER[path.split("/", 1)[0] if "/" in path else "manifest"], path


def layout_objects(checkpoint: Storage) -> list[tuple[str, str]]:
    """(path, attempt) of every object in a checkpoint directory that the layout names, COMMITTED excepted.

    In deletion order; successor markers (COMMITTED-<g>, SPEC 14.2) and temporary markers have attempt "" (see
    `is_successor`). Anything else is not ours: never listed.
    """
    candidates = [name for name in checkpoint.list() if name != layout.COMMITTED]
    for directory in (layout.RANKS_DIR, layout.DATA_DIR):
        candidates += [f"{directory}/{name}" for name in checkpoint.list(directory)]
    found: list[tuple[str, str]] = []
    for path in candidates:
        try:
            found.append((path, attempt_of(path)))
        except FormatError:
            continue
    return sorted(found, key=lambda item: deletion_order(item[0]))


def is_successor(path: str) -> bool:
    """True for a successor marker COMMITTED-<g>: part of a committed checkpoint, never a leftover of an attempt."""
    return path != layout.COMMITTED and layout.marker_generation(path) is not None


def checkpoint_objects(checkpoint: Storage) -> list[str]:
    """What deleting a whole committed checkpoint removes, in order: COMMITTED, then every layout object."""
    return [layout.COMMITTED, *(path for path, _ in layout_objects(checkpoint))]


def delete_objects(
    root: Storage,
    name: str,
    paths: Sequence[str],
    *,
    directories: Sequence[str] = DIRECTORIES,
    after_each: Callable[[str], None] | None = None,
) -> int:
    """Delete `paths` of checkpoint ROOT/name in SPEC 14 order, then `directories` that are empty; the count deleted.

    Refuses before deleting anything: StorageError when ROOT/name is not a plain directory of the root (a link,
    or data/ or ranks/ a link: what they point at is not the root's to delete), FormatError for a path the layout
    does not give. after_each(path) runs after each deletion (progress, crash points).
    """
    reason = not_owned_reason(root, name)
    if reason is not None:
        raise StorageError(f"refusing to delete from {root.describe(name)}: {reason}")
    for path in paths:
        try:
            attempt_of(path)
        except FormatError as exc:
            raise FormatError(f"refusing to delete {root.describe(name)}/{path}: only layout names are ours") from exc
    checkpoint = root.child(name)
    deleted = 0
    ordered = sorted(paths, key=deletion_order)
    if layout.COMMITTED in paths:
        # A committed checkpoint's claims (a commit's, left by a crash after COMMITTED) go first: after COMMITTED
        # they would make its files look like a commit in progress, which no collector takes (SPEC 14).
        ordered.sort(key=lambda path: not path.startswith("claim-"))
    for path in ordered:
        checkpoint.delete(path)
        deleted += 1
        if after_each is not None:
            after_each(path)
    for directory in directories:
        if directory in DIRECTORIES and not checkpoint.list(directory) and not _is_file(checkpoint, directory):
            checkpoint.delete(directory)
    return deleted


def _is_file(storage: Storage, path: str) -> bool:
    """True when `path` is an object rather than a directory (a user's file named `data` is not ours to delete)."""
    base = local_path(storage)
    if base is not None:
        full = os.path.join(base, *path.split("/")) if path else base
        return os.path.islink(full) or (os.path.lexists(full) and not os.path.isdir(full))
    fs = getattr(storage, "fs", None)
    if fs is not None:
        try:
            return bool(fs.isfile(storage.describe(path).rstrip("/")))
        except Exception as exc:  # fsspec raises what its backend raises
            raise StorageError(f"cannot stat {storage.describe(path)}: {exc}") from exc
    return path != "" and storage.exists(path)  # object stores: a key is an object, directories are not keys
