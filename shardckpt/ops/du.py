"""Disk usage of the checkpoints under a root: bytes of each committed attempt, and leftovers of failed ones.

Leftovers are the files of attempts other than the committed one, or every file of an uncommitted checkpoint.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardckpt.catalog.chain import read_commit_marker, read_opening, require_exists
from shardckpt.catalog.deletion import is_temp_marker
from shardckpt.catalog.listing import ALIAS, classify, list_root
from shardckpt.errors import FormatError, NotFoundError, ShardckptError
from shardckpt.format import layout
from shardckpt.format.dtypes import itemsize
from shardckpt.format.manifest import GlobalManifest
from shardckpt.storage import Storage, open_storage

MAX_DEPTH = 8  # how deep foreign directories inside a checkpoint are walked
COMMITTED, INCOMPLETE, BROKEN = "committed", "incomplete", "broken"


@dataclass
class CheckpointUsage:
    name: str
    url: str
    status: str  # committed, incomplete (no COMMITTED), broken (COMMITTED unreadable)
    step: int | None = None
    attempt: str | None = None
    committed_bytes: int = 0  # files of the committed attempt, COMMITTED included
    data_bytes: int = 0  # the committed attempt's data files alone: what ls (COMMITTED's total_bytes) shows
    leftover_bytes: int = 0  # files of other attempts (all layout files when nothing committed)
    leftover_files: int = 0
    other_bytes: int = 0  # files the layout does not name (and, when broken, everything)
    # Format 1.1: bytes of pieces stored by reference in other checkpoints' data files (counted there, once), and
    # the logical size, data_bytes + referenced_bytes: what the checkpoint would hold stored whole. data_bytes is
    # then its unique bytes: the root's totals count every physical file once.
    referenced_bytes: int = 0
    logical_bytes: int = 0
    references: list[str] = field(default_factory=list)  # the checkpoints it references
    error: str | None = None

    @property
    def total_bytes(self) -> int:
        return self.committed_bytes + self.leftover_bytes + self.other_bytes


@dataclass
class UsageReport:
    root: str
    checkpoints: list[CheckpointUsage] = field(default_factory=list)

    def total(self, field_name: str) -> int:
        return sum(getattr(c, field_name) for c in self.checkpoints)


def disk_usage(root: str | Storage, *, storage_options: dict[str, Any] | None = None) -> UsageReport:
    """Usage of every checkpoint directly under `root` (or of `root` itself when it is a checkpoint); a link to a
    checkpoint of the same root is that checkpoint, counted once (catalog.list_root decides, as for ls and gc)."""
    storage = open_storage(root, storage_options)
    require_exists(storage)
    report = UsageReport(storage.url)
    if classify(storage.list(), committed=False, broken=False) is not None:
        report.checkpoints.append(checkpoint_usage(storage, storage.url.rstrip("/").rsplit("/", 1)[-1]))
        return report
    listing = list_root(storage)
    for entry in listing.entries:
        if entry.status(listing.root) not in (None, ALIAS):
            report.checkpoints.append(checkpoint_usage(storage.child(entry.name), entry.name))
    return report


def checkpoint_usage(storage: Storage, name: str) -> CheckpointUsage:
    """Sizes of one checkpoint's files, split by the attempt COMMITTED names."""
    usage = CheckpointUsage(name, storage.url, INCOMPLETE)
    try:
        marker = read_commit_marker(storage)
    except ShardckptError as exc:
        usage.status, usage.error, marker = BROKEN, str(exc), None
    if marker is not None:
        usage.status, usage.step, usage.attempt = COMMITTED, marker.step, marker.attempt
    paths = _files(storage, "", 0)
    with ThreadPoolExecutor(max_workers=max(1, min(storage.read_threads, len(paths)))) as pool:
        sizes = list(pool.map(lambda path: _size(storage, path), paths))
    for path, size in zip(paths, sizes):
        kind = "other" if usage.status == BROKEN else _classify(path, usage.attempt)
        if kind == "committed":
            usage.committed_bytes += size
            if path.startswith(f"{layout.DATA_DIR}/"):
                usage.data_bytes += size
        elif kind == "leftover":
            usage.leftover_bytes += size
            usage.leftover_files += 1
        else:
            usage.other_bytes += size
    usage.logical_bytes = usage.data_bytes
    if marker is not None and marker.references:
        usage.references = [name for name, _ in marker.references]
        try:
            usage.referenced_bytes = referenced_bytes(read_opening(storage).manifest)
        except ShardckptError as exc:
            usage.error = str(exc)
        usage.logical_bytes += usage.referenced_bytes
    return usage


def referenced_bytes(manifest: GlobalManifest) -> int:
    """Bytes of the pieces a checkpoint stores by reference (piece-table file index past its own files)."""
    own, total = len(manifest.files), 0
    for entry in manifest.tensors:
        file, _, _, length = entry.pieces.arrays()
        if file.size and int(file.max()) >= own:
            sizes = np.prod(length[file >= own], axis=1, dtype=np.int64)
            total += int(sizes.sum()) * itemsize(entry.dtype)
    return total


def _classify(path: str, committed: str | None) -> str:
    """committed, leftover (another attempt's file, or any layout file when nothing is committed) or other."""
    if layout.marker_generation(path) is not None:  # COMMITTED, or a successor (SPEC 14.2)
        return "committed" if committed else "other"
    if is_temp_marker(path):
        return "leftover"  # a commit marker's temporary file, left by a commit that died
    attempt = _attempt_of(path)
    if attempt is None:
        return "other"
    return "committed" if attempt == committed else "leftover"


def _attempt_of(path: str) -> str | None:
    for parse in (layout.parse_data_path, layout.parse_local_manifest_path):
        try:
            return parse(path)[1]
        except FormatError:
            pass
    try:
        return layout.parse_global_manifest_path(path)
    except FormatError:
        return None


def _files(storage: Storage, prefix: str, depth: int) -> list[str]:
    """Paths of the files under `prefix`: a name that lists entries is a directory, any other a file."""
    paths = []
    for name in storage.list(prefix):
        path = f"{prefix}/{name}" if prefix else name
        known = (
            layout.marker_generation(path) is not None or _attempt_of(path) is not None
        )  # layout files: no listing needed
        inside = storage.list(path) if depth < MAX_DEPTH and not known else []
        if inside:
            paths.extend(_files(storage, path, depth + 1))
        else:
            paths.append(path)
    return paths


def _size(storage: Storage, path: str) -> int:
    try:
        return storage.size(path)
    except NotFoundError:
        return 0  # deleted while we looked (a concurrent gc)
