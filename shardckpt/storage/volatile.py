"""Local storage on a volatile medium (tmpfs, ramfs: the node-local tier): the same files and the same atomic
link() commit as LocalStorage, without the fsyncs, which buy nothing where a power loss loses the medium anyway.
"""

from __future__ import annotations

import contextlib
import os
import secrets

from shardckpt.storage.base import NewFile
from shardckpt.storage.local import LocalStorage, _LocalNewFile, _make_dirs, _os_errors

VOLATILE_TYPES = frozenset({"tmpfs", "ramfs"})


class _VolatileNewFile(_LocalNewFile):
    def close(self) -> None:
        with _os_errors("close", self._where):
            os.close(self._fd)


class VolatileStorage(LocalStorage):
    """LocalStorage minus fsync: a new file, then link() to its final name (which fails if the name exists)."""

    def child(self, name: str) -> VolatileStorage:
        return VolatileStorage(self.full(name))

    def parent(self) -> VolatileStorage:
        return VolatileStorage(super().parent().root)

    def open_new(self, path: str) -> NewFile:
        return _VolatileNewFile(self, path)

    def commit_marker(self, path: str, data: bytes) -> None:
        where, final = self.describe(path), self.full(path)
        temp = f"{final}.tmp-{secrets.token_hex(6)}"
        _make_dirs(os.path.dirname(final), where)
        with _os_errors("commit", where):
            try:
                with open(temp, "xb") as handle:
                    handle.write(data)
                os.link(temp, final)  # EEXIST when the marker exists: AlreadyExistsError
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(temp)


def file_system_type(path: str) -> str | None:
    """The type of the file system that holds `path` (Linux /proc/mounts: the longest mount point above it)."""
    target = os.path.realpath(path)
    best, kind = "", None
    try:
        with open("/proc/mounts", encoding="utf-8") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                inside = target == point or target.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        return None
    return kind


def open_local_tier(path: str, durable: bool | None = None) -> LocalStorage:
    """The storage of a node-local tier at `path`: without fsync when `durable` is False, or when None and `path`
    lies on tmpfs or ramfs; with fsync (plain LocalStorage: NVMe, a local disk) otherwise."""
    if durable is None:
        durable = file_system_type(path) not in VOLATILE_TYPES
    return LocalStorage(path) if durable else VolatileStorage(path)
