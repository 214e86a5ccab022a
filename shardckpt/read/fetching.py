"""Running a plan's range reads into one reused buffer, at most a byte budget of it in use, on worker threads.

Each request is read into a slot and finished (verified, copied out) while later requests are read, so disk,
checksums and copies overlap; slots are retired oldest first, which keeps the buffer a ring.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np
import numpy.typing as npt

from shardckpt.planner import ReadRequest

ByteArray = npt.NDArray[np.uint8]
Step = Callable[[ReadRequest, ByteArray], None]
PAGE = 4096


def allocate(size: int) -> ByteArray:
    """`size` bytes with every page faulted in once, so reads into them run at copy speed, not page-fault speed.

    numpy asks for transparent huge pages for allocations this large, which makes the first touch cheap too.
    """
    buffer = np.empty(size, dtype=np.uint8)
    buffer[::PAGE] = 0
    return buffer


def ring_size(requests: Sequence[ReadRequest], budget: int, workers: int) -> int:
    """Bytes of buffer a streamed read of `requests` needs: a slot per worker and one more, so a worker never
    waits for a slot (more only costs the first touch), within the budget and all the requests together; always
    room for the largest request (which then runs alone)."""
    if not requests:
        return 0
    largest = max(request.size for request in requests)
    total = sum(request.size for request in requests)
    return max(largest, min(budget, total, (workers + 1) * largest))


def stream(
    requests: Sequence[ReadRequest],
    buffer: ByteArray,
    budget: int,
    pool: ThreadPoolExecutor,
    read: Step,
    finish: Step,
    *,
    ordered: bool = False,
    prefetch: Callable[[int], None] | None = None,
) -> None:
    """read(request, slot), then finish(request, slot), for every request; each slot a slice of `buffer`.

    Slots in use (read, not yet finished) hold at most `budget` bytes together, except that a larger request runs
    alone. ordered: this thread reads every request, one after another in order (a disk streams one sequential
    reader fastest, and its read-ahead sees it), and the pool finishes them; otherwise each pool job reads and
    finishes one request. prefetch(number): called before each ordered read with the request's number.
    On the first failure (in request order) nothing more starts, everything running is awaited (nothing runs
    after this returns or raises), and the failure propagates.
    """
    active: deque[tuple[Future[None], int, int]] = deque()
    head = in_use = 0

    def place(size: int) -> int | None:
        if active and in_use + size > budget:
            return None
        for start in (head, 0):
            end = start + size
            if end <= buffer.size and all(end <= lo or start >= lo + n for _, lo, n in active):
                return start
        return None

    def both(request: ReadRequest, slot: ByteArray) -> None:
        read(request, slot)
        finish(request, slot)

    try:
        for number, request in enumerate(requests):
            size = request.size
            if size > buffer.size:
                raise ValueError(f"a request of {size} bytes does not fit a buffer of {buffer.size}")
            while (start := place(size)) is None:
                future, _, freed = active.popleft()
                in_use -= freed
                future.result()
            slot = buffer[start : start + size]
            if ordered:
                if prefetch is not None:
                    prefetch(number)
                _read_after(read, request, slot, [future for future, _, _ in active])
            future = pool.submit(finish if ordered else both, request, slot)
            active.append((future, start, size))
            head, in_use = start + size, in_use + size
        while active:
            active.popleft()[0].result()
    finally:
        _abandon([future for future, _, _ in active])


def fetch_all(
    requests: Sequence[ReadRequest],
    slots: Sequence[ByteArray],
    pool: ThreadPoolExecutor,
    read: Step,
    finish: Step,
    *,
    ordered: bool = False,
) -> None:
    """stream() with a slot of its own for every request (nothing reused, no budget)."""
    futures: list[Future[None]] = []

    def both(request: ReadRequest, slot: ByteArray) -> None:
        read(request, slot)
        finish(request, slot)

    try:
        for request, slot in zip(requests, slots, strict=True):
            if ordered:
                _read_after(read, request, slot, futures)
            futures.append(pool.submit(finish if ordered else both, request, slot))
        for future in futures:
            future.result()
    finally:
        _abandon(futures)


def run_all(jobs: Sequence[Callable[[], None]], pool: ThreadPoolExecutor) -> None:
    """Run every job on the pool; on the first failure (in job order) start no more, await the running, raise."""
    futures = [pool.submit(job) for job in jobs]
    try:
        for future in futures:
            future.result()
    finally:
        _abandon(futures)


def _read_after(read: Step, request: ReadRequest, slot: ByteArray, earlier: Sequence[Future[None]]) -> None:
    """read(request, slot) here; if it fails, an earlier request's failure (if any) is the one to raise."""
    try:
        read(request, slot)
    except BaseException:
        wait(earlier)
        for future in earlier:
            if future.exception() is not None:
                future.result()
        raise


def _abandon(futures: Sequence[Future[None]]) -> None:
    """Cancel what has not started and await everything running."""
    for future in futures:
        future.cancel()
    wait(futures)
