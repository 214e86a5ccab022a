"""Copying a committed checkpoint from any storage to any other (local, S3, memory): every file the manifest names,
checked at the destination block by block before COMMITTED, written last, makes the copy a checkpoint.

An incremental checkpoint's parents (the checkpoints holding its pieces stored by reference) come along with
`with_parents`, or must already be committed at the destination's root; tools/materialize.py writes instead a copy
that holds every piece itself.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shardckpt import knobs
from shardckpt.catalog.chain import read_commit_marker, read_opening, verify_global_manifest
from shardckpt.catalog.claims import BY_COMMIT, CREATED, claim, release
from shardckpt.catalog.identity import home
from shardckpt.catalog.stored import StoredCheckpoint
from shardckpt.errors import (
    AlreadyExistsError,
    CommitConflictError,
    IntegrityError,
    NotCommittedError,
    ShardckptUsageError,
)
from shardckpt.format import layout, limits
from shardckpt.format.manifest import CommitMarker, GlobalManifest
from shardckpt.ops.verify import VerifyReport, check_stored
from shardckpt.storage import Storage, open_storage
from shardckpt.storage.local import LocalStorage

COPY_CHUNK = knobs.WRITE_CHUNK  # bytes read from the source and written to the destination at a time


@dataclass
class CopyReport:
    """What a copy did: the checkpoints it committed at the destination (parents first), those already there
    (the same attempt: a parent copied before, or this copy run again), files and bytes written."""

    source: str
    destination: str
    committed: list[str] = field(default_factory=list)
    already_there: list[str] = field(default_factory=list)
    files: int = 0
    bytes: int = 0
    kept_files: int = 0  # files a copy interrupted before found complete-sized, checked like the others


def destination_url(source: str, destination: str) -> str:
    """`destination`, or destination/<source's name> when it ends with '/' (as cp copies into a directory); the
    name is that of the directory `source` names once '.' and '..' are resolved (`copy . /archive/` from inside a
    checkpoint copies to /archive/<its name>)."""
    if not destination.endswith("/"):
        return destination
    _, separator, path = source.rpartition("://")
    if separator:
        name = posixpath.basename(posixpath.normpath("/" + path))
    else:
        name = os.path.basename(os.path.abspath(os.path.expanduser(path)))
    if not name or name in (".", ".."):
        raise ShardckptUsageError(
            f"{source} names no checkpoint directory to copy into {destination}: give DST in full"
        )
    return destination + name


def copy_checkpoint(
    source: str | Storage,
    destination: str | Storage,
    *,
    with_parents: bool = False,
    storage_options: dict[str, Any] | None = None,
    destination_options: dict[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
) -> CopyReport:
    """Copy the committed checkpoint at `source` to `destination` (a new URL), byte for byte.

    The copy is committed only after every file it wrote was read back and checked (sizes, manifest checksums,
    safetensors headers, every block's CRC32C, piece hashes): an interrupted or failed copy has no COMMITTED, and
    running it again keeps the complete files it wrote and writes the rest. with_parents: copy the checkpoints
    whose pieces it references into the destination's root first (each the same way); without it they must be
    committed there already, else ShardckptUsageError naming them. destination_options: the destination's storage
    options (default: `storage_options`). progress(nbytes) as bytes are written.
    """
    src = open_storage(source, storage_options)
    dst = open_storage(destination, storage_options if destination_options is None else destination_options)
    if inside(dst, src):
        raise ShardckptUsageError(f"cannot copy {src.url} into itself ({dst.url}): choose a destination outside it")
    report = CopyReport(src.url, dst.url)
    _copy(src, dst, with_parents, report, progress, set())
    return report


def inside(dst: Storage, src: Storage) -> bool:
    """Whether `dst` lies below `src`, as spelled or (local disk) once links are resolved: a copy there would be
    deleted with its source."""
    if dst.url.rstrip("/").startswith(src.url.rstrip("/") + "/"):
        return True
    if isinstance(src, LocalStorage) and isinstance(dst, LocalStorage):
        return os.path.realpath(dst.root).startswith(os.path.realpath(src.root).rstrip(os.sep) + os.sep)
    return False


def _copy(
    src: Storage,
    dst: Storage,
    with_parents: bool,
    report: CopyReport,
    progress: Callable[[int], None] | None,
    visiting: set[str],
) -> None:
    opening = read_opening(src)  # NotCommittedError for anything but a committed checkpoint
    marker, manifest = opening.marker, opening.manifest
    existing = read_commit_marker(dst)
    if existing is not None:
        # This very checkpoint, copied before: the same attempt and the same manifest bytes (SPEC 9 'Existing
        # marker'); attempt ids are unique only within one checkpoint, so the attempt alone proves nothing.
        if _same_commit(existing, marker):
            report.already_there.append(dst.url)
            return
        raise AlreadyExistsError(
            f"{dst.url} already holds a committed checkpoint (attempt {existing.attempt}, step {existing.step}, "
            f"manifest of {existing.manifest_size} bytes), not a copy of {src.url} (attempt {marker.attempt}, "
            f"manifest of {marker.manifest_size} bytes): a committed checkpoint is never overwritten; copy to a new URL"
        )
    check_destination(dst, marker.manifest)
    _parents(src, dst, marker, with_parents, report, progress, visiting | {src.url})
    # Each file as large as the manifests say, or nothing of it is copied: a source file replaced (by a link to
    # any other file, say) would otherwise reach the destination whole before the checks refuse the copy.
    sizes = {marker.manifest: marker.manifest_size}
    for entry in manifest.files:
        sizes.update({entry.index: entry.index_size, entry.data: entry.data_size})
    for path, size in sizes.items():
        _copy_file(src, dst, path, size, report, progress)
    # Claimed as a save's commit is (SPEC 14): a collector that took this copy, held up past its grace period, for
    # an abandoned save cannot delete its files between the check below and COMMITTED.
    claimed = claim(dst, marker.attempt, BY_COMMIT)
    if not claimed:
        raise CommitConflictError(
            f"{dst.url}: a collector claimed attempt {marker.attempt} as an abandoned save and deletes its files: "
            "nothing was committed; copy again"
        )
    try:
        _check_copy(src, dst, marker, manifest)  # reads back every file: none was collected before the claim
        dst.commit_marker(layout.COMMITTED, opening.marker_raw)  # the last write: from here on it is a checkpoint
    finally:
        if claimed == CREATED:
            release(dst, marker.attempt, BY_COMMIT)
    report.committed.append(dst.url)


def _same_commit(a: CommitMarker, b: CommitMarker) -> bool:
    return (a.attempt, a.manifest_size, a.manifest_crc32c) == (b.attempt, b.manifest_size, b.manifest_crc32c)


def check_destination(dst: Storage, own_manifest: str | None = None) -> None:
    """Refuse a destination that holds anything but an earlier attempt at this same copy (its global manifest,
    named by the attempt, is the first file a copy writes): a root of other checkpoints, another checkpoint."""
    names = dst.list()
    if names and (own_manifest is None or own_manifest not in names):
        shown = ", ".join(sorted(names)[:5]) + (" ..." if len(names) > 5 else "")
        raise ShardckptUsageError(
            f"{dst.url} already exists and holds {shown}: a copy goes to a new URL (end DST with '/' to copy into "
            "that directory under the source's name)"
        )


def _parents(
    src: Storage,
    dst: Storage,
    marker: CommitMarker,
    with_parents: bool,
    report: CopyReport,
    progress: Callable[[int], None] | None,
    visiting: set[str],
) -> None:
    """The checkpoints `marker` references, committed at the destination's root (copied there with_parents)."""
    if not marker.references:
        return
    names = [name for name, _ in marker.references]
    if dst.name in names:
        raise ShardckptUsageError(
            f"cannot copy {src.url} to {dst.url}: it stores pieces by reference in {dst.name!r}, a checkpoint of the "
            "same root under that name; choose another destination name"
        )
    src_root, dst_root = home(src)[0], dst.parent()  # a source given through a link: its parents lie beside it
    absent = []
    for name, attempt in marker.references:
        there = read_commit_marker(dst_root.child(name))
        if there is not None and there.attempt == attempt:
            source_parent = read_commit_marker(src_root.child(name))  # absent: a parent only the destination holds
            if source_parent is None or _same_commit(there, source_parent):
                continue
        if there is not None:
            raise AlreadyExistsError(
                f"{dst_root.child(name).url} holds a committed checkpoint of attempt {there.attempt} (manifest of "
                f"{there.manifest_size} bytes), not the attempt {attempt} of {src_root.child(name).url} that {src.url} "
                "references: copy to another root"
            )
        absent.append((name, attempt))
    if absent and not with_parents:
        listed = ", ".join(name for name, _ in absent)
        raise ShardckptUsageError(
            f"{src.url} is incremental: it stores pieces by reference in {listed} (its parents), which "
            f"{dst_root.url} does not hold; copy them along (--with-parents / with_parents=True) or write a copy "
            "that holds every piece itself (--materialize)"
        )
    for name, attempt in absent:
        parent = src_root.child(name)
        if parent.url in visiting:
            raise IntegrityError(f"{src.url}: references form a cycle through {parent.url}")
        found = read_commit_marker(parent)
        if found is None or found.attempt != attempt:
            what = "missing" if found is None and not parent.list() else "not committed as that attempt"
            raise NotCommittedError(
                f"{src.url} references attempt {attempt} of {parent.url}, which is {what}: the pieces stored there "
                "cannot be copied (a copy made without its parents?)"
            )
        _copy(parent, dst_root.child(name), True, report, progress, visiting)


def _copy_file(
    src: Storage, dst: Storage, path: str, size: int, report: CopyReport, progress: Callable[[int], None] | None
) -> None:
    found = src.size(path)
    if found != size:
        raise IntegrityError(
            f"{src.describe(path)} is {found} bytes, its manifest says {size}: nothing of it copied; check the source "
            f"with `shardckpt verify {src.url}`"
        )
    if dst.exists(path):
        # An earlier copy's file (it stopped before COMMITTED): kept when complete, since every byte of it is
        # checked below before the commit. A shorter one is what an interruption between two chunks leaves: the
        # destination is uncommitted and holds this copy's global manifest, and the file's name carries the
        # source's attempt, so it is this copy's own and is written again. Anything else is never overwritten.
        there = dst.size(path)
        if there == size:
            report.kept_files += 1
            return
        if there > size:
            raise AlreadyExistsError(
                f"{dst.describe(path)} exists with {there} bytes, more than the {size} of {src.describe(path)}: "
                "not an earlier copy's; nothing is ever overwritten: delete the destination and copy again"
            )
        dst.delete(path)
    with dst.open_new(path) as handle:
        for start in range(0, size, COPY_CHUNK):
            chunk = src.read_range(path, start, min(start + COPY_CHUNK, size))
            handle.write(chunk)
            if progress is not None:
                progress(len(chunk))
    report.files += 1
    report.bytes += size


def _check_copy(src: Storage, dst: Storage, marker: CommitMarker, manifest: GlobalManifest) -> None:
    """Read back what the destination holds and check it as verify would, before anything calls it committed."""
    raw = dst.read_small(marker.manifest, limits.MAX_GLOBAL_MANIFEST_BYTES)
    verify_global_manifest(raw, marker, dst.describe(marker.manifest))
    report = VerifyReport(dst.url, committed=True)
    copied = StoredCheckpoint(dst, marker, manifest)
    copied.check_referenced()  # the parents at the destination are the attempts it references
    check_stored(copied, report)
    if report.problems:
        shown = "; ".join(str(problem) for problem in report.problems[:5])
        raise IntegrityError(
            f"the copy of {src.url} at {dst.url} fails its checks, so it was not committed ({len(report.problems)} "
            f"problem(s): {shown}); check the source with `shardckpt verify {src.url}`, delete {dst.url} and copy "
            "again"
        )
