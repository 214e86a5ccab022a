"""S3 backend on s3fs's client: conditional-create commit, concurrent multipart uploads and range GETs, retries.

Every request runs on fsspec's event loop through one bounded retry loop; SPEC section 9 has the commit rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import difflib
import functools
import inspect
import posixpath
import secrets
import socket
import threading
import warnings
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import botocore.exceptions
import fsspec
import fsspec.asyn

from shardckpt import knobs
from shardckpt.errors import (
    AlreadyExistsError,
    FormatError,
    NotFoundError,
    ShardckptUsageError,
    StorageError,
    TruncatedError,
)
from shardckpt.storage.base import NewFile, SingleCoordinatorCommitWarning, Storage, Upload, check_length, modified_time
from shardckpt.storage.retry import RetryPolicy, retrying
from shardckpt.storage.s3_upload import MAX_PART_SIZE, S3NewFile, as_body

T = TypeVar("T")

S3_PROTOCOLS = ("s3", "s3a")
MIN_PART_SIZE = 5 << 20  # S3's minimum for every part but the last
DEFAULT_PART_SIZE = knobs.S3_PART_SIZE
DEFAULT_MAX_IN_FLIGHT = knobs.S3_MAX_IN_FLIGHT
DEFAULT_MAX_REQUESTS = knobs.S3_MAX_REQUESTS
DEFAULT_READ_PART_SIZE = knobs.S3_READ_PART_SIZE
PROBE_PREFIX = ".shardckpt-probe-"

# Error codes S3 and compatible servers use for throttling and passing server trouble.
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequestsException",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
        "BandwidthLimitExceeded",
    }
)
_TRANSIENT_TYPES: tuple[type[BaseException], ...] = (
    botocore.exceptions.HTTPClientError,  # connection closed, read timeout, proxy errors
    botocore.exceptions.ConnectionError,  # endpoint unreachable, connect timeout
    botocore.exceptions.IncompleteReadError,
    botocore.exceptions.ResponseStreamingError,
    aiohttp.ClientError,  # payload cut short, server disconnected, connection reset
    ConnectionError,
    TimeoutError,  # also asyncio.TimeoutError
)


def error_status(exc: BaseException) -> tuple[int | None, str]:
    """The HTTP status and S3 error code of a botocore ClientError (None, '' for other errors)."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None, ""
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return (int(status) if status is not None else None), str(response.get("Error", {}).get("Code", ""))


def is_unreachable(exc: BaseException) -> bool:
    """True when nothing listens at the endpoint: connection refused, or a host name that does not resolve (not a
    connection reset or a timeout, which a busy server also causes)."""
    if not isinstance(exc, botocore.exceptions.EndpointConnectionError):
        return False
    seen: list[BaseException] = []
    cause: BaseException | None = exc
    while cause is not None and cause not in seen and len(seen) < 16:
        seen.append(cause)
        if isinstance(cause, (ConnectionRefusedError, socket.gaierror)):
            return True
        os_error = getattr(cause, "os_error", None)  # aiohttp's ClientConnectorError
        if isinstance(os_error, (ConnectionRefusedError, socket.gaierror)):
            return True
        inner = getattr(cause, "kwargs", {}).get("error") if isinstance(getattr(cause, "kwargs", None), dict) else None
        cause = inner if isinstance(inner, BaseException) else (cause.__cause__ or cause.__context__)
    return False


def is_timeout(exc: BaseException) -> bool:
    """True for a connect or read timeout of one request (botocore's, aiohttp's or asyncio's)."""
    return isinstance(
        exc,
        (
            botocore.exceptions.ReadTimeoutError,
            botocore.exceptions.ConnectTimeoutError,
            aiohttp.ServerTimeoutError,
            asyncio.TimeoutError,
        ),
    )


def is_transient(exc: BaseException) -> bool:
    """True for errors a retry may cure: 5xx, 429, throttling codes, dropped connections, timeouts."""
    status, code = error_status(exc)
    if status is not None or code:
        # 501 Not Implemented is an answer, not a hiccup (e.g. a server that refuses If-None-Match).
        return code in _TRANSIENT_CODES or (status is not None and ((status >= 500 and status != 501) or status == 429))
    return isinstance(exc, _TRANSIENT_TYPES)


