"""The backend interface every storage implements: paths are '/'-separated and relative to its root.

Contract: writes never replace an existing object; reads return exactly the bytes asked for or raise.
"""

from __future__ import annotations

import abc
import datetime as dt
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from shardckpt.errors import FormatError, NotFoundError, StorageError, TruncatedError


class SingleCoordinatorCommitWarning(UserWarning):
    """The store has no atomic create-if-absent, so a commit is only safe with a single coordinator."""


class NewFile(abc.ABC):
    """A file being created; visible under its name only as a whole after `close()` (or partially on crash)."""

    #: True when write_at works: several threads may then fill the new file at once.
    supports_write_at = False

    @abc.abstractmethod
    def write(self, data: bytes | memoryview) -> None: ...

    def write_at(self, data: bytes | memoryview, offset: int) -> None:
        """Write `data` at byte `offset` (only where supports_write_at)."""
        raise NotImplementedError(f"{type(self).__name__} writes sequentially only")

    #: True when hold_head and write_head work: a sequential file whose first bytes can still be replaced.
    supports_head_rewrite = False

    def hold_head(self, size: int) -> None:
        """Before the first write: keep the file's first `size` bytes (or more) replaceable until close."""
        raise NotImplementedError(f"{type(self).__name__} cannot replace its first bytes")

    def write_head(self, data: bytes | memoryview) -> None:
        """Replace the file's first len(data) bytes (at most hold_head's size), before close."""
        raise NotImplementedError(f"{type(self).__name__} cannot replace its first bytes")

    @abc.abstractmethod
    def close(self) -> None:
        """Flush and make durable."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Stop writing after a failure; what was written may remain as a leftover of a failed attempt."""

    def __enter__(self) -> NewFile:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class RangeReader:
    """Range reads of one storage over a while (one load), as `with storage.reader() as reader:`.

    A backend may keep handles open between the reads (local disk: one descriptor per file, so the kernel's
    read-ahead follows a sequential reader from one request to the next); everything is released on exit.
    """

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    def read_into(self, path: str, start: int, out: memoryview) -> None:
        """Storage.read_range_into, through this reader's handles."""
        self.storage.read_range_into(path, start, out)

    def prefetch(self, path: str, start: int, length: int) -> None:
        """A hint that bytes [start, start + length) of `path` will be read soon (default: ignored)."""

    def close(self) -> None:
        """Release what the reader holds."""

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close()


