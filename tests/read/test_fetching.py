"""The streamed read loop: slots of the reused buffer never overlap while in use, stay within the byte budget (a
larger request alone), ordered reads run one at a time in request order, and a failure stops new work and returns
only after every running call has finished."""

from __future__ import annotations

import ctypes
import mmap
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardckpt
from benchmarks.__main__ import save_row_shards
from shardckpt.knobs import MAX_REQUEST as DEFAULT_MAX_REQUEST
from shardckpt.knobs import RESIDENT_MAX_REQUEST
from shardckpt.planner import ReadRequest
from shardckpt.read import fetching
from shardckpt.storage import LocalStorage
from shardckpt.storage.local import _LocalReader


def _requests(sizes: list[int]) -> list[ReadRequest]:
    out, position = [], 0
    for size in sizes:
        out.append(ReadRequest(0, position, position + size, (), ()))
        position += size
    return out


class _Recorder:
    """read and finish steps that check, while a request holds its slot (from its read to the end of its finish),
    that no other request holds an overlapping one and that the bytes in use stay within the budget."""

    def __init__(self, buffer: np.ndarray, budget: int, seed: int, ordered: bool) -> None:
        self.base = buffer.__array_interface__["data"][0]
        self.budget, self.lock, self.random = budget, threading.Lock(), random.Random(seed)
        self.ordered, self.reading, self.reads = ordered, 0, []
        self.active: dict[int, tuple[int, int]] = {}
        self.done: list[int] = []
        self.problems: list[str] = []

    def read(self, request: ReadRequest, slot: np.ndarray) -> None:
        offset = slot.__array_interface__["data"][0] - self.base
        size = request.size
        with self.lock:
            self.reads.append(request.start)
            self.reading += 1
            if self.ordered and self.reading > 1:
                self.problems.append("two ordered reads at once")
            for other, (lo, n) in self.active.items():
                if offset < lo + n and lo < offset + size:
                    self.problems.append(f"request at {request.start} overlaps request at {other}")
            in_use = size + sum(n for _, n in self.active.values())
            if self.active and in_use > self.budget:
                self.problems.append(f"{in_use} bytes in use over a budget of {self.budget}")
            self.active[request.start] = (offset, size)
            delay = self.random.uniform(0, 0.001)
        slot[:] = request.start % 251  # the slot is this request's alone until its finish returns
        time.sleep(delay)
        with self.lock:
            self.reading -= 1

    def finish(self, request: ReadRequest, slot: np.ndarray) -> None:
        with self.lock:
            delay = self.random.uniform(0, 0.002)
        time.sleep(delay)
        if request.size and not (slot == request.start % 251).all():
            with self.lock:
                self.problems.append(f"the slot of request {request.start} changed under it")
        with self.lock:
            del self.active[request.start]
            self.done.append(request.start)


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 64), min_size=1, max_size=30),
    budget=st.integers(1, 200),
    workers=st.integers(1, 4),
    seed=st.integers(0, 1000),
    ordered=st.booleans(),
)
def test_slots_are_disjoint_and_within_the_budget(
    sizes: list[int], budget: int, workers: int, seed: int, ordered: bool
) -> None:
    requests = _requests(sizes)
    buffer = fetching.allocate(fetching.ring_size(requests, budget, workers))
    recorder = _Recorder(buffer, budget, seed, ordered)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        fetching.stream(requests, buffer, budget, pool, recorder.read, recorder.finish, ordered=ordered)
    assert recorder.problems == []
    assert sorted(recorder.done) == [request.start for request in requests]
    if ordered:
        assert recorder.reads == [request.start for request in requests]


def test_ring_size_bounds() -> None:
    requests = _requests([8, 8, 8, 8, 8])
    assert fetching.ring_size(requests, 1 << 30, 2) == 24  # a slot per worker and one more
    assert fetching.ring_size(requests, 16, 2) == 16  # the budget
    assert fetching.ring_size(requests, 4, 2) == 8  # always room for the largest request
    assert fetching.ring_size(requests[:2], 1 << 30, 4) == 16  # never more than all the requests
    assert fetching.ring_size([], 16, 2) == 0


