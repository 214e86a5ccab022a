"""Disk usage of the checkpoints under a root: bytes of each committed attempt, and leftovers of failed ones.

Leftovers are the files of attempts other than the committed one, or every file of an uncommitted checkpoint.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardckpt import knobs
from shardckpt.catalog.chain import read_commit_marker, read_opening, require_exists
from shardckpt.catalog.deletion import is_temp_marker
from shardckpt.catalog.listing import ALIAS, classify, list_root, local_path
from shardckpt.errors import FormatError, NotFoundError, ShardckptError
from shardckpt.format import layout
from shardckpt.format.compressed import FIRST_VERSION as COMPRESSED_VERSION
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
    compressed_bytes: int = 0  # format 1.2: bytes compression saved (logical - stored sizes of its data files)
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
    seen: set[tuple[int, int]] = set()  # local files counted so far, by device and inode: hard links count once
    if classify(storage.list(), committed=False, broken=False) is not None:
        report.checkpoints.append(checkpoint_usage(storage, storage.url.rstrip("/").rsplit("/", 1)[-1], seen))
        return report
    listing = list_root(storage)
    for entry in listing.entries:
        if entry.status(listing.root) not in (None, ALIAS):
            report.checkpoints.append(checkpoint_usage(storage.child(entry.name), entry.name, seen))
    return report


def checkpoint_usage(storage: Storage, name: str, seen: set[tuple[int, int]] | None = None) -> CheckpointUsage:
    """Sizes of one checkpoint's files, split by the attempt COMMITTED names.

    A link inside the checkpoint is never followed (it counts 0 bytes: what it names is counted where it lives, if
    in the walk), a file with several hard links counts once (in `seen`, shared by a report's checkpoints), and
    the walk stops at MAX_DEPTH levels and knobs.DU_MAX_ENTRIES entries (then `error` says what was left out).
    """
    usage = CheckpointUsage(name, storage.url, INCOMPLETE)
    try:
        marker = read_commit_marker(storage)
    except ShardckptError as exc:
        usage.status, usage.error, marker = BROKEN, str(exc), None
    if marker is not None:
        usage.status, usage.step, usage.attempt = COMMITTED, marker.step, marker.attempt
    walk = _Walk(storage, seen if seen is not None else set())
    walk.files("", 0)
    walk.count_once()
    paths, sizes = list(walk.sizes), list(walk.sizes.values())
    unknown = [i for i, size in enumerate(sizes) if size is None]
    with ThreadPoolExecutor(max_workers=max(1, min(storage.read_threads, len(unknown)))) as pool:
        for i, asked in zip(unknown, pool.map(lambda i: _size(storage, paths[i]), unknown)):
            sizes[i] = asked
    if walk.cut:
        usage.error = walk.cut
    for path, known in zip(paths, sizes):
        size = known or 0
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
    # 1.1 references and 1.2 compressed files (SPEC 4.1) make the logical size differ: only then is the manifest read.
    if marker is not None and (marker.references or marker.version >= COMPRESSED_VERSION):
        usage.references = [name for name, _ in marker.references]
        try:
            manifest = read_opening(storage).manifest
            usage.referenced_bytes = referenced_bytes(manifest) if marker.references else 0
            usage.compressed_bytes = sum(f.extent - f.data_size for f in manifest.files)
        except ShardckptError as exc:
            usage.error = str(exc)
        usage.logical_bytes += usage.referenced_bytes + usage.compressed_bytes
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


class _Walk:
    """The files of one checkpoint, each with its size when the walk learnt it (a local lstat) or None (ask)."""

    def __init__(self, storage: Storage, seen: set[tuple[int, int]]) -> None:
        self.storage, self.base, self.seen = storage, local_path(storage), seen
        self.sizes: dict[str, int | None] = {}
        self.real: dict[str, tuple[int, int]] = {}  # local files: device and inode
        self.entries, self.cut = 0, ""

    def files(self, prefix: str, depth: int) -> None:
        if self.base is not None:
            self._local(prefix, depth)
            return
        # Object stores and memory have no links: a name that lists entries is a directory, any other a file.
        for name in self._take(self.storage.list(prefix), prefix):
            path = f"{prefix}/{name}" if prefix else name
            # Layout files (markers, an attempt's files) need no listing.
            known = layout.marker_generation(path) is not None or _attempt_of(path) is not None
            inside = self.storage.list(path) if depth < MAX_DEPTH and not known else []
            if inside:
                self.files(path, depth + 1)
            else:
                self.sizes[path] = None

    def _local(self, prefix: str, depth: int) -> None:
        """A local directory, by lstat: links are entries of their own, never walked through (a link to `.` made
        12^8 directories of a dozen links, a link to / the whole disk)."""
        assert self.base is not None
        directory = os.path.join(self.base, *prefix.split("/")) if prefix else self.base
        try:
            with os.scandir(directory) as listing:
                found = sorted(listing, key=lambda entry: entry.name)
        except OSError:
            return  # gone or unreadable while we looked: nothing to count
        for entry in self._take(found, prefix):
            path = f"{prefix}/{entry.name}" if prefix else entry.name
            try:
                stat = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if entry.is_dir(follow_symlinks=False):
                if depth < MAX_DEPTH:
                    self._local(path, depth + 1)
                else:
                    self.cut = self.cut or f"directories below {prefix!r} are deeper than {MAX_DEPTH}: not counted"
                continue
            self.sizes[path] = 0 if entry.is_symlink() else stat.st_size
            if not entry.is_symlink():
                self.real[path] = (stat.st_dev, stat.st_ino)

    def count_once(self) -> None:
        """A file reached by several hard links counts once: under a layout name when it has one."""
        layout_first = sorted(
            self.real, key=lambda path: (_attempt_of(path) is None and layout.marker_generation(path) is None, path)
        )
        for path in layout_first:
            if self.real[path] in self.seen:
                self.sizes[path] = 0
            self.seen.add(self.real[path])

    def _take(self, names: list[Any], prefix: str) -> list[Any]:
        """`names`, or as many as the entry bound leaves (the rest are named in `cut`)."""
        room = knobs.DU_MAX_ENTRIES - self.entries
        if len(names) > room:
            self.cut = self.cut or (
                f"over {knobs.DU_MAX_ENTRIES:,} entries (SHARDCKPT_DU_MAX_ENTRIES): stopped in {prefix or '.'!r}, "
                "the rest not counted"
            )
            names = names[: max(room, 0)]
        self.entries += len(names)
        return names


def _size(storage: Storage, path: str) -> int:
    try:
        return storage.size(path)
    except NotFoundError:
        return 0  # deleted while we looked (a concurrent gc)
