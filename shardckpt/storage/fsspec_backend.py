"""Backend over any fsspec filesystem (memory, gcs, ...), using its create-only open mode 'xb'.

Most filesystems implement 'xb' as check-then-create (not atomic), so COMMITTED goes through the single-
coordinator protocol with a warning, unless the caller declares the filesystem's create-if-absent atomic.
"""

from __future__ import annotations

import posixpath
import warnings
from typing import Any

from shardckpt.errors import AlreadyExistsError, NotFoundError, StorageError, TruncatedError
from shardckpt.storage.base import NewFile, SingleCoordinatorCommitWarning, Storage, check_length, modified_time


class _FsspecNewFile(NewFile):
    def __init__(self, storage: FsspecStorage, path: str) -> None:
        self._storage, self._path = storage, path
        try:
            self._handle = storage.fs.open(storage.full(path), "xb")
        except FileExistsError:
            raise AlreadyExistsError(f"{storage.describe(path)} already exists; nothing is ever overwritten") from None
        except Exception as exc:
            raise StorageError(f"cannot create {storage.describe(path)}: {exc}") from exc

    def write(self, data: bytes | memoryview) -> None:
        try:
            self._handle.write(data)
        except Exception as exc:
            raise StorageError(f"cannot write {self._storage.describe(self._path)}: {exc}") from exc

    def close(self) -> None:
        try:
            self._handle.close()
        except FileExistsError:
            raise AlreadyExistsError(f"{self._storage.describe(self._path)} already exists") from None
        except Exception as exc:
            raise StorageError(f"cannot finish {self._storage.describe(self._path)}: {exc}") from exc

    def abort(self) -> None:
        discard = getattr(self._handle, "discard", None)
        try:
            if callable(discard):
                discard()
            else:
                self._handle.close()
        except Exception:
            pass  # the attempt failed already; its leftovers are garbage for gc


class FsspecStorage(Storage):
    """Objects of an fsspec filesystem under `root`.

    atomic_create: True only when the filesystem's 'xb' is an atomic create-if-absent (memory's is not: it
    checks, then creates); otherwise each commit warns and is safe only with a single coordinator.
    """

    def __init__(self, fs: Any, root: str, url: str | None = None, *, atomic_create: bool = False) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        protocol = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol
        self.url = url or f"{protocol}://{self.root.lstrip('/')}"
        self.atomic_create = atomic_create

    def full(self, path: str) -> str:
        return posixpath.join(self.root, path) if path else self.root

    def child(self, name: str) -> FsspecStorage:
        return FsspecStorage(
            self.fs, self.full(name), f"{self.url.rstrip('/')}/{name}", atomic_create=self.atomic_create
        )

    def parent(self) -> FsspecStorage:
        above, _, name = self.root.rpartition("/")
        url = self.url.rstrip("/")
        if not name:
            raise StorageError(f"{self.url}: there is no directory above it")
        # The URL keeps the form the user gave (protocol, host) and loses its last component, as the path does.
        url_above = url[: -len(name) - 1] if url.endswith(f"/{name}") else url.rpartition("/")[0]
        return FsspecStorage(self.fs, above or "/", url_above, atomic_create=self.atomic_create)

    def open_new(self, path: str) -> NewFile:
        return _FsspecNewFile(self, path)

    def commit_marker(self, path: str, data: bytes) -> None:
        if self.atomic_create:
            self.write_new(path, data)
            return
        warnings.warn(
            f"{self.url}: this filesystem has no atomic create-if-absent, so {path} is created by the "
            "single-coordinator protocol (check absent, create, read back): safe only if no other process commits "
            "this checkpoint at the same time",
            SingleCoordinatorCommitWarning,
            stacklevel=2,
        )
        if self.exists(path):
            raise AlreadyExistsError(f"{self.describe(path)} already exists; nothing is ever overwritten")
        self.write_new(path, data)
        try:
            held = self.read_range(path, 0, len(data)) == data and self.size(path) == len(data)
        except TruncatedError:  # shorter than ours: another coordinator's marker replaced it
            held = False
        if not held:
            raise AlreadyExistsError(
                f"{self.describe(path)} was written by another coordinator at the same time (this filesystem has "
                "no atomic create; only one coordinator may commit a checkpoint)"
            )

    def read_range(self, path: str, start: int, end: int) -> bytes:
        try:
            data = self.fs.cat_file(self.full(path), start=start, end=end)
        except FileNotFoundError:
            raise NotFoundError(f"{self.describe(path)} does not exist") from None
        except Exception as exc:
            raise StorageError(f"cannot read {self.describe(path)} bytes {start}:{end}: {exc}") from exc
        return check_length(self, path, start, end, bytes(data))

    def size(self, path: str) -> int:
        try:
            return int(self.fs.size(self.full(path)))
        except FileNotFoundError:
            raise NotFoundError(f"{self.describe(path)} does not exist") from None
        except Exception as exc:
            raise StorageError(f"cannot stat {self.describe(path)}: {exc}") from exc

    def exists(self, path: str) -> bool:
        try:
            return bool(self.fs.exists(self.full(path)))
        except Exception as exc:
            raise StorageError(f"cannot stat {self.describe(path)}: {exc}") from exc

    def modified(self, path: str) -> float | None:
        try:
            return modified_time(self.fs.info(self.full(path)))
        except FileNotFoundError:
            raise NotFoundError(f"{self.describe(path)} does not exist") from None
        except Exception as exc:
            raise StorageError(f"cannot stat {self.describe(path)}: {exc}") from exc

    def list(self, prefix: str = "") -> list[str]:
        try:
            entries = self.fs.ls(self.full(prefix), detail=False, refresh=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except TypeError:
            entries = self.fs.ls(self.full(prefix), detail=False)
        except Exception as exc:
            raise StorageError(f"cannot list {self.describe(prefix)}: {exc}") from exc
        base = self.full(prefix).rstrip("/").lstrip("/")
        names = {posixpath.basename(str(e).rstrip("/")) for e in entries if str(e).strip("/") != base}
        return sorted(names)

    def delete(self, path: str) -> None:
        try:
            self.fs.rm(self.full(path), recursive=False)
        except FileNotFoundError:
            return
        except Exception as exc:
            raise StorageError(f"cannot delete {self.describe(path)}: {exc}") from exc