class S3Requests:
    """Sends one S3 API call with s3fs's client and request defaults; a streamed body is read as part of the call."""

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    async def call(self, operation: str, **params: Any) -> dict[str, Any]:
        await self.fs.set_session()
        client = await self.fs.get_s3(params.get("Bucket"))
        method = getattr(client, operation)
        # s3fs's own defaults (s3_additional_kwargs: SSE, requester pays ...) apply as they do for its users.
        response: dict[str, Any] = await method(**self.fs._get_s3_method_kwargs(method, **params))
        body = response.get("Body")
        if body is not None and hasattr(body, "read"):
            try:
                response["Body"] = await body.read()
            finally:
                body.close()
        return response


@dataclass
class _Shared:
    """State a storage shares with its children: whether the server honours If-None-Match (None: not probed)."""

    conditional: bool | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Whether the endpoint ever answered: until it has, an endpoint that cannot be reached is a wrong URL or
    # host (fail at once); after, it is a server restarting or a network blip (retry).
    reached: bool = False


class S3Storage(Storage):
    """Objects under s3://bucket/prefix, created only if absent, read by exact ranges.

    part_size: multipart part size (>= 5 MiB; grows past 1,000 parts so 10,000 parts reach terabytes).
    max_in_flight: bytes of an upload's parts being sent at once (one part is always allowed), besides the
    part being filled. max_requests: concurrent range GETs. retry: the one retry policy of every request.
    conditional_writes: None probes the server once (on the first create); False forces the single-coordinator
    fallback.
    """

    list_page_size = 1000  # S3's own maximum keys per LIST page
    batched_reads = True  # read_ranges puts a wave of GETs on one event loop under one max_requests limit

    def __init__(
        self,
        fs: Any,
        root: str,
        url: str | None = None,
        *,
        part_size: int = DEFAULT_PART_SIZE,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        max_requests: int = DEFAULT_MAX_REQUESTS,
        read_part_size: int = DEFAULT_READ_PART_SIZE,
        retry: RetryPolicy | None = None,
        conditional_writes: bool | None = None,
        requests: S3Requests | None = None,
    ) -> None:
        if not MIN_PART_SIZE <= part_size <= MAX_PART_SIZE:
            raise ShardckptUsageError(
                f"part_size must be between {MIN_PART_SIZE} and {MAX_PART_SIZE} bytes, got {part_size}"
            )
        if max_in_flight < 1 or max_requests < 1 or read_part_size < 1:
            raise ShardckptUsageError("max_in_flight, max_requests and read_part_size must be positive")
        self.fs = fs
        self.root = root.strip("/")
        self.bucket, _, self.prefix = self.root.partition("/")
        if not self.bucket:
            raise StorageError(f"an S3 URL needs a bucket: {url or root!r}")
        self.url = (url or f"s3://{self.root}").rstrip("/")
        self.part_size, self.max_in_flight, self.max_requests = part_size, max_in_flight, max_requests
        self.read_part_size = read_part_size
        self.retry = retry or RetryPolicy()
        self.requests = requests or S3Requests(fs)
        self._shared = _Shared(conditional_writes)

    # ------------------------------------------------------------------------------------------ plumbing

    def key(self, path: str) -> str:
        return posixpath.join(self.prefix, path) if self.prefix else path

    def child(self, name: str) -> S3Storage:
        child = copy.copy(self)  # same client, settings and probe result
        child.root = f"{self.root}/{name.strip('/')}"
        child.prefix = self.key(name.strip("/"))
        child.url = f"{self.url}/{name.strip('/')}"
        return child

    def parent(self) -> S3Storage:
        if not self.prefix:
            raise StorageError(f"{self.url} is a bucket: there is no prefix above it")
        above = copy.copy(self)  # same client, settings and probe result, as child()
        above.root = self.root.rpartition("/")[0]
        above.prefix = self.prefix.rpartition("/")[0]
        above.url = self.url.rpartition("/")[0]
        return above

    def run(self, function: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
        """Run a coroutine function on fsspec's event loop (where s3fs's client lives) and wait for it."""
        result: T = fsspec.asyn.sync(self.fs.loop, function, *args)
        return result

    async def request(self, operation: str, path: str, verb: str, **params: Any) -> dict[str, Any]:
        """One S3 call on object `path` (Bucket/Key filled in), retried, its final error mapped to shardckpt's."""

        def call(_: int) -> Awaitable[dict[str, Any]]:
            return self.requests.call(operation, Bucket=self.bucket, Key=self.key(path), **params)

        return await self.retried(call, f"{verb} {self.describe(path)}", path)

    async def retried(
        self, call: Callable[[int], Awaitable[T]], what: str, path: str, policy: RetryPolicy | None = None
    ) -> T:
        shared = self._shared

        def transient(exc: BaseException) -> bool:
            # Until the endpoint has answered once, nothing listening and something that accepts connections but
            # never replies (a wrong port behind a load balancer) are both a wrong address: retrying cannot help.
            if (is_unreachable(exc) or is_timeout(exc)) and not shared.reached:
                return False
            if error_status(exc)[0] is not None:
                shared.reached = True  # an HTTP answer, even an error, comes from the endpoint
            return is_transient(exc)

        async def attempt(number: int) -> T:
            result = await call(number)
            shared.reached = True
            return result

        try:
            return await retrying(policy or self.retry, what, attempt, transient)
        except StorageError:
            raise
        except Exception as exc:
            if is_timeout(exc) and not shared.reached:
                endpoint = getattr(self.fs, "endpoint_url", None) or "the default AWS endpoint"
                raise StorageError(
                    f"{what} failed: {endpoint} accepted no request or sent no answer in time ({type(exc).__name__}: "
                    f"{exc}); check endpoint_url (storage option or AWS_ENDPOINT_URL) for a wrong host or port "
                    "(not retried: nothing answered yet; config_kwargs read_timeout/connect_timeout set the wait)"
                ) from exc
            raise self.mapped(exc, what, path) from exc

    def mapped(self, exc: BaseException, what: str, path: str) -> StorageError:
        """The typed error for a failed request, naming the object."""
        status, code = error_status(exc)
        if code == "NoSuchBucket":
            return NotFoundError(f"{what}: bucket {self.bucket!r} does not exist")
        if status == 404 or code in ("NoSuchKey", "NotFound", "404"):
            return NotFoundError(f"{self.describe(path)} does not exist")
        if status == 412 or code == "PreconditionFailed":
            return AlreadyExistsError(f"{self.describe(path)} already exists; nothing is ever overwritten")
        if status == 416 or code == "InvalidRange":
            return TruncatedError(f"{what}: the range lies past the end of the object (file truncated?)")
        if is_unreachable(exc):
            endpoint = getattr(self.fs, "endpoint_url", None) or "the default AWS endpoint"
            return StorageError(
                f"{what} failed: cannot connect to {endpoint} ({exc}); check endpoint_url (storage option or "
                "AWS_ENDPOINT_URL) for a typo and that the server is running (not retried: nothing answered yet)"
            )
        detail = f"HTTP {status} {code}: " if status is not None else f"{type(exc).__name__}: "
        return StorageError(f"{what} failed: {detail}{exc}")

    # --------------------------------------------------------------------------- conditional create

    @property
    def conditional_writes(self) -> bool | None:
        """Whether the server honours If-None-Match: * (None until the first create-only write probed it)."""
        return self._shared.conditional

    @property
    def atomic_create(self) -> bool:
        return self._shared.conditional is not False

    @atomic_create.setter
    def atomic_create(self, value: bool) -> None:
        self._shared.conditional = value

    def supports_conditional_writes(self) -> bool:
        """Probe once (two conditional PUTs of a scratch object, then its delete) and remember the answer."""
        with self._shared.lock:
            if self._shared.conditional is None:
                self._shared.conditional = self.run(self._probe)
            return self._shared.conditional

    async def _probe(self) -> bool:
        path = f"{PROBE_PREFIX}{secrets.token_hex(8)}"
        try:
            try:
                await self.request("put_object", path, "PUT", Body=b"probe", IfNoneMatch="*")
            except AlreadyExistsError:
                return True  # a random name that exists: the condition was evaluated all the same
            except StorageError as exc:
                status, code = error_status(exc.__cause__) if exc.__cause__ else (None, "")
                if status in (400, 501) or code == "NotImplemented":
                    return False  # the server refuses the header outright
                raise
            try:
                await self.request("put_object", path, "PUT", Body=b"probe", IfNoneMatch="*")
            except AlreadyExistsError:
                return True
            return False  # the second create-if-absent replaced the first: the header was ignored
        finally:
            with contextlib.suppress(StorageError):  # a leftover scratch object is harmless garbage
                await self.request("delete_object", path, "DELETE")

    def _condition(self, conditional: bool) -> dict[str, str]:
        return {"IfNoneMatch": "*"} if conditional else {}

    async def put_new(self, path: str, body: bytes | bytearray, conditional: bool) -> None:
        """PUT `path` only if absent. A 412 after a retried try may be our own earlier try that landed."""
        tries = 0

        def call(number: int) -> Awaitable[dict[str, Any]]:
            nonlocal tries
            tries = number
            return self.requests.call(
                "put_object", Bucket=self.bucket, Key=self.key(path), Body=as_body(body), **self._condition(conditional)
            )

        try:
            await self.retried(call, f"PUT {self.describe(path)}", path)
        except AlreadyExistsError:
            if tries > 1 and await self._holds(path, body):
                return
            raise

    async def _holds(self, path: str, body: bytes | bytearray) -> bool:
        try:
            return await self._read(path, 0, len(body)) == body and await self._size(path) == len(body)
        except StorageError:
            return False

    def commit_marker(self, path: str, data: bytes) -> None:
        if self.supports_conditional_writes():
            self.run(self.put_new, path, data, True)
            return
        warnings.warn(
            f"{self.url}: the S3 endpoint ignores conditional writes (If-None-Match: *), so {path} is created by "
            "the single-coordinator protocol (check absent, put, read back): safe only if no other process "
            "commits this checkpoint at the same time",
            SingleCoordinatorCommitWarning,
            stacklevel=2,
        )
        self.run(self._commit_single_coordinator, path, data)

    async def _commit_single_coordinator(self, path: str, data: bytes) -> None:
        if await self._object_exists(path):
            raise AlreadyExistsError(f"{self.describe(path)} already exists; nothing is ever overwritten")
        await self.put_new(path, data, False)
        if await self._read(path, 0, len(data)) != data or await self._size(path) != len(data):
            raise AlreadyExistsError(
                f"{self.describe(path)} was written by another coordinator at the same time (this store ignores "
                "conditional writes; only one coordinator may commit a checkpoint)"
            )

    def open_new(self, path: str) -> NewFile:
        conditional = self.supports_conditional_writes()
        if not conditional and self.run(self._object_exists, path):
            raise AlreadyExistsError(f"{self.describe(path)} already exists; nothing is ever overwritten")
        return S3NewFile(self, path, conditional)

    # --------------------------------------------------------------------------------------- reading

    async def _read(self, path: str, start: int, end: int, limit: asyncio.Semaphore | None = None) -> bytes:
        """Exactly bytes [start, end) of `path`, as concurrent sub-range GETs of at most read_part_size."""
        if end <= start:
            return b""
        limit = limit or asyncio.Semaphore(self.max_requests)

        async def part(lo: int, hi: int) -> bytes:
            async with limit:
                response = await self.request("get_object", path, "GET", Range=f"bytes={lo}-{hi - 1}")
            return check_length(self, path, lo, hi, response["Body"])

        step = self.read_part_size
        parts = await gather_all([part(lo, min(lo + step, end)) for lo in range(start, end, step)])
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def read_range(self, path: str, start: int, end: int) -> bytes:
        if start == end:
            self.size(path)  # a missing object is an error even for an empty range
            return b""
        return self.run(self._read, path, start, end)

    def read_ranges(
        self, requests: Sequence[tuple[str, int, int]], arrived: Callable[[int, bytes], None] | None = None
    ) -> list[bytes]:
        """All requests at once, at most max_requests GETs on the wire; the caller bounds the bytes. `arrived(i,
        data)` runs on the event loop as request i completes (keep it quick: hand the bytes to a thread)."""

        async def one(number: int, path: str, start: int, end: int, limit: asyncio.Semaphore) -> bytes:
            data = await (self._read(path, start, end, limit) if end > start else self._empty(path, limit))
            if arrived is not None:
                arrived(number, data)
            return data

        async def read_all() -> list[bytes]:
            limit = asyncio.Semaphore(self.max_requests)
            return await gather_all([one(n, p, s, e, limit) for n, (p, s, e) in enumerate(requests)])

        return self.run(read_all) if requests else []

    async def _empty(self, path: str, limit: asyncio.Semaphore) -> bytes:
        async with limit:
            await self._size(path)  # a missing object is an error even for an empty range
        return b""

    def read_small(self, path: str, max_bytes: int) -> bytes:
        """One GET of at most max_bytes + 1 bytes: a larger object is refused without reading the rest."""
        return self.run(self._read_small, path, max_bytes)

    async def _read_small(self, path: str, max_bytes: int) -> bytes:
        try:
            response = await self.request("get_object", path, "GET", Range=f"bytes=0-{max_bytes}")
        except TruncatedError:
            if await self._size(path) == 0:  # S3 refuses any range of an empty object
                return b""
            raise
        data: bytes = response["Body"]
        if len(data) > max_bytes:
            total = str(response.get("ContentRange", "")).rpartition("/")[2] or f"over {max_bytes}"
            raise FormatError(f"{self.describe(path)} is {total} bytes, over the {max_bytes} byte limit")
        return data

    # ------------------------------------------------------------------------------------ metadata

    async def _head(self, path: str) -> dict[str, Any]:
        return await self.request("head_object", path, "HEAD")

    async def _size(self, path: str) -> int:
        return int((await self._head(path))["ContentLength"])

    def size(self, path: str) -> int:
        return self.run(self._size, path)

    def modified(self, path: str) -> float | None:
        """Last-Modified from a HEAD of the object (never s3fs's cached listings)."""
        return modified_time(self.run(self._head, path))

    async def _object_exists(self, path: str) -> bool:
        try:
            await self._size(path)
        except NotFoundError:
            return False
        return True

    def exists(self, path: str) -> bool:
        """An object, or a "directory" (a prefix with objects below it)."""
        if self.run(self._object_exists, path):
            return True
        return bool(self.run(self._list, path, 1))

    async def _list(self, prefix: str, limit: int | None = None) -> list[str]:
        """Names under `prefix`, page by page (all of them, or the first `limit` or more)."""
        base = self.key(prefix).strip("/")
        base = f"{base}/" if base else ""
        page_size = min(self.list_page_size, limit or self.list_page_size)
        params: dict[str, Any] = {"Bucket": self.bucket, "Prefix": base, "Delimiter": "/", "MaxKeys": page_size}
        names: set[str] = set()
        while True:
            page = await self.retried(
                lambda _: self.requests.call("list_objects_v2", **params), f"LIST {self.describe(prefix)}", prefix
            )
            names.update(entry["Prefix"][len(base) :].rstrip("/") for entry in page.get("CommonPrefixes") or ())
            names.update(entry["Key"][len(base) :] for entry in page.get("Contents") or ())
            if not page.get("IsTruncated") or (limit is not None and len(names) >= limit):
                break
            params["ContinuationToken"] = page["NextContinuationToken"]
        names.discard("")  # the "directory marker" object some tools create for the prefix itself
        return sorted(names)

    def list(self, prefix: str = "") -> list[str]:
        """Listed by the server on every call (no listing cache), so a write is visible to the next list."""
        return self.run(self._list, prefix)

    def delete(self, path: str) -> None:
        self.run(self.request, "delete_object", path, "DELETE")

    def unfinished_uploads(self) -> tuple[Upload, ...]:
        """The multipart uploads under this prefix, each with its parts' bytes and its last part's time."""
        return self.run(self._unfinished_uploads)

    async def _unfinished_uploads(self) -> tuple[Upload, ...]:
        base = self.key("").strip("/")
        base = f"{base}/" if base else ""
        params: dict[str, Any] = {"Bucket": self.bucket, "Prefix": base}
        found: list[tuple[str, str, float | None]] = []
        while True:
            page = await self.retried(
                lambda _: self.requests.call("list_multipart_uploads", **params), f"LIST uploads {self.url}", ""
            )
            for entry in page.get("Uploads") or ():
                key, initiated = str(entry["Key"]), entry.get("Initiated")
                stamp = initiated.timestamp() if isinstance(initiated, datetime.datetime) else None
                found.append((key[len(base) :], str(entry["UploadId"]), stamp))
            if not page.get("IsTruncated"):
                break
            params["KeyMarker"], params["UploadIdMarker"] = page.get("NextKeyMarker"), page.get("NextUploadIdMarker")
        return tuple(await gather_all([self._upload(path, upload_id, stamp) for path, upload_id, stamp in found]))

    async def _upload(self, path: str, upload_id: str, initiated: float | None) -> Upload:
        size, last = 0, initiated
        params: dict[str, Any] = {"UploadId": upload_id}
        while True:
            page = await self.request("list_parts", path, "LIST parts of", **params)
            for part in page.get("Parts") or ():
                size += int(part.get("Size") or 0)
                stamp = part.get("LastModified")
                if isinstance(stamp, datetime.datetime):
                    last = max(last or 0.0, stamp.timestamp())
            if not page.get("IsTruncated"):
                break
            params["PartNumberMarker"] = page.get("NextPartNumberMarker")
        return Upload(path, upload_id, size, last)

    def abort_upload(self, upload: Upload) -> None:
        abort = functools.partial(self.request, UploadId=upload.upload_id)
        self.run(abort, "abort_multipart_upload", upload.path, "ABORT upload of")


async def gather_all(coroutines: Sequence[Awaitable[T]]) -> list[T]:
    """Await all; on the first failure cancel the others and raise that failure (not an ExceptionGroup)."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def open_s3(url: str, storage_options: dict[str, Any] | None = None, **tuning: Any) -> S3Storage:
    """S3Storage for s3://bucket/prefix, with s3fs built from `storage_options` exactly as s3fs users pass them.

    Unless the caller configures them, botocore's own retries are off (the RetryPolicy is the one bound, not
    a product of nested ones), its read timeout is knobs.S3_READ_TIMEOUT and its connection pool is sized for
    concurrent parts and ranges.
    """
    options = dict(storage_options or {})
    check_options(options)
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("retries", {"total_max_attempts": 1})
    config.setdefault("read_timeout", knobs.S3_READ_TIMEOUT)
    config.setdefault("max_pool_connections", 2 * max(tuning.get("max_requests") or DEFAULT_MAX_REQUESTS, 16))
    options["config_kwargs"] = config
    fs, path = fsspec.core.url_to_fs(url, **options)
    return S3Storage(fs, path, url, **tuning)


def valid_options() -> frozenset[str]:
    """The storage options s3fs accepts: S3FileSystem's own, fsspec's caching ones, and botocore session ones
    (s3fs hands unknown options to the session, which fails late with a TypeError)."""
    import aiobotocore.session
    import s3fs

    names = {"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths"}
    for function in (s3fs.S3FileSystem.__init__, aiobotocore.session.AioSession.__init__):
        for name, parameter in inspect.signature(function).parameters.items():
            if name != "self" and parameter.kind not in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL):
                names.add(name)
    return frozenset(names)


def check_options(options: dict[str, Any]) -> None:
    """ShardckptUsageError for a storage option s3fs does not know, naming the closest valid one and listing all."""
    valid = valid_options()
    for name in options:
        if name in valid:
            continue
        close = difflib.get_close_matches(name, valid, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ShardckptUsageError(
            f"unknown S3 storage option {name!r}{hint}; valid options: {', '.join(sorted(valid))}"
        )
