"""Local-disk backend with plain os calls, so durability is explicit: fsync of files and directories.

The commit primitive is a temp file in the same directory, fsynced, then link()ed to its final name, which
fails if the name exists (rename would silently replace it), then a directory fsync.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from shardckpt import knobs
from shardckpt.errors import AlreadyExistsError, NotFoundError, ShardckptError, StorageError, TruncatedError
from shardckpt.storage.base import NewFile, RangeReader, Storage, check_length

_SYNC_FILE_RANGE_WRITE = 2


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's sync_file_range (Linux; Python does not wrap it), or None where it does not exist."""
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_sync_file_range = _load_sync_file_range()


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing these dirty pages to disk now, without waiting for them.

    Write-behind: the disk works while the next chunk is copied and checksummed, and dirty pages never pile up
    into the writeback throttling a large buffered write otherwise meets, so fsync at the end finds little left
    (one stream into one file measured 1.4 -> 2.0 GiB/s here). Only a hint: errors surface in the final fsync.
    """
    # Smaller writes are left to the kernel's own writeback. Read here, not at import: a read-only command opens
    # local storage too, and must not fail over a malformed write knob.
    if _sync_file_range is not None and length >= knobs.WRITE_BEHIND_MIN:
        _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


@contextlib.contextmanager
def _os_errors(verb: str, where: str) -> Iterator[None]:
    """The one place an OS error on local disk becomes shardckpt's: a missing file (or a file where a directory
    should be) NotFoundError, an existing one AlreadyExistsError, anything else StorageError; each names `where`."""
    try:
        yield
    except ShardckptError:
        raise
    except (FileNotFoundError, NotADirectoryError):
        raise NotFoundError(f"{where} does not exist") from None
    except FileExistsError:
        raise AlreadyExistsError(f"{where} already exists; nothing is ever overwritten") from None
    except OSError as exc:
        raise StorageError(f"cannot {verb} {where}: {exc}") from exc


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _make_dirs(path: str, where: str) -> None:
    """os.makedirs, then fsync the parent of every directory it created, so their entries survive a crash.

    (A file fsync makes its own directory's entry durable, not the entries of the directories above it.)
    A file in the way is a StorageError: nothing of ours "already exists" there.
    """
    missing: list[str] = []
    head = path
    while not os.path.isdir(head) and os.path.dirname(head) != head:
        missing.append(head)
        head = os.path.dirname(head)
    if not missing:
        return
    try:
        os.makedirs(path, exist_ok=True)
        for created in reversed(missing):
            _fsync_dir(os.path.dirname(created))
    except OSError as exc:
        raise StorageError(f"cannot create the directory of {where}: {exc}") from exc


def _close_read(fd: int) -> None:
    # Closing a descriptor that was only read from cannot lose data: its error is no reason to fail the read.
    with contextlib.suppress(OSError):
        os.close(fd)


class _LocalNewFile(NewFile):
    def __init__(self, storage: LocalStorage, path: str) -> None:
        self._storage, self._path = storage, path
        self._where = storage.describe(path)
        full = storage.full(path)
        self._parent = os.path.dirname(full)
        _make_dirs(self._parent, self._where)
        with _os_errors("create", self._where):
            self._fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        self._position = 0

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        began = self._position
        with _os_errors("write", self._where):
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
                self._position += written
        _start_writeback(self._fd, began, self._position - began)

    supports_write_at = True

    def write_at(self, data: bytes | memoryview, offset: int) -> None:
        """Write at a byte offset (pwrite): several threads can fill one new file at once."""
        view = memoryview(data).cast("B")
        began = offset
        with _os_errors("write", self._where):
            while view:
                written = os.pwrite(self._fd, view, offset)
                view, offset = view[written:], offset + written
        _start_writeback(self._fd, began, offset - began)

    def close(self) -> None:
        with _os_errors("fsync", self._where):
            try:
                os.fsync(self._fd)
            finally:
                os.close(self._fd)
            _fsync_dir(self._parent)

    def abort(self) -> None:
        with contextlib.suppress(OSError):  # the write failed already; that error is the one to report
            os.close(self._fd)


class _LocalReader(RangeReader):
    """Keeps one descriptor per file open until closed: consecutive reads then share the kernel's read-ahead
    state, which follows them from one request into the next (a fresh descriptor per read starts it over)."""

    def __init__(self, storage: LocalStorage) -> None:
        super().__init__(storage)
        self.local = storage
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def _fd(self, path: str) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = self.local._open_read(path)
            return fd

    def read_into(self, path: str, start: int, out: memoryview) -> None:
        self.local.pread_into(self._fd(path), path, start, out)

    def prefetch(self, path: str, start: int, length: int) -> None:
        """posix_fadvise(WILLNEED): the kernel starts reading the range now, while the current request is read.
        Only for a jump: the kernel's own read-ahead already follows a sequential reader (and a hint there
        competes with it)."""
        if hasattr(os, "posix_fadvise"):
            with contextlib.suppress(OSError):  # a hint; the read itself reports any error
                os.posix_fadvise(self._fd(path), start, length, os.POSIX_FADV_WILLNEED)

    def close(self) -> None:
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            _close_read(fd)


class LocalStorage(Storage):
    read_threads = 4
    ordered_reads = True

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.url = self.root

    def full(self, path: str) -> str:
        return os.path.join(self.root, *path.split("/")) if path else self.root

    def child(self, name: str) -> LocalStorage:
        return LocalStorage(self.full(name))

    def parent(self) -> LocalStorage:
        above = os.path.dirname(self.root)
        if above == self.root:
            raise StorageError(f"{self.root} is the file system's root: there is no directory above it")
        return LocalStorage(above)

    def open_new(self, path: str) -> NewFile:
        return _LocalNewFile(self, path)

    def commit_marker(self, path: str, data: bytes) -> None:
        where = self.describe(path)
        final = self.full(path)
        directory = os.path.dirname(final)
        temp = f"{final}.tmp-{secrets.token_hex(6)}"
        _make_dirs(directory, where)
        with _os_errors("commit", where):
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
            try:
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view) :]
                    os.fsync(fd)
                finally:
                    os.close(fd)
                # The checkpoint's own entry in the directory above it, durable before the checkpoint exists.
                _fsync_dir(os.path.dirname(directory))
                os.link(temp, final)  # EEXIST when COMMITTED exists: AlreadyExistsError
            finally:
                # A temp name that cannot be removed is garbage outside the layout, never a reason to fail a commit
                # that link() already made (or to hide why link() failed).
                with contextlib.suppress(OSError):
                    os.unlink(temp)
            _fsync_dir(directory)

    def _open_read(self, path: str) -> int:
        with _os_errors("open", self.describe(path)):  # a file where a directory should be: nothing there
            return os.open(self.full(path), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))

    def read_range_into(self, path: str, start: int, out: memoryview) -> None:
        """preadv straight into `out` (no bytes object, no second copy), looping on short reads until EOF."""
        fd = self._open_read(path)
        try:
            self.pread_into(fd, path, start, out)
        finally:
            _close_read(fd)

    def pread_into(self, fd: int, path: str, start: int, out: memoryview) -> None:
        """Exactly len(out) bytes of open file `fd` (which is `path`) from `start` into `out`."""
        view = memoryview(out).cast("B")
        done = 0
        with _os_errors("read", self.describe(path)):
            while done < view.nbytes:
                count = os.preadv(fd, [view[done:]], start + done)
                if count == 0:
                    break
                done += count
        if done != view.nbytes:
            raise TruncatedError(
                f"short read of {self.describe(path)}: asked for bytes {start}:{start + view.nbytes}, got {done} "
                "bytes (file truncated?)"
            )

    def reader(self) -> RangeReader:
        return _LocalReader(self)

    def resident(self, places: Sequence[tuple[str, int]]) -> bool | None:
        """preadv(RWF_NOWAIT) of one byte at each place: it fails with EAGAIN where the page is not cached.

        (A miss also starts the kernel's read-ahead there, for bytes about to be read anyway.)
        """
        flag = getattr(os, "RWF_NOWAIT", None)
        if flag is None or not places:
            return None
        probe = bytearray(1)
        fds: dict[str, int] = {}
        try:
            for path, offset in places:
                if path not in fds:
                    fds[path] = self._open_read(path)
                if os.preadv(fds[path], [probe], offset, flag) != 1:
                    return False
        except BlockingIOError:
            return False
        except OSError:  # not supported here, or the file is gone: the read itself will say so
            return None
        finally:
            for fd in fds.values():
                _close_read(fd)
        return True

    def read_ranges_into(self, requests: Sequence[tuple[str, int]], outs: Sequence[memoryview]) -> None:
        """Concurrent preadv calls (the kernel copy and the wait on the disk release the GIL)."""
        jobs = list(zip(requests, outs, strict=True))
        if len(jobs) <= 1:
            for (path, start), out in jobs:
                self.read_range_into(path, start, out)
            return
        with ThreadPoolExecutor(max_workers=min(self.read_threads, len(jobs))) as pool:
            list(pool.map(lambda job: self.read_range_into(job[0][0], job[0][1], job[1]), jobs))

    def read_range(self, path: str, start: int, end: int) -> bytes:
        fd = self._open_read(path)
        try:
            chunks, position = [], start
            with _os_errors("read", self.describe(path)):
                while position < end:
                    chunk = os.pread(fd, end - position, position)
                    if not chunk:
                        break
                    chunks.append(chunk)
                    position += len(chunk)
        finally:
            _close_read(fd)
        return check_length(self, path, start, end, chunks[0] if len(chunks) == 1 else b"".join(chunks))

    def size(self, path: str) -> int:
        with _os_errors("stat", self.describe(path)):
            return os.stat(self.full(path)).st_size

    def exists(self, path: str) -> bool:
        try:
            with _os_errors("stat", self.describe(path)):  # os.path.exists would say False for any error
                os.stat(self.full(path))
        except NotFoundError:
            return False
        return True

    def modified(self, path: str) -> float | None:
        with _os_errors("stat", self.describe(path)):
            return os.stat(self.full(path)).st_mtime

    def list(self, prefix: str = "") -> list[str]:
        try:
            with _os_errors("list", self.describe(prefix)):
                return sorted(os.listdir(self.full(prefix)))
        except NotFoundError:
            return []

    def delete(self, path: str) -> None:
        full = self.full(path)
        try:
            with _os_errors("delete", self.describe(path)):
                try:
                    if os.path.isdir(full):
                        os.rmdir(full)
                    else:
                        os.unlink(full)
                except OSError as exc:
                    if exc.errno == errno.ENOTEMPTY:
                        raise StorageError(f"cannot delete {self.describe(path)}: directory not empty") from exc
                    raise
        except NotFoundError:
            return
