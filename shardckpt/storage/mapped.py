"""A new local file made at its final size and filled in place: through windows of a shared mapping (a peer's bytes
received straight into it) or by the kernel from another file of the host; the node-local tier's replicas.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
from collections.abc import Iterator

import numpy as np

from shardckpt.errors import IntegrityError, StorageError
from shardckpt.storage.local import LocalStorage, _fsync_dir, _make_dirs, _os_errors
from shardckpt.storage.volatile import VolatileStorage

# The last resort of a kernel copy (a file system without copy_file_range or sendfile between these files): a
# bounded buffer, never one the size of the file.
COPY_BUFFER = 1 << 20


class MappedFile:
    """A new file at `path` of `size` bytes, its blocks allocated at once (a full tmpfs or disk fails here, never as
    a SIGBUS on a later store into the mapping). Created under its final name, as every data file is (a kill
    mid-fill leaves a layout name that the tier's cleanup deletes; the save's COMMITTED is what vouches for it)."""

    def __init__(self, storage: LocalStorage, path: str, size: int) -> None:
        self.size = size
        self._where = storage.describe(path)
        full = storage.full(path)
        self._parent = os.path.dirname(full)
        self._durable = not isinstance(storage, VolatileStorage)  # fsync buys nothing on tmpfs
        _make_dirs(self._parent, self._where)
        with _os_errors("create", self._where):
            self._fd = os.open(full, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            if size:
                with _os_errors("allocate", self._where):
                    os.posix_fallocate(self._fd, 0, size)
        except BaseException:
            os.close(self._fd)
            raise

    @contextlib.contextmanager
    def window(self, start: int, end: int) -> Iterator[np.ndarray]:
        """Bytes [start, end) of the file as a writable array over a shared mapping, unmapped on exit (what is
        stored into it is the file's: no copy is made). Drop every view of it before leaving the block."""
        if not 0 <= start < end <= self.size:
            raise StorageError(f"{self._where}: window {start}:{end} outside its {self.size} bytes")
        low = start - start % mmap.ALLOCATIONGRANULARITY
        with _os_errors("map", self._where):
            mapping = mmap.mmap(self._fd, end - low, offset=low)
        try:
            yield np.frombuffer(mapping, dtype=np.uint8)[start - low :]
        finally:
            # A view still alive elsewhere (a tensor a failed transfer kept) keeps the mapping until it goes.
            with contextlib.suppress(BufferError):
                mapping.close()

    def copy_from(self, source: int) -> None:
        """Fill the whole file from the open file `source` (of at least `size` bytes), in the kernel: no user
        memory holds the bytes. copy_file_range, else sendfile, else a bounded buffer."""
        done = 0
        with _os_errors("copy into", self._where):
            try:
                while done < self.size:
                    moved = os.copy_file_range(source, self._fd, self.size - done, done, done)
                    if moved == 0:
                        break
                    done += moved
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP) or done:
                    raise
                done = self._copy_slowly(source)
        if done != self.size:
            raise IntegrityError(f"{self._where}: its source ended after {done} of {self.size} bytes")

    def _copy_slowly(self, source: int) -> int:
        done = 0
        try:
            os.lseek(self._fd, 0, os.SEEK_SET)
            while done < self.size:
                moved = os.sendfile(self._fd, source, done, self.size - done)
                if moved == 0:
                    return done
                done += moved
            return done
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP) or done:
                raise
        buffer = bytearray(min(COPY_BUFFER, self.size))
        while done < self.size:
            got = os.preadv(source, [memoryview(buffer)[: self.size - done]], done)
            if got == 0:
                break
            os.pwrite(self._fd, memoryview(buffer)[:got], done)
            done += got
        return done

    def close(self) -> None:
        """Done filling: durable (fsync of the file and its directory) where the storage is not volatile."""
        with _os_errors("fsync", self._where):
            try:
                if self._durable:
                    os.fsync(self._fd)
            finally:
                os.close(self._fd)
            if self._durable:
                _fsync_dir(self._parent)

    def abort(self) -> None:
        with contextlib.suppress(OSError):  # the failure that got here is the one to report
            os.close(self._fd)


def open_mapped(storage: LocalStorage, path: str, size: int) -> MappedFile:
    """A MappedFile of `size` bytes at `path` of a local storage (AlreadyExistsError when the path exists)."""
    return MappedFile(storage, path, size)
