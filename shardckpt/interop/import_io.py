"""What the importers share: the source directory (memory-mapped when local), progress counting, the report.

An importer reads another tool's checkpoint through SourceDir and writes through CountingStorage into shardckpt.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from shardckpt.errors import FormatError, NotFoundError, StorageError
from shardckpt.format import layout
from shardckpt.interop.dcp_pickle import DcpRecord
from shardckpt.storage import NewFile, Storage


@dataclass
class ImportReport:
    source: str
    url: str
    world_size: int = 0
    tensors: int = 0
    objects: int = 0
    tensor_bytes: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (name, why)
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        """The report as one JSON object, for --json."""
        return {
            "source": self.source,
            "url": self.url,
            "world_size": self.world_size,
            "tensors": self.tensors,
            "objects": self.objects,
            "tensor_bytes": self.tensor_bytes,
            "skipped": [{"name": name, "reason": reason} for name, reason in self.skipped],
            "seconds": round(self.seconds, 3),
        }

    def lines(self) -> list[tuple[str, str]]:
        """The report for people as (verdict, rest) pairs, plain text (names are untrusted: the caller escapes them):
        one per skipped entry ("skipped"), then the totals ("imported")."""
        size = f"{self.tensor_bytes / (1 << 20):.1f} MiB"
        return [("skipped", f"{name}: {reason}") for name, reason in self.skipped] + [
            (
                "imported",
                f"{self.source} -> {self.url}: {self.tensors} tensors ({size}), "
                f"{self.objects} objects, {self.world_size} ranks, in {self.seconds:.1f} s",
            )
        ]


# ------------------------------------------------------------------------------------------- source


class SourceDir:
    """A checkpoint directory of another tool: local files are memory-mapped, other fsspec URLs read as needed.

    `kind` and `index` only word the messages: what the directory should be ("a DCP checkpoint directory") and
    which file names the others (".metadata").
    """

    def __init__(self, url: str, options: dict[str, Any] | None, *, kind: str, index: str) -> None:
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url, **(options or {}))
        except (ImportError, ValueError) as exc:
            raise StorageError(f"cannot open {url}: {exc}") from exc
        self.url = url.rstrip("/")
        self.options, self.kind, self.index = options, kind, index
        self.local = isinstance(self.fs, LocalFileSystem)
        self._maps: dict[str, tuple[mmap.mmap, int]] = {}

    def describe(self, name: str) -> str:
        return f"{self.url}/{name}"

    def child(self, name: str) -> SourceDir:
        """The subdirectory `name` (a plain name), with the same storage options and wording."""
        return SourceDir(self.describe(name), self.options, kind=self.kind, index=self.index)

    def _path(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    def names(self) -> list[str]:
        """The names of the files directly in the directory."""
        try:
            entries = self.fs.ls(self.root.rstrip("/") or "/", detail=True)
        except FileNotFoundError:
            raise NotFoundError(f"{self.url} does not exist: not {self.kind}") from None
        except OSError as exc:
            raise StorageError(f"cannot list {self.url}: {exc}") from exc
        return sorted(str(e["name"]).rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "file")

    def exists(self, name: str) -> bool:
        try:
            return bool(self.fs.isfile(self._path(name)))
        except OSError as exc:
            raise StorageError(f"cannot read {self.describe(name)}: {exc}") from exc

    def read_all(self, name: str, max_bytes: int) -> bytes:
        try:
            size = self.fs.size(self._path(name))
            if size > max_bytes:
                raise FormatError(f"{self.describe(name)} is {size} bytes, over the {max_bytes} byte limit")
            data: bytes = self.fs.cat_file(self._path(name))
        except FileNotFoundError:
            raise self._missing(name) from None
        except OSError as exc:
            raise StorageError(f"cannot read {self.describe(name)}: {exc}") from exc
        return data

    def _missing(self, name: str) -> NotFoundError:
        """The error for a file of the directory that is not there: the directory's own absence (a typo) first."""
        try:
            there = bool(self.fs.exists(self.root.rstrip("/") or "/"))
        except OSError:
            there = True  # cannot tell: name the file
        if not there:
            return NotFoundError(f"{self.url} does not exist (check the path or URL for a typo)")
        return NotFoundError(f"{self.describe(name)} does not exist: not {self.kind}")

    def record(self, record: DcpRecord, stack: ExitStack) -> memoryview:
        """Exactly the record's bytes; a view of a private memory map for local files (no copy is made)."""
        end = record.offset + record.length
        if not self.local:
            try:
                data = self.fs.cat_file(self._path(record.path), start=record.offset, end=end)
            except OSError as exc:
                raise StorageError(f"cannot read {self.describe(record.path)}: {exc}") from exc
            if len(data) != record.length:
                raise FormatError(f"{self.describe(record.path)}: record {record.offset}:{end} is past its end")
            return memoryview(bytearray(data))
        mapped, size = self._map(record.path, stack)
        if end > size:
            raise FormatError(f"{self.describe(record.path)}: record {record.offset}:{end} is past its end")
        return memoryview(mapped)[record.offset : end]

    def whole(self, name: str, stack: ExitStack) -> memoryview:
        """All the bytes of file `name` (mapped when local, read into memory otherwise)."""
        if self.local:
            mapped, size = self._map(name, stack)
            return memoryview(mapped)[:size]
        try:
            return memoryview(bytearray(self.fs.cat_file(self._path(name))))
        except FileNotFoundError:
            raise NotFoundError(f"{self.describe(name)} does not exist (named by {self.index})") from None
        except OSError as exc:
            raise StorageError(f"cannot read {self.describe(name)}: {exc}") from exc

    def _map(self, name: str, stack: ExitStack) -> tuple[mmap.mmap, int]:
        if name in self._maps:
            return self._maps[name]
        try:
            with open(self._path(name), "rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                # ACCESS_COPY: writable for torch.frombuffer, yet nothing is ever written back to the file.
                mapped = mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY) if size else mmap.mmap(-1, 1)
        except FileNotFoundError:
            raise StorageError(f"{self.describe(name)} does not exist (named by {self.index})") from None
        except OSError as exc:
            raise StorageError(f"cannot map {self.describe(name)}: {exc}") from exc
        self._maps[name] = (mapped, size)
        stack.callback(self._unmap, name)
        return mapped, size

    def _unmap(self, name: str) -> None:
        _close_quietly(self._maps.pop(name)[0])