@pytest.mark.parametrize("ordered", [False, True])
def test_a_failure_stops_new_work_and_waits_for_running_work(ordered: bool) -> None:
    requests = _requests([4] * 40)
    started, running, finished_after = [], [0], []
    lock = threading.Lock()
    raised = threading.Event()

    def work(request: ReadRequest, slot: np.ndarray) -> None:  # the finishing step; reads do nothing here
        with lock:
            started.append(request.start)
            running[0] += 1
        try:
            if request.start == 4 * 5:
                raise OSError("injected")
            time.sleep(0.003)
            if raised.is_set():
                finished_after.append(request.start)
        finally:
            with lock:
                running[0] -= 1

    buffer = fetching.allocate(fetching.ring_size(requests, 16, 3))
    with ThreadPoolExecutor(max_workers=3) as pool, pytest.raises(OSError, match="injected"):
        try:
            fetching.stream(requests, buffer, 16, pool, lambda request, slot: None, work, ordered=ordered)
        finally:
            raised.set()
            assert running[0] == 0  # nothing still runs once stream() has returned or raised
    assert len(started) < len(requests)  # the requests after the failure never started
    assert finished_after == []


def test_run_all_raises_the_first_failure_after_the_rest_finished() -> None:
    finished = []

    def job(number: int) -> None:
        time.sleep(0.002)
        if number == 1:
            raise ValueError(f"job {number}")
        finished.append(number)

    jobs = [lambda number=number: job(number) for number in range(6)]
    with ThreadPoolExecutor(max_workers=2) as pool, pytest.raises(ValueError, match="job 1"):
        fetching.run_all(jobs, pool)
    assert 0 in finished


def test_an_ordered_read_failure_raises_an_earlier_requests_failure_first() -> None:
    """Reads run in order on the calling thread, finishes on the pool: read 5 fails while the finish of request 2
    (earlier) fails too; the earlier failure is raised, after everything running has finished."""
    requests = _requests([1] * 12)
    slots = [np.zeros(1, np.uint8) for _ in requests]
    reads: list[int] = []

    def read(request: ReadRequest, slot: np.ndarray) -> None:
        reads.append(request.start)
        if request.start == 5:
            raise OSError("read 5 failed")

    def finish(request: ReadRequest, slot: np.ndarray) -> None:
        time.sleep(0.002)
        if request.start == 2:
            raise ValueError("request 2 fails its checksum")

    with ThreadPoolExecutor(max_workers=2) as pool, pytest.raises(ValueError, match="request 2"):
        fetching.fetch_all(requests, slots, pool, read, finish, ordered=True)
    assert reads == [0, 1, 2, 3, 4, 5]  # no read after the failed one


