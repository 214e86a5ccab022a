"""Fault injection for tests: a storage wrapper (errors, partial or torn writes, short or corrupt reads, latency,
reordered completions) and, below an object store's retries, a request wrapper (throttling, 5xx, resets, timeouts,
lost replies).

Faults match an operation and a path pattern and fire on the nth matching call, for a number of times.
"""

from __future__ import annotations

import asyncio
import fnmatch
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any, Protocol

from shardckpt.errors import ShardckptUsageError, StorageError
from shardckpt.storage.base import NewFile, Storage

OPERATIONS = (
    "open_new",
    "write",
    "close",
    "commit_marker",
    "read_range",
    "size",
    "exists",
    "list",
    "delete",
    "modified",
)
# error: the call raises InjectedFault. partial (write): half the bytes land, then InjectedFault. torn (write): half
# the bytes land and the call reports success (a lying disk or client). short/corrupt (read_range): half the bytes,
# or one byte flipped. latency: sleep `delay`. reorder: sleep a random 0..`delay` (the storage's seeded RNG), so
# concurrent calls complete in another order than they started; read_ranges also starts its requests shuffled.
KINDS = ("error", "partial", "torn", "short", "corrupt", "latency", "reorder")


@dataclass
class Fault:
    op: str
    path: str = "*"  # fnmatch pattern on the relative path
    kind: str = "error"
    nth: int = 1  # fire from the nth matching call on
    times: int = 1  # how many times to fire (0 = forever)
    delay: float = 0.0
    fired: int = field(default=0, init=False)
    seen: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.op not in OPERATIONS or self.kind not in KINDS:
            raise ShardckptUsageError(f"unknown fault {self.op!r}/{self.kind!r}; ops {OPERATIONS}, kinds {KINDS}")


class InjectedFault(StorageError):
    """The error a Fault of kind 'error' or 'partial' raises."""


