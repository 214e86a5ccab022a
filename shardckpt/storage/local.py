"""Local-disk backend with plain os calls, so durability is explicit: fsync of files and directories.

The commit primitive is a temp file in the same directory, fsynced, then link()ed to its final name, which
fails if the name exists (rename would silently replace it), then a directory fsync.
"""

from __future__ import annotations

import errno
import os
import secrets

from shardckpt.errors import AlreadyExistsError, NotFoundError, StorageError
from shardckpt.storage.base import NewFile, Storage, check_length


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _LocalNewFile(NewFile):
    def __init__(self, storage: LocalStorage, path: str) -> None:
        self._storage, self._path = storage, path
        full = storage.full(path)
        parent = os.path.dirname(full)
        try:
            os.makedirs(parent, exist_ok=True)
            self._fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        except FileExistsError:
            raise AlreadyExistsError(f"{storage.describe(path)} already exists; nothing is ever overwritten") from None
        except OSError as exc:
            raise StorageError(f"cannot create {storage.describe(path)}: {exc}") from exc
        self._parent = parent

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        try:
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
        except OSError as exc:
            raise StorageError(f"cannot write {self._storage.describe(self._path)}: {exc}") from exc

    supports_write_at = True

    def write_at(self, data: bytes | memoryview, offset: int) -> None:
        """Write at a byte offset (pwrite): several threads can fill one new file at once."""
        view = memoryview(data).cast("B")
        try:
            while view:
                written = os.pwrite(self._fd, view, offset)
                view, offset = view[written:], offset + written
        except OSError as exc:
            raise StorageError(f"cannot write {self._storage.describe(self._path)}: {exc}") from exc

    def close(self) -> None:
        try:
            os.fsync(self._fd)
        except OSError as exc:
            raise StorageError(f"cannot fsync {self._storage.describe(self._path)}: {exc}") from exc
        finally:
            os.close(self._fd)
        _fsync_dir(self._parent)

    def abort(self) -> None:
        os.close(self._fd)


class LocalStorage(Storage):
    read_threads = 4

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.url = self.root

    def full(self, path: str) -> str:
        return os.path.join(self.root, *path.split("/")) if path else self.root

    def child(self, name: str) -> LocalStorage:
        return LocalStorage(self.full(name))

    def open_new(self, path: str) -> NewFile:
        return _LocalNewFile(self, path)

    def commit_marker(self, path: str, data: bytes) -> None:
        final = self.full(path)
        temp = f"{final}.tmp-{secrets.token_hex(6)}"
        os.makedirs(os.path.dirname(final), exist_ok=True)
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(temp, final)
        except FileExistsError:
            raise AlreadyExistsError(f"{self.describe(path)} already exists") from None
        except OSError as exc:
            raise StorageError(f"cannot commit {self.describe(path)}: {exc}") from exc
        finally:
            os.unlink(temp)
        _fsync_dir(os.path.dirname(final))

    def read_range(self, path: str, start: int, end: int) -> bytes:
        try:
            fd = os.open(self.full(path), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except (FileNotFoundError, NotADirectoryError):  # a file where a directory should be: nothing there
            raise NotFoundError(f"{self.describe(path)} does not exist") from None
        except OSError as exc:
            raise StorageError(f"cannot open {self.describe(path)}: {exc}") from exc
        try:
            chunks, position = [], start
            while position < end:
                chunk = os.pread(fd, end - position, position)
                if not chunk:
                    break
                chunks.append(chunk)
                position += len(chunk)
        except OSError as exc:
            raise StorageError(f"cannot read {self.describe(path)}: {exc}") from exc
        finally:
            os.close(fd)
        return check_length(self, path, start, end, chunks[0] if len(chunks) == 1 else b"".join(chunks))

    def size(self, path: str) -> int:
        try:
            return os.stat(self.full(path)).st_size
        except (FileNotFoundError, NotADirectoryError):
            raise NotFoundError(f"{self.describe(path)} does not exist") from None
        except OSError as exc:
            raise StorageError(f"cannot stat {self.describe(path)}: {exc}") from exc

    def exists(self, path: str) -> bool:
        return os.path.exists(self.full(path))

    def modified(self, path: str) -> float | None:
        try:
            return os.stat(self.full(path)).st_mtime
        except (FileNotFoundError, NotADirectoryError):
            raise NotFoundError(f"{self.describe(path)} does not exist") from None
        except OSError as exc:
            raise StorageError(f"cannot stat {self.describe(path)}: {exc}") from exc

    def list(self, prefix: str = "") -> list[str]:
        try:
            return sorted(os.listdir(self.full(prefix)))
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            return []

    def delete(self, path: str) -> None:
        full = self.full(path)
        try:
            if os.path.isdir(full):
                os.rmdir(full)
            else:
                os.unlink(full)
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno == errno.ENOTEMPTY:
                raise StorageError(f"cannot delete {self.describe(path)}: directory not empty") from exc
            raise StorageError(f"cannot delete {self.describe(path)}: {exc}") from exc