class Storage(abc.ABC):
    """One checkpoint's (or one root's) objects. `url` names the root for messages and for child URLs."""

    url: str
    #: True when `commit_marker` is an atomic create-if-absent of the backend itself.
    atomic_create: bool = True
    read_threads: int = 8
    #: True when one read_ranges call beats concurrent single reads (object stores: one event loop, one GET
    #: limit); readers then fetch in batches. False: readers run read_range_into on their own worker threads.
    batched_reads: bool = False
    #: True when one sequential reader is faster than several concurrent ones (a disk and its read-ahead):
    #: readers then issue their reads from one thread, in file order, and verify and copy on others.
    ordered_reads: bool = False

    @abc.abstractmethod
    def child(self, name: str) -> Storage:
        """The storage rooted at `name` below this root."""

    def parent(self) -> Storage:
        """The storage of the directory (prefix) that holds this root, with the same options and client: a
        checkpoint's root, whose other checkpoints format 1.1 references name. StorageError where there is none."""
        raise StorageError(f"{self.url}: this storage backend cannot open the directory above it")

    @property
    def name(self) -> str:
        """This root's last path component (a checkpoint's name under its root)."""
        return self.url.rstrip("/").rsplit("/", 1)[-1]

    @abc.abstractmethod
    def open_new(self, path: str) -> NewFile:
        """Start creating `path`; AlreadyExistsError if it exists."""

    def write_new(self, path: str, data: bytes) -> None:
        with self.open_new(path) as handle:
            handle.write(data)

    @abc.abstractmethod
    def commit_marker(self, path: str, data: bytes) -> None:
        """Create `path` with `data` atomically and durably, only if absent (else AlreadyExistsError)."""

    @abc.abstractmethod
    def read_range(self, path: str, start: int, end: int) -> bytes:
        """Exactly bytes [start, end) of `path`; StorageError on a short read, NotFoundError if missing."""

    def read_ranges(
        self, requests: Sequence[tuple[str, int, int]], arrived: Callable[[int, bytes], None] | None = None
    ) -> list[bytes]:
        """Several exact range reads, concurrently; `arrived(i, data)` (quick: it may run on an I/O thread) as
        request i's bytes come in, so the caller can start on them while the others are still read."""
        if len(requests) <= 1:
            return [_arrived(arrived, number, self.read_range(*r)) for number, r in enumerate(requests)]
        with ThreadPoolExecutor(max_workers=min(self.read_threads, len(requests))) as pool:
            return list(pool.map(lambda n: _arrived(arrived, n, self.read_range(*requests[n])), range(len(requests))))

    def read_range_into(self, path: str, start: int, out: memoryview) -> None:
        """Exactly len(out) bytes of `path` from byte `start` into the writable byte buffer `out`.

        TruncatedError on a short read, NotFoundError if missing. Default: read_range, then a copy; backends that
        can read straight into caller memory (local disk: preadv) override it, so no bytes object is allocated.
        """
        view = memoryview(out).cast("B")
        end = start + view.nbytes
        view[:] = check_length(self, path, start, end, self.read_range(path, start, end))

    def reader(self) -> RangeReader:
        """A reader for many range reads in a row; use it as a context manager."""
        return RangeReader(self)

    def resident(self, places: Sequence[tuple[str, int]]) -> bool | None:
        """True when the byte at each (path, offset) is already in memory (a local page cache), so reading it
        is a memory copy; False when one is not; None when the backend cannot tell (the default)."""
        return None

    def read_ranges_into(self, requests: Sequence[tuple[str, int]], outs: Sequence[memoryview]) -> None:
        """read_range_into for several (path, start) requests and their buffers, concurrently.

        Default: one read_ranges call (a backend's batched reads stay batched), then a copy into each buffer.
        """
        views = [memoryview(out).cast("B") for out in outs]
        ranges = [(path, start, start + view.nbytes) for (path, start), view in zip(requests, views, strict=True)]
        for (path, start, end), view, data in zip(ranges, views, self.read_ranges(ranges)):
            view[:] = check_length(self, path, start, end, data)

    def read_small(self, path: str, max_bytes: int) -> bytes:
        """The whole object, refusing one larger than `max_bytes` (a format limit) before reading it."""
        size = self.size(path)
        if size > max_bytes:
            raise FormatError(f"{self.describe(path)} is {size} bytes, over the {max_bytes} byte limit")
        return self.read_range(path, 0, size) if size else b""

    @abc.abstractmethod
    def size(self, path: str) -> int:
        """Size in bytes; NotFoundError if missing."""

    @abc.abstractmethod
    def exists(self, path: str) -> bool: ...

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Names (not paths) of the objects and sub-directories directly under `prefix`, sorted."""

    @abc.abstractmethod
    def delete(self, path: str) -> None: ...

    def modified(self, path: str) -> float | None:
        """When `path` was last written (Unix seconds), or None when the backend cannot tell; NotFoundError if missing.

        Garbage collection keeps whatever it cannot date. Default: fsspec `info` of the backend's filesystem
        (`self.fs`, when it has one) at the object's URL, which s3fs, gcsfs, memory and local all answer.
        """
        fs = getattr(self, "fs", None)
        if fs is None:
            return None
        try:
            info = fs.info(self.describe(path))
        except FileNotFoundError:
            raise NotFoundError(f"{self.describe(path)} does not exist") from None
        except Exception as exc:
            raise StorageError(f"cannot stat {self.describe(path)}: {exc}") from exc
        return modified_time(info)

    def unfinished_uploads(self) -> tuple[Upload, ...]:
        """Uploads under this storage begun and never completed nor aborted (an object store's multipart uploads: a
        save killed while uploading leaves them, stored and billed, never an object). Default: none."""
        return ()

    def abort_upload(self, upload: Upload) -> None:
        """Abort one of unfinished_uploads(): its parts are deleted, no object ever appears."""
        raise StorageError(f"{self.url} has no unfinished uploads to abort")

    def describe(self, path: str) -> str:
        return f"{self.url.rstrip('/')}/{path}"


@dataclass(frozen=True)
class Upload:
    """An unfinished upload of object `path` (relative to the storage that listed it)."""

    path: str
    upload_id: str
    size: int  # bytes of the parts uploaded so far
    modified: float | None  # when its last part arrived (or it began), Unix seconds; None: unknown


def check_length(storage: Storage, path: str, start: int, end: int, data: bytes) -> bytes:
    if len(data) != end - start:
        raise TruncatedError(
            f"short read of {storage.describe(path)}: asked for bytes {start}:{end}, got {len(data)} bytes "
            "(file truncated?)"
        )
    return data


def modified_time(info: Mapping[str, Any]) -> float | None:
    """The modification time in an fsspec `info` entry, as Unix seconds (None when it has none)."""
    for key in ("mtime", "LastModified", "last_modified", "modified", "updated", "created"):
        value = info.get(key)
        if isinstance(value, dt.datetime):
            return (value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)).timestamp()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and value:
            try:
                parsed = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                continue
            return (parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.timezone.utc)).timestamp()
    return None


def _arrived(arrived: Callable[[int, bytes], None] | None, number: int, data: bytes) -> bytes:
    if arrived is not None:
        arrived(number, data)
    return data