class _FaultyNewFile(NewFile):
    def __init__(self, owner: FaultyStorage, path: str, inner: NewFile) -> None:
        self._owner, self._path, self._inner = owner, path, inner

    def write(self, data: bytes | memoryview) -> None:
        fault = self._owner.trigger("write", self._path)
        if fault is not None and fault.kind in ("partial", "torn"):
            view = memoryview(data).cast("B")
            self._inner.write(view[: len(view) // 2])
            if fault.kind == "partial":
                raise InjectedFault(f"injected partial write of {self._path}")
            return
        self._inner.write(data)

    def close(self) -> None:
        self._owner.trigger("close", self._path)
        self._inner.close()

    def abort(self) -> None:
        self._inner.abort()


class FaultyStorage(Storage):
    """Wraps a backend: records every call as (operation, path) and injects the faults that match.

    Paths in `calls` and in fault patterns are relative to the storage this wrapper was built on, also for its
    children (a fault "step-2/data/*" on a root matches the data files of its child "step-2"); children share
    the faults, the record and the random source (`seed`, for "reorder").
    """

    def __init__(self, inner: Storage, faults: Sequence[Fault] = (), *, seed: int = 0) -> None:
        self.inner, self.faults = inner, list(faults)
        self.url = inner.url
        self.atomic_create = inner.atomic_create
        self.calls: list[tuple[str, str]] = []
        self.prefix = ""
        self._lock = threading.Lock()
        self._random = random.Random(seed)

    def trigger(self, op: str, path: str) -> Fault | None:
        recorded = self.prefix + path
        with self._lock:
            self.calls.append((op, recorded))
            for fault in self.faults:
                if fault.op != op or not fnmatch.fnmatch(recorded, fault.path):
                    continue
                fault.seen += 1
                if fault.seen < fault.nth or (fault.times and fault.fired >= fault.times):
                    continue
                fault.fired += 1
                break
            else:
                return None
            jitter = self._random.uniform(0.0, fault.delay)
        if fault.kind in ("latency", "reorder"):
            time.sleep(fault.delay if fault.kind == "latency" else jitter)
            return None
        if fault.kind == "error":
            raise InjectedFault(f"injected {op} failure on {self.describe(path)}")
        return fault

    def child(self, name: str) -> FaultyStorage:
        child = FaultyStorage(self.inner.child(name), self.faults)
        child.calls, child._lock, child._random = self.calls, self._lock, self._random
        child.prefix = f"{self.prefix}{name}/"
        return child

    def parent(self) -> FaultyStorage:
        """The directory above, wrapped alike (shared faults, record and random source). Paths stay relative to
        the storage first wrapped: above it they start with "../" (a root's "step-1/data/x" read from a wrapped
        checkpoint "step-2" of it is recorded, and matched by fault patterns, as "../step-1/data/x")."""
        above = FaultyStorage(self.inner.parent(), self.faults)
        above.calls, above._lock, above._random = self.calls, self._lock, self._random
        parts = self.prefix.rstrip("/").split("/") if self.prefix else []
        if parts and parts[-1] != "..":
            above.prefix = "".join(f"{part}/" for part in parts[:-1])
        else:
            above.prefix = f"{self.prefix}../"
        return above

    def open_new(self, path: str) -> NewFile:
        self.trigger("open_new", path)
        return _FaultyNewFile(self, path, self.inner.open_new(path))

    def commit_marker(self, path: str, data: bytes) -> None:
        fault = self.trigger("commit_marker", path)
        if fault is not None and fault.kind in ("partial", "torn"):
            self.inner.commit_marker(path, data[: len(data) // 2])
            if fault.kind == "partial":
                raise InjectedFault(f"injected partial commit of {self.describe(path)}")
            return
        self.inner.commit_marker(path, data)

    def read_ranges(
        self, requests: Sequence[tuple[str, int, int]], arrived: Callable[[int, bytes], None] | None = None
    ) -> list[bytes]:
        """Concurrent exact reads; with a "reorder" fault on read_range they also start in a shuffled order."""
        order = list(range(len(requests)))
        if any(fault.op == "read_range" and fault.kind == "reorder" for fault in self.faults):
            with self._lock:
                self._random.shuffle(order)
        results: list[bytes] = [b""] * len(requests)
        with ThreadPoolExecutor(max_workers=max(1, min(self.read_threads, len(requests)))) as pool:
            futures = {pool.submit(self.read_range, *requests[index]): index for index in order}
            for future in as_completed(futures):
                results[futures[future]] = future.result()
                if arrived is not None:
                    arrived(futures[future], results[futures[future]])
        return results

    def read_range(self, path: str, start: int, end: int) -> bytes:
        fault = self.trigger("read_range", path)
        data = self.inner.read_range(path, start, end)
        if fault is not None and fault.kind == "short":
            return data[: len(data) // 2]
        if fault is not None and fault.kind == "corrupt" and data:
            middle = len(data) // 2
            return data[:middle] + bytes([data[middle] ^ 0x40]) + data[middle + 1 :]
        return data

    def read_range_into(self, path: str, start: int, out: memoryview) -> None:
        """The inner backend's read into `out`, under the same faults as read_range: "short" fills only the first
        half and reports success (a lying backend: the stale rest must fail its checksums), "corrupt" flips a byte.
        """
        fault = self.trigger("read_range", path)
        view = memoryview(out).cast("B")
        if fault is not None and fault.kind == "short":
            self.inner.read_range_into(path, start, view[: view.nbytes // 2])
            return
        self.inner.read_range_into(path, start, view)
        if fault is not None and fault.kind == "corrupt" and view.nbytes:
            view[view.nbytes // 2] ^= 0x40

    def size(self, path: str) -> int:
        self.trigger("size", path)
        return self.inner.size(path)

    def exists(self, path: str) -> bool:
        self.trigger("exists", path)
        return self.inner.exists(path)

    def list(self, prefix: str = "") -> list[str]:
        self.trigger("list", prefix)
        return self.inner.list(prefix)

    def delete(self, path: str) -> None:
        self.trigger("delete", path)
        self.inner.delete(path)

    def modified(self, path: str) -> float | None:
        self.trigger("modified", path)
        return self.inner.modified(path)

    def describe(self, path: str) -> str:
        return self.inner.describe(path)


# ------------------------------------------------------------------------------------- object-store requests

REQUEST_KINDS = (
    "slowdown",
    "server-error",
    "forbidden",
    "reset",
    "timeout",
    "lost-reply",
    "ignore-condition",
    "latency",
)


@dataclass
class RequestFault:
    """A fault on S3 API calls (`operation` like put_object, upload_part, get_object; `key` an fnmatch pattern).

    slowdown (503 SlowDown), server-error (500 InternalError), reset (connection reset), timeout (read
    timeout): transient, retried. forbidden (403): permanent. lost-reply: the call is applied, then its reply is
    lost (a reset). ignore-condition: If-None-Match is dropped, as by a server that ignores it. latency: a delay.
    """

    operation: str = "*"
    key: str = "*"
    kind: str = "slowdown"
    nth: int = 1  # fire from the nth matching call on
    times: int = 1  # how many times to fire (0 = forever)
    delay: float = 0.0
    fired: int = field(default=0, init=False)
    seen: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.kind not in REQUEST_KINDS:
            raise ShardckptUsageError(f"unknown request fault {self.kind!r}; kinds {REQUEST_KINDS}")

    def matches(self, operation: str, key: str) -> bool:
        if not (fnmatch.fnmatch(operation, self.operation) and fnmatch.fnmatch(key, self.key)):
            return False
        self.seen += 1
        if self.seen < self.nth or (self.times and self.fired >= self.times):
            return False
        self.fired += 1
        return True


class RequestSender(Protocol):
    async def call(self, operation: str, **params: Any) -> dict[str, Any]: ...


def _client_error(operation: str, status: int, code: str) -> Exception:
    from botocore.exceptions import ClientError

    response: Any = {
        "Error": {"Code": code, "Message": f"injected {code}"},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    error: Exception = ClientError(response, operation)
    return error


class FaultyRequests:
    """Wraps an S3 backend's request sender (`storage.requests = FaultyRequests(storage.requests, faults)`).

    Sits below the backend's retry loop, so each try meets the faults afresh. Records every call and the most
    calls in progress at once. Runs on the event loop only (no locking needed).
    """

    def __init__(self, inner: RequestSender, faults: Sequence[RequestFault] = ()) -> None:
        self.inner, self.faults = inner, list(faults)
        self.calls: list[tuple[str, str]] = []
        self.active = self.peak_active = 0

    def count(self, operation: str, key: str = "*") -> int:
        return sum(1 for op, k in self.calls if op == operation and fnmatch.fnmatch(k, key))

    async def call(self, operation: str, **params: Any) -> dict[str, Any]:
        key = str(params.get("Key", params.get("Prefix", "")))
        self.calls.append((operation, key))
        fault = next((f for f in self.faults if f.matches(operation, key)), None)
        kind = fault.kind if fault is not None else ""
        self.active += 1
        self.peak_active = max(self.peak_active, self.active)
        try:
            if kind == "latency":
                assert fault is not None
                await asyncio.sleep(fault.delay)
            elif kind in ("slowdown", "server-error", "forbidden"):
                status, code = {"slowdown": (503, "SlowDown"), "server-error": (500, "InternalError")}.get(
                    kind, (403, "AccessDenied")
                )
                raise _client_error(operation, status, code)
            elif kind == "reset":
                raise ConnectionResetError(f"injected connection reset during {operation} {key}")
            elif kind == "timeout":
                from botocore.exceptions import ReadTimeoutError

                raise ReadTimeoutError(endpoint_url=f"injected timeout during {operation} {key}")
            elif kind == "ignore-condition":
                params = {name: value for name, value in params.items() if name != "IfNoneMatch"}
            response = await self.inner.call(operation, **params)
            if kind == "lost-reply":
                raise ConnectionResetError(f"injected lost reply of {operation} {key} (the call was applied)")
            return response
        finally:
            self.active -= 1
