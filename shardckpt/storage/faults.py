"""A storage wrapper that injects faults (errors, partial writes, short or corrupt reads, latency) for tests.

Faults match an operation and a path pattern and fire on the nth matching call, for a number of times.
"""

from __future__ import annotations

import fnmatch
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from shardckpt.errors import StorageError
from shardckpt.storage.base import NewFile, Storage

OPERATIONS = ("open_new", "write", "close", "commit_marker", "read_range", "size", "exists", "list", "delete")
KINDS = ("error", "partial", "short", "corrupt", "latency")


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
            raise ValueError(f"unknown fault {self.op!r}/{self.kind!r}; ops {OPERATIONS}, kinds {KINDS}")


class InjectedFault(StorageError):
    """The error a Fault of kind 'error' or 'partial' raises."""


class _FaultyNewFile(NewFile):
    def __init__(self, owner: FaultyStorage, path: str, inner: NewFile) -> None:
        self._owner, self._path, self._inner = owner, path, inner

    def write(self, data: bytes | memoryview) -> None:
        fault = self._owner.trigger("write", self._path)
        if fault is not None and fault.kind == "partial":
            view = memoryview(data).cast("B")
            self._inner.write(view[: len(view) // 2])
            raise InjectedFault(f"injected partial write of {self._path}")
        self._inner.write(data)

    def close(self) -> None:
        self._owner.trigger("close", self._path)
        self._inner.close()

    def abort(self) -> None:
        self._inner.abort()


class FaultyStorage(Storage):
    def __init__(self, inner: Storage, faults: Sequence[Fault] = ()) -> None:
        self.inner, self.faults = inner, list(faults)
        self.url = inner.url
        self.atomic_create = inner.atomic_create
        self.calls: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def trigger(self, op: str, path: str) -> Fault | None:
        with self._lock:
            self.calls.append((op, path))
            for fault in self.faults:
                if fault.op != op or not fnmatch.fnmatch(path, fault.path):
                    continue
                fault.seen += 1
                if fault.seen < fault.nth or (fault.times and fault.fired >= fault.times):
                    continue
                fault.fired += 1
                break
            else:
                return None
        if fault.kind == "latency":
            time.sleep(fault.delay)
            return None
        if fault.kind == "error":
            raise InjectedFault(f"injected {op} failure on {self.describe(path)}")
        return fault

    def child(self, name: str) -> FaultyStorage:
        return FaultyStorage(self.inner.child(name), self.faults)

    def open_new(self, path: str) -> NewFile:
        self.trigger("open_new", path)
        return _FaultyNewFile(self, path, self.inner.open_new(path))

    def commit_marker(self, path: str, data: bytes) -> None:
        self.trigger("commit_marker", path)
        self.inner.commit_marker(path, data)

    def read_range(self, path: str, start: int, end: int) -> bytes:
        fault = self.trigger("read_range", path)
        data = self.inner.read_range(path, start, end)
        if fault is not None and fault.kind == "short":
            return data[: len(data) // 2]
        if fault is not None and fault.kind == "corrupt" and data:
            middle = len(data) // 2
            return data[:middle] + bytes([data[middle] ^ 0x40]) + data[middle + 1 :]
        return data

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

    def describe(self, path: str) -> str:
        return self.inner.describe(path)
