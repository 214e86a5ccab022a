"""A new S3 object written as a stream: one conditional PUT when small, else a multipart upload whose parts
are sent concurrently on fsspec's event loop, with at most max_in_flight bytes of parts on the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

from shardckpt.errors import AlreadyExistsError, NotFoundError, StorageError
from shardckpt.storage.base import NewFile
from shardckpt.storage.retry import RetryPolicy

T = TypeVar("T")


class UploadTarget(Protocol):
    """What an upload needs of the S3 backend (S3Storage provides it); a protocol, so the two modules do not
    import each other."""

    bucket: str
    part_size: int
    max_in_flight: int
    fs: Any
    requests: Any

    def key(self, path: str) -> str: ...

    def describe(self, path: str) -> str: ...

    def run(self, function: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T: ...

    async def request(self, operation: str, path: str, verb: str, **params: Any) -> dict[str, Any]: ...

    async def retried(
        self, call: Callable[[int], Awaitable[T]], what: str, path: str, policy: RetryPolicy | None = None
    ) -> T: ...

    async def put_new(self, path: str, body: bytes | bytearray, conditional: bool) -> None: ...


MAX_PART_SIZE = 5 << 30
MAX_PARTS = 10_000
PARTS_PER_SIZE_STEP = 1_000  # the part size doubles every 1,000 parts: 10,000 parts from 16 MiB hold over 10 TB
_CLEANUP = RetryPolicy(attempts=3, base_delay=0.05, max_delay=0.5, deadline=5.0)


def multipart_etag(etags: list[str]) -> str | None:
    """The ETag S3 gives a completed multipart upload (MD5 of the parts' MD5s, "-count"), if parts are MD5s."""
    try:
        digests = b"".join(bytes.fromhex(etag.strip('"')) for etag in etags)
    except ValueError:
        return None
    return f'"{hashlib.md5(digests).hexdigest()}-{len(etags)}"'


def as_body(data: bytes | bytearray) -> bytes | io.BytesIO:
    """A request body for one try: large ones as a fresh stream (aiohttp warns on big raw bytes, and a stream
    consumed by a failed try cannot be sent again)."""
    # BytesIO over a bytes object shares its buffer (no copy); over a bytearray it copies.
    return io.BytesIO(data) if len(data) > 1 << 20 else bytes(data)


class S3NewFile(NewFile):
    """Bytes are buffered into parts; a full part is handed to the event loop and write() returns at once,
    unless the parts on the wire already hold max_in_flight bytes: then it waits for the oldest to finish.
    After hold_head, part 1 stays in memory until close, so that write_head can still replace the object's first
    bytes (a compressed data file's header, known last) while parts 2.. stream: S3 assembles parts by number.
    """

    supports_head_rewrite = True

    def __init__(self, storage: UploadTarget, path: str, conditional: bool) -> None:
        self._storage, self._path, self._conditional = storage, path, conditional
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._parts: list[Future[str]] = []  # parts sent, by part number (from 2 while the head is held)
        self._head_size: int | None = None  # hold_head's size: part 1 is cut at no less
        self._head: bytearray | None = None  # part 1, held until close
        self._pending: deque[tuple[Future[str], int]] = deque()
        self._in_flight = 0
        self.size = 0
        #: The most bytes of parts on the wire at once, and the most parts (for tests and tuning).
        self.peak_in_flight = 0
        self.peak_parts = 0

    @property
    def parts(self) -> int:
        return len(self._parts)

    def _part_size(self) -> int:
        size = min(self._storage.part_size << (len(self._parts) // PARTS_PER_SIZE_STEP), MAX_PART_SIZE)
        if self._head_size is not None and self._head is None:
            return max(size, self._head_size)  # part 1 holds all the replaceable bytes
        return size

    def hold_head(self, size: int) -> None:
        if self.size:
            raise StorageError(f"{self._storage.describe(self._path)}: hold_head after bytes were written")
        self._head_size = size

    def write_head(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        target = self._head if self._head is not None else self._buffer
        if self._head_size is None or len(view) > min(self._head_size, len(target)):
            raise StorageError(f"{self._storage.describe(self._path)}: write_head beyond the bytes held")
        target[: len(view)] = view

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        self.size += len(view)
        while view:
            room = self._part_size() - len(self._buffer)
            self._buffer += view[:room]  # a copy: the caller may reuse its buffer once write() returns
            view = view[room:]
            if len(self._buffer) >= self._part_size():
                part, self._buffer = self._buffer, bytearray()
                if self._head_size is not None and self._head is None:
                    self._head = part  # part 1: sent at close, after write_head
                else:
                    self._send(part)

    def _send(self, part: bytearray, number: int | None = None) -> None:
        if len(self._parts) + (self._head is not None) >= MAX_PARTS:
            raise StorageError(f"{self._storage.describe(self._path)}: over {MAX_PARTS} parts; raise part_size")
        if self._upload_id is None:
            response = self._storage.run(
                self._storage.request, "create_multipart_upload", self._path, "CREATE MULTIPART UPLOAD"
            )
            self._upload_id = str(response["UploadId"])
        self._reap()
        while self._pending and self._in_flight + len(part) > self._storage.max_in_flight:
            future, nbytes = self._pending.popleft()
            future.result()  # raises the part's StorageError
            self._in_flight -= nbytes
        if number is None:  # the next part; part 1 is sent last while held
            number = len(self._parts) + 1 + (self._head is not None)
        coroutine = self._upload_part(number, bytes(part))  # bytes: retries share one buffer
        future = asyncio.run_coroutine_threadsafe(coroutine, self._storage.fs.loop)
        self._parts.append(future)
        self._pending.append((future, len(part)))
        self._in_flight += len(part)
        self.peak_in_flight = max(self.peak_in_flight, self._in_flight)
        self.peak_parts = max(self.peak_parts, len(self._pending))

    def _reap(self) -> None:
        """Forget parts that finished (raising the first failure early rather than at close)."""
        while self._pending and self._pending[0][0].done():
            future, nbytes = self._pending.popleft()
            future.result()
            self._in_flight -= nbytes
        for future, _ in self._pending:
            if future.done() and future.exception() is not None:
                future.result()

    async def _upload_part(self, number: int, part: bytes) -> str:
        storage = self._storage

        def call(_: int) -> Any:
            return storage.requests.call(
                "upload_part",
                Bucket=storage.bucket,
                Key=storage.key(self._path),
                UploadId=self._upload_id,
                PartNumber=number,
                Body=as_body(part),
            )

        response = await storage.retried(call, f"UPLOAD PART {number} of {storage.describe(self._path)}", self._path)
        return str(response["ETag"])

    def close(self) -> None:
        try:
            if self._upload_id is None and self._head is not None and not self._buffer:
                self._buffer, self._head = self._head, None  # exactly one part: one PUT
            if self._upload_id is None and self._head is None:
                self._storage.run(self._storage.put_new, self._path, self._buffer, self._conditional)
                return
            if self._buffer:
                part, self._buffer = self._buffer, bytearray()
                self._send(part)  # the last part may be shorter than 5 MiB
            if self._head is not None:
                head, self._head = self._head, None
                self._send(head, 1)
                self._parts.insert(0, self._parts.pop())
            etags = [future.result() for future in self._parts]
            self._pending.clear()
            self._storage.run(self._complete, etags)
        except BaseException:
            self.abort()
            raise

    async def _complete(self, etags: list[str]) -> None:
        storage, tries = self._storage, 0
        parts = [{"PartNumber": number, "ETag": etag} for number, etag in enumerate(etags, 1)]

        def call(number: int) -> Any:
            nonlocal tries
            tries = number
            return storage.requests.call(
                "complete_multipart_upload",
                Bucket=storage.bucket,
                Key=storage.key(self._path),
                UploadId=self._upload_id,
                MultipartUpload={"Parts": parts},
                **({"IfNoneMatch": "*"} if self._conditional else {}),
            )

        try:
            await storage.retried(call, f"COMPLETE MULTIPART UPLOAD {storage.describe(self._path)}", self._path)
        except (AlreadyExistsError, NotFoundError):
            # After a lost reply a retry finds the upload gone (404) or the object there (412): it is ours
            # if the object's ETag is the one this very list of parts produces.
            if tries > 1 and await self._landed(etags):
                return
            raise
        self._upload_id = None

    async def _landed(self, etags: list[str]) -> bool:
        expected = multipart_etag(etags)
        try:
            head = await self._storage.request("head_object", self._path, "HEAD")
        except StorageError:
            return False
        return expected is not None and head.get("ETag") == expected and int(head["ContentLength"]) == self.size

    def abort(self) -> None:
        """Cancel parts still on the wire and abort the multipart upload (best effort: it already failed)."""
        for future in self._parts:
            future.cancel()
        self._pending.clear()
        upload_id, self._upload_id = self._upload_id, None
        if upload_id is None:
            return
        storage = self._storage

        def call(_: int) -> Any:
            return storage.requests.call(
                "abort_multipart_upload", Bucket=storage.bucket, Key=storage.key(self._path), UploadId=upload_id
            )

        # Unfinished uploads left by a failed abort are garbage that the bucket's lifecycle rule removes.
        with contextlib.suppress(StorageError):
            storage.run(
                storage.retried, call, f"ABORT MULTIPART UPLOAD {storage.describe(self._path)}", self._path, _CLEANUP
            )
