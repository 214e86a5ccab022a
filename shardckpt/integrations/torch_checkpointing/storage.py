"""torch_checkpointing's `Storage` seam on shardckpt's storage layer: local disk with fsync of every file and
directory, and object stores (S3 via s3fs) where the commit is one conditional create instead of a copy-then-delete.

torch_checkpointing 0.1.1 writes every rank's files under `tmp_<name>` and rank 0 then renames that directory onto
`<name>` (its commit). Its own local backend fsyncs nothing, and a rename on an object store is a copy of each object
followed by a delete: a crash half way leaves a `<name>` that looks complete. Here:
- local disk: each file is fsynced when closed (with its directory), the rename is one `rename(2)` followed by an
  fsync of the directory above, so a committed checkpoint survives a power loss;
- object stores: the rename first claims `<name>` with a conditional create of `<name>/.shardckpt-pending`, copies
  the objects, checks that the claim (a token of its own) is still its own, and commits with a conditional create
  of `<name>/.shardckpt-committed`. `<name>` does not exist for `exists`, `isdir` and `ls` until that last write: a
  half-done copy is invisible and the next rename redoes it.
Nothing outside a staging directory (a path component starting with the writer's temp prefix) is ever replaced.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import posixpath
import secrets
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from torch_checkpointing.storage.base_storage import ReadArgs, Storage, StorageConfig
from typing_extensions import Buffer

from shardckpt.errors import (
    AlreadyExistsError,
    CommitConflictError,
    FormatError,
    NotFoundError,
    ShardckptUsageError,
)
from shardckpt.storage import open_storage
from shardckpt.storage.base import NewFile
from shardckpt.storage.base import Storage as Backend
from shardckpt.storage.local import LocalStorage

PENDING = ".shardckpt-pending"  # an object-store rename has claimed the destination
COMMITTED = ".shardckpt-committed"  # ... and has copied every object: the destination exists from here on
MARKERS = (PENDING, COMMITTED)
COPY_CHUNK = 64 << 20  # bytes per range read while copying one object (bounded memory for any object size)


@dataclass
class ShardckptStorageConfig(StorageConfig):
    """Where torch_checkpointing's checkpoints live, for `CheckpointManager.Config(storage_config=...)`.

    root: None for local paths (checkpoint ids are paths on this machine), or a URL (`s3://bucket/run`, a local
    directory) under which checkpoint ids are relative paths (`step_100`). storage_options go to fsspec/s3fs as
    everywhere in shardckpt. staging_prefix must equal the writer's `CheckpointWriterConfig.temp_dir_prefix`.
    Picklable: torch_checkpointing's async saver rebuilds the storage from it in its writer process.
    """

    root: str | None = None
    storage_options: dict[str, Any] | None = None
    staging_prefix: str = "tmp_"
    copy_chunk: int = field(default=COPY_CHUNK)

    def create_storage(self) -> ShardckptStorage:
        return ShardckptStorage(self)


class _RangeStream(io.RawIOBase):
    """A seekable read-only stream over one object: every read is one exact range read of the backend."""

    def __init__(self, backend: Backend, key: str) -> None:
        self._backend, self._key = backend, key
        self._size = backend.size(key)
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise OSError(errno.EINVAL, f"seek to {base + offset} in {self._backend.describe(self._key)}")
        self._position = base + offset
        return self._position

    def readinto(self, buffer: Buffer) -> int:
        view = memoryview(buffer).cast("B")
        count = max(0, min(view.nbytes, self._size - self._position))
        if count:
            self._backend.read_range_into(self._key, self._position, view[:count])
            self._position += count
        return count

    def read(self, size: int | None = -1) -> bytes:
        # One range read for the whole request: RawIOBase.read/readall would issue one per 8 KiB.
        end = self._size if size is None or size < 0 else min(self._size, self._position + size)
        if end <= self._position:
            return b""
        data = self._backend.read_range(self._key, self._position, end)
        self._position = end
        return data

    def readall(self) -> bytes:
        return self.read(-1)


class _WriteStream(io.RawIOBase):
    """A write-only stream into one new object; leaving its `with` block through an exception aborts the object
    instead of completing it, so a failed torch.save never leaves a whole-looking file."""

    def __init__(self, handle: NewFile) -> None:
        self._handle = handle
        self._done = False

    def writable(self) -> bool:
        return True

    def write(self, data: Buffer) -> int:
        view = memoryview(data).cast("B")
        self._handle.write(view)
        return view.nbytes

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._handle.close()
        super().close()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None and not self._done:
            self._done = True
            self._handle.abort()
        self.close()


class ShardckptStorage(Storage):
    """torch_checkpointing's Storage over one shardckpt backend (see the module docstring for the guarantees)."""

    def __init__(self, config: ShardckptStorageConfig) -> None:
        self._config = config
        self._backend: Backend = open_storage(config.root or os.sep, config.storage_options)
        self._local = isinstance(self._backend, LocalStorage)

    # -- paths ---------------------------------------------------------------------------------------------------
    def key(self, path: Path | str) -> str:
        """The backend key of a checkpoint path: relative to the configured root, '/'-separated, no '..'."""
        text = os.fspath(path)
        if self._config.root is None:
            text = os.path.abspath(text)
        parts = [part for part in PurePosixPath(text.replace(os.sep, "/")).parts if part not in ("/", ".")]
        if ".." in parts:
            raise ShardckptUsageError(f"checkpoint path {text!r} leaves the storage root {self._backend.url}")
        return "/".join(parts)

    def remap_path(self, path: Path) -> str:
        return self._backend.describe(self.key(path))

    def backend_at(self, path: Path | str) -> Backend:
        """The shardckpt backend rooted at `path` (same client and options): what shardckpt.open reads."""
        key = self.key(path)
        return self._backend.child(key) if key else self._backend

    def _full(self, key: str) -> str:
        assert isinstance(self._backend, LocalStorage)
        return self._backend.full(key)

    def _in_staging(self, key: str) -> bool:
        return any(part.startswith(self._config.staging_prefix) for part in key.split("/"))

    # -- reads ---------------------------------------------------------------------------------------------------
    def stream_read(self, path: Path, read_args: ReadArgs | None = None) -> io.RawIOBase:
        return _RangeStream(self._backend, self.key(path))

    def read(self, path: Path, read_args: ReadArgs | None = None) -> bytes:
        key = self.key(path)
        return self._backend.read_range(key, 0, self._backend.size(key))

    def getsize(self, path: Path) -> int:
        return self._backend.size(self.key(path))

    def exists(self, path: Path) -> bool:
        key = self.key(path)
        if self._local:
            return os.path.lexists(self._full(key))
        return self._is_object(key) or self._visible_directory(key)

    def isdir(self, path: Path) -> bool:
        key = self.key(path)
        if self._local:
            return os.path.isdir(self._full(key))
        return self._visible_directory(key)

    def ls(self, path: Path) -> list[str]:
        key = self.key(path)
        if self._local:
            return [name for name in os.listdir(self._full(key)) if name not in MARKERS]
        if not self._visible_directory(key):
            raise NotFoundError(f"{self._backend.describe(key)} does not exist")
        return [name for name in self._backend.list(key) if name not in MARKERS]

    def _visible_directory(self, key: str) -> bool:
        """An object-store prefix with objects under it, unless a rename claimed it and has not committed."""
        names = self._backend.list(key)
        if not names:
            return False
        return PENDING not in names or COMMITTED in names

    # -- writes --------------------------------------------------------------------------------------------------
    def _new(self, key: str) -> NewFile:
        try:
            return self._backend.open_new(key)
        except AlreadyExistsError:
            if not self._in_staging(key):
                raise AlreadyExistsError(
                    f"{self._backend.describe(key)} exists: shardckpt never replaces a file outside a staging "
                    f"directory ({self._config.staging_prefix}*); save under a new checkpoint id"
                ) from None
        # A leftover of a failed attempt at this staging directory: the checkpoint it belongs to is not committed.
        self._backend.delete(key)
        return self._backend.open_new(key)

    def stream_write(self, path: Path) -> io.IOBase:
        return _WriteStream(self._new(self.key(path)))

    def write(self, path: Path, data: Buffer) -> None:
        with self._new(self.key(path)) as handle:
            handle.write(memoryview(data).cast("B"))

    def mkdir(self, path: Path, recursive: bool = True) -> None:
        if self._local:
            os.makedirs(self._full(self.key(path)), exist_ok=True)

    def delete(self, path: Path) -> None:
        key = self.key(path)
        if not (os.path.lexists(self._full(key)) if self._local else self._is_object(key)):
            raise NotFoundError(f"{self._backend.describe(key)} does not exist")
        self._backend.delete(key)

    def rmdir(self, path: Path) -> None:
        key = self.key(path)
        if self._local:
            shutil.rmtree(self._full(key))
            return
        # The commit marker goes first, so a directory half deleted is no longer a committed one.
        for name in sorted(self._walk(key), key=lambda name: posixpath.basename(name) != COMMITTED):
            self._backend.delete(name)

    def rename(
        self, src_path: Path, dst_path: Path, is_directory: bool = False, background_cleanup: bool = False
    ) -> None:
        src, dst = self.key(src_path), self.key(dst_path)
        if self._local:
            self._rename_local(src, dst)
        elif self._is_object(src):
            self._rename_object(src, dst)
        else:
            self._rename_prefix(src, dst)

    def _rename_local(self, src: str, dst: str) -> None:
        source, target = self._full(src), self._full(dst)
        if os.path.isfile(target) and not self._in_staging(dst):
            raise AlreadyExistsError(f"{target} exists: shardckpt never replaces a file outside a staging directory")
        try:
            (os.replace if os.path.isfile(source) else os.rename)(source, target)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise AlreadyExistsError(f"cannot commit {source} onto {target}: the destination is occupied") from exc
            raise
        # The new name is durable only once the directory holding it is.
        for directory in {os.path.dirname(target), os.path.dirname(source)}:
            fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _is_object(self, key: str) -> bool:
        """An object itself, not a prefix (an object store's `exists` says yes to both; memory:// gives a directory
        a size, 0): something with a size and nothing under it."""
        try:
            self._backend.size(key)
        except NotFoundError:
            return False
        return not self._backend.list(key)

    def _rename_object(self, src: str, dst: str) -> None:
        if self._is_object(dst):
            if not self._in_staging(dst):
                raise AlreadyExistsError(f"{self._backend.describe(dst)} exists: shardckpt never replaces it")
            self._backend.delete(dst)
        self._copy(src, dst)
        self._backend.delete(src)

    def _rename_prefix(self, src: str, dst: str) -> None:
        names = self._backend.list(dst)
        if names and not self._visible_directory(dst):
            # A rename that claimed `dst` and died before committing: its copies were never visible; start over.
            for name in self._walk(dst):
                self._backend.delete(name)
        elif names:
            raise AlreadyExistsError(f"cannot commit onto {self._backend.describe(dst)}: it holds a checkpoint")
        # Two racing commits: one of them fails here. The claim carries a token of this rename: another save of
        # the same id that takes the claim over (it cannot tell a live copy from a dead one) clears what was
        # copied, and this rename must then not commit the mix that is left.
        claim = secrets.token_hex(16).encode()
        self._backend.commit_marker(f"{dst}/{PENDING}", claim)
        for name in self._walk(src):
            self._copy(name, dst + name[len(src) :])
        try:
            held = self._backend.read_small(f"{dst}/{PENDING}", len(claim)) == claim
        except (NotFoundError, FormatError):  # gone, or another claim's larger token
            held = False
        if not held:
            raise CommitConflictError(
                f"cannot commit {self._backend.describe(src)} onto {self._backend.describe(dst)}: another save of "
                "that checkpoint id took over the destination while this one copied; not committed"
            )
        self._backend.commit_marker(f"{dst}/{COMMITTED}", b"")  # the commit: the last write
        for name in self._walk(src):
            with contextlib.suppress(NotFoundError):
                self._backend.delete(name)

    def _walk(self, prefix: str) -> Iterator[str]:
        """Every object key under `prefix`, depth first."""
        for name in self._backend.list(prefix):
            key = f"{prefix}/{name}" if prefix else name
            below = self._backend.list(key)
            if below:
                yield from self._walk(key)
            else:
                yield key

    def _copy(self, src: str, dst: str) -> None:
        size = self._backend.size(src)
        with self._backend.open_new(dst) as handle:
            for start in range(0, size, self._config.copy_chunk):
                handle.write(self._backend.read_range(src, start, min(size, start + self._config.copy_chunk)))