def test_the_ordered_reader_announces_jumps_ahead_and_leaves_sequential_runs_to_read_ahead(
    tmp_path, monkeypatch
) -> None:
    """A resharded read (4 -> 3, the middle third) skips part of every piece: each request that does not follow
    on from the one before is hinted once, before it is read and within PREFETCH_AHEAD of the reader; a
    same-layout read is one sequential run and gets no hint."""
    hints: list[tuple[str, int, int]] = []
    events: list[tuple[str, str, int]] = []  # ("hint" | "read", path, start) in the order they happened
    real_prefetch, real_read = _LocalReader.prefetch, _LocalReader.read_into

    def recording_prefetch(self, path: str, start: int, length: int) -> None:
        hints.append((path, start, length))
        events.append(("hint", path, start))
        real_prefetch(self, path, start, length)

    def recording_read(self, path: str, start: int, out: memoryview) -> None:
        events.append(("read", path, start))
        real_read(self, path, start, out)

    monkeypatch.setattr(_LocalReader, "prefetch", recording_prefetch)
    monkeypatch.setattr(_LocalReader, "read_into", recording_read)
    generator = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(96, 4096, generator=generator) for i in range(6)}  # 1.5 MiB each
    url = str(tmp_path / "four")
    save_row_shards(url, state, 4)
    checkpoint = shardckpt.open(url, max_in_flight=4 << 20)
    items = [(name, shardckpt.Box((32, 0), (32, 4096)), torch.zeros(32, 4096)) for name in state]
    pending = checkpoint.prepare(items)
    requests = pending.plan.requests
    jumps = {
        (checkpoint.manifest.files[r.file].data, r.start, r.size)
        for before, r in zip(requests, requests[1:])
        if r.file != before.file or r.start != before.end
    }
    assert len(jumps) >= 6  # every piece of rank 1's file is read from its middle on
    pending.apply()
    for name, _, out in items:
        assert torch.equal(out, state[name][32:64]), name
    assert sorted(hints) == sorted(jumps)  # each jump hinted exactly once, nothing else
    for path, start, _ in hints:  # announced before it is read
        assert events.index(("hint", path, start)) < events.index(("read", path, start))
    hints.clear()
    whole = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
    shardckpt.save(state, str(tmp_path / "one"))
    shardckpt.load(whole, str(tmp_path / "one"))
    assert all(torch.equal(whole[name], state[name]) for name in state)
    assert hints == []


def _evict(path: str) -> None:
    """Drop a file's clean pages from the page cache (no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _cached_pages(path: str) -> int:
    """How many of a file's pages are in the page cache (mincore on a mapping: no read, no read-ahead)."""
    size = os.path.getsize(path)
    page = mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        try:
            vector = (ctypes.c_ubyte * ((size + page - 1) // page))()
            if libc.mincore(ctypes.c_void_p(address), size, vector) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            return sum(byte & 1 for byte in vector)
        finally:
            libc.munmap(ctypes.c_void_p(address), size)
    finally:
        os.close(fd)


def test_read_size_follows_where_the_bytes_are(tmp_path) -> None:
    """Bytes in the page cache are read in RESIDENT_MAX_REQUEST requests (a slot stays in a core's cache), bytes on
    disk in DEFAULT_MAX_REQUEST ones (a disk wants large reads); an explicit max_request always wins. Every read is
    bit-exact whichever size it used."""
    generator = torch.Generator().manual_seed(1)
    state = {f"t{i}": torch.randn(1024, 2048, generator=generator) for i in range(3)}  # 8 MiB each
    url = str(tmp_path / "ck")
    shardckpt.save(state, url)
    data = [str(path) for path in (tmp_path / "ck" / "data").iterdir()]
    storage = LocalStorage(url)
    places = [(f"data/{os.path.basename(path)}", offset) for path in data for offset in (0, 12 << 20)]

    def plan_and_read(**options) -> int:
        checkpoint = shardckpt.open(url, **options)
        items = [(name, shardckpt.Box((0, 0), tuple(t.shape)), torch.zeros_like(t)) for name, t in state.items()]
        pending = checkpoint.prepare(items)
        largest = max(request.size for request in pending.plan.requests)
        pending.apply()
        assert all(torch.equal(out, state[name]) for name, _, out in items)
        return largest

    # Checked with mincore, not storage.resident: a probe that misses starts the kernel's read-ahead there, which
    # could bring back the very pages the plan's own probe then finds (a flaky "resident").
    for path in data:
        _evict(path)
    assert [_cached_pages(path) for path in data] == [0] * len(data)
    assert plan_and_read() == DEFAULT_MAX_REQUEST  # on disk: large reads (and now cached)
    assert storage.resident(places) is True
    assert plan_and_read() == RESIDENT_MAX_REQUEST
    assert plan_and_read(max_request=4 << 20) == 4 << 20
    assert shardckpt.storage.open_storage("memory://resident-probe").resident(places) is None