def _close_quietly(mapped: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):  # a view is still referenced somewhere: it closes when collected
        mapped.close()


# ------------------------------------------------------------------------------------------ progress


class _CountingNewFile(NewFile):
    def __init__(self, inner: NewFile, progress: Callable[[int], None] | None) -> None:
        self._inner, self._progress = inner, progress

    def write(self, data: bytes | memoryview) -> None:
        self._inner.write(data)
        if self._progress is not None:
            self._progress(memoryview(data).nbytes)

    def close(self) -> None:
        self._inner.close()

    def abort(self) -> None:
        self._inner.abort()


def with_progress(target: Storage, progress: Callable[[int, int], None] | None, total: int) -> Storage:
    """`target`, reporting progress(nbytes, total) as data bytes are written when a callback is given."""
    if progress is None:
        return target
    return CountingStorage(target, lambda nbytes: progress(nbytes, total))


class CountingStorage(Storage):
    """Passes everything through to `inner`, reporting the bytes of new files as they are written."""

    def __init__(self, inner: Storage, progress: Callable[[int], None]) -> None:
        self.inner, self.progress, self.url = inner, progress, inner.url
        self.atomic_create, self.read_threads = inner.atomic_create, inner.read_threads

    def child(self, name: str) -> Storage:
        return CountingStorage(self.inner.child(name), self.progress)

    def open_new(self, path: str) -> NewFile:
        # Only data files count, so the total is the tensor bytes (plus small safetensors headers).
        counted = self.progress if path.startswith(f"{layout.DATA_DIR}/") else None
        return _CountingNewFile(self.inner.open_new(path), counted)

    def commit_marker(self, path: str, data: bytes) -> None:
        self.inner.commit_marker(path, data)

    def read_range(self, path: str, start: int, end: int) -> bytes:
        return self.inner.read_range(path, start, end)

    def size(self, path: str) -> int:
        return self.inner.size(path)

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def list(self, prefix: str = "") -> list[str]:
        return self.inner.list(prefix)

    def delete(self, path: str) -> None:
        self.inner.delete(path)

    def describe(self, path: str) -> str:
        return self.inner.describe(path)

    def modified(self, path: str) -> float | None:
        return self.inner.modified(path)
