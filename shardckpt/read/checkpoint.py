"""Opening a committed checkpoint and reading any box of any tensor into torch tensors, verifying every byte.

open() checks COMMITTED and the manifest's checksum (catalog/chain.py); reads go planner -> coalesced range reads
(concurrent, bounded bytes in flight, into one reused buffer) -> block checksums from the file's local manifest
(catalog/stored.py) -> strided copies into destinations.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from shardckpt import knobs
from shardckpt.catalog.chain import read_opening
from shardckpt.catalog.stored import StoredCheckpoint
from shardckpt.errors import (
    IntegrityError,
    ShardckptUsageError,
    TruncatedError,
)
from shardckpt.format.bulk import gc_paused
from shardckpt.format.dtypes import itemsize
from shardckpt.format.manifest import (
    CommitMarker,
    GlobalManifest,
    TensorEntry,
)
from shardckpt.planner import Box, ReadPlan, ReadRequest, Target
from shardckpt.planner.box import indices
from shardckpt.planner.execute import apply_copies
from shardckpt.planner.plan import ReadPlanner
from shardckpt.read import fetching
from shardckpt.storage import RangeReader, Storage, open_storage
from shardckpt.torch_bytes import check_destination, host_staging, torch_dtype, writable_bytes

ByteArray = npt.NDArray[np.uint8]


class TensorInfo(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


@dataclass(frozen=True)
class ReadStats:
    """What a read cost. needed_bytes is logical (the bytes the destinations hold, as if stored raw); fetched_bytes
    is what storage sent: the stored (compressed) bytes of a compressed file's blocks, so it is what S3 bills and the
    link carries, and may be smaller than needed_bytes (SPEC 4.1)."""

    needed_bytes: int
    fetched_bytes: int
    requests: int
    seconds: float


RESIDENT_PROBES = 8  # requests probed to decide whether a plan's bytes are in memory already

# How far past the request being read the ordered reader announces ranges that do not follow on (a disk serves a
# jump at full speed only when it is asked early; sequential runs are left to the kernel's own read-ahead).


class Checkpoint(StoredCheckpoint):
    """A committed checkpoint opened for reading. Use `shardckpt.open(url)`.

    It keeps one read buffer for its lifetime (a few requests' worth, never more than max_in_flight or the largest
    request): faulted in once, reused by every read, so reads do not pay page faults on fresh memory.
    """

    def __init__(
        self,
        storage: Storage,
        marker: CommitMarker,
        manifest: GlobalManifest,
        *,
        max_in_flight: int | None = None,
        max_gap: int | None = None,
        max_request: int | None = None,
    ) -> None:
        """max_request: the largest range read; None picks it per read (knobs.MAX_REQUEST from storage,
        knobs.RESIDENT_MAX_REQUEST when the storage says the bytes are in memory already)."""
        super().__init__(storage, marker, manifest)
        # Read here, not as default arguments at import: a malformed read knob must not fail a save.
        max_in_flight = knobs.MAX_IN_FLIGHT if max_in_flight is None else max_in_flight
        max_gap = knobs.MAX_GAP if max_gap is None else max_gap
        check_read_limits(max_in_flight, max_gap, max_request)
        self.max_in_flight, self.max_gap, self.max_request = max_in_flight, max_gap, max_request
        self._buffer: ByteArray | None = None  # the read buffer, faulted in once and reused by every read
        self._buffer_busy = False

    # ------------------------------------------------------------------------------------- description

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        return {e.name: TensorInfo(e.shape, torch_dtype(e.dtype), e.nbytes) for e in self.manifest.tensors}

    # --------------------------------------------------------------------------------------- planning

    def plan(self, wanted: Mapping[str, Sequence[tuple[Sequence[int], Sequence[int]]]]) -> ReadPlan:
        """Plan reads of {name: [(offsets, shape), ...]}: which byte ranges of which files, nothing else.

        The ranges are logical: in a compressed file (format 1.2, SPEC 4.1) they are offsets into the file as if it
        were stored raw, and the bytes fetched are the stored blocks that cover them (`stored_bytes(plan)` counts
        those; ReadStats.fetched_bytes of a read counts them too, needed_bytes the logical bytes)."""
        targets = [
            Target(name, self._box(name, self.entry(name).shape, offsets, shape))
            for name, boxes in wanted.items()
            for offsets, shape in boxes
        ]
        return self._plan(targets)

    def _plan(self, targets: Sequence[Target], entries: Mapping[str, TensorEntry] | None = None) -> ReadPlan:
        """entries: those of the targets' tensors, when the caller has them checked already."""
        if entries is None:
            entries = {t.name: self.entry(t.name) for t in targets}
        planner = ReadPlanner(entries, targets, block_size=self.manifest.block_size, max_gap=self.max_gap)
        if self.max_request is not None:
            return planner.plan(planner.layout(self.max_request))
        # Where the requests fall is known before the plan's objects are built: probe there, lay out once more if
        # the bytes are in memory, and build the plan once.
        layout = planner.layout(knobs.MAX_REQUEST)
        if len(layout.groups) > 1 and self._resident(layout.requests):
            layout = planner.layout(knobs.RESIDENT_MAX_REQUEST)
        return planner.plan(layout)

    def _resident(self, requests: Sequence[tuple[int, int, int]]) -> bool:
        """Whether the bytes of requests (file, start, end) are in memory already, judged by probing the start and
        middle of up to RESIDENT_PROBES of them, spread over the plan."""
        step = max(1, len(requests) // RESIDENT_PROBES)
        places = [
            (self.source(file)[1], at) for file, start, end in requests[::step] for at in (start, (start + end) // 2)
        ]
        return self.data_storage.resident(places) is True

    # ---------------------------------------------------------------------------------------- reading

    @staticmethod
    def _box(name: str, stored: tuple[int, ...], offsets: Sequence[int] | None, shape: Sequence[int] | None) -> Box:
        """The box a caller asked for of tensor `name` (shape `stored`), checked: integers only (a float offset
        such as n / 2 was truncated into a silently wrong slice), as many as the tensor has dimensions, within it.
        shape None: to the end of every dimension."""
        at = indices(offsets, f"tensor {name!r}: offsets") if offsets is not None else (0,) * len(stored)
        size = (
            indices(shape, f"tensor {name!r}: shape") if shape is not None else tuple(d - o for d, o in zip(stored, at))
        )
        if len(at) != len(stored) or len(size) != len(stored):
            raise ShardckptUsageError(
                f"tensor {name!r} has {len(stored)} dimensions; offsets {list(at)} and shape {list(size)} must have "
                "as many"
            )
        if any(o < 0 or s < 0 or o + s > d for o, s, d in zip(at, size, stored)):
            raise ShardckptUsageError(
                f"tensor {name!r} of shape {list(stored)}: offsets {list(at)} and shape {list(size)} must be "
                "non-negative and end within it"
            )
        return Box(at, size)

    def read(self, name: str, offsets: Sequence[int] | None = None, shape: Sequence[int] | None = None) -> torch.Tensor:
        """Box (`offsets`, `shape`) of tensor `name` (default: all of it) as a new tensor, bit-exact."""
        began = time.perf_counter()
        entry = self.entry(name)
        box = self._box(name, entry.shape, offsets, shape)
        # Plan and check the chain (local manifests, data sizes, piece identity) before allocating what the
        # manifest declares: a hostile size then fails as the lie it is, not as an allocation.
        self._check_pieces(entry, box)
        plan = self._plan([Target(name, box)])
        self.preflight(plan)
        out = _allocate(name, box.shape, entry.dtype)
        view = writable_bytes(out)
        PendingRead(self, plan, [view if view is not None else np.zeros(0, np.uint8)], [], began).apply()
        return out

    def read_into(self, items: Sequence[tuple[str, Box, torch.Tensor]], *, verify_first: bool = False) -> ReadStats:
        """Fill each destination tensor with box `Box` of its tensor; all reads planned and coalesced together.

        No destination byte is written before every destination, the coverage of every tensor read and every local
        manifest the reads need are checked, and no byte is copied before its block's checksum is. verify_first:
        fetch and verify every byte before writing any (holds the fetched bytes, about the destinations' size, in
        memory); otherwise each read request is copied once all its blocks verify, and a failure leaves earlier
        copies.
        """
        pending = self.prepare(items)
        if verify_first:
            pending.fetch()
        return pending.apply()

    @gc_paused()  # builds and checks objects for every tensor: see format/bulk.py
    def prepare(self, items: Sequence[tuple[str, Box, torch.Tensor]], *, cast: bool = False) -> PendingRead:
        """Plan a read into destination tensors and check everything but the data bytes; writes nothing.

        cast: a floating-point destination of another floating-point dtype than the stored one is filled by reading
        the stored values into host staging of their own dtype (extra memory: that box) and converting them with
        torch's copy_ (round to nearest even; values beyond the range become inf). Destinations whose dtype matches
        are read as without cast, bit-exact.
        """
        began = time.perf_counter()
        targets, buffers, fixups = [], [], []
        entries = self.entries([name for name, _, _ in items])
        for name, box, tensor in items:
            check_destination(name, tensor)
            if any(type(v) is not int for v in box.offsets + box.shape):  # a Box the caller built: of numpy ints?
                box = Box(
                    indices(box.offsets, f"tensor {name!r}: box offsets"),
                    indices(box.shape, f"tensor {name!r}: box shape"),
                )
            stored = torch_dtype(entries[name].dtype)
            if tensor.shape != box.shape:
                raise ShardckptUsageError(
                    f"tensor {name!r}: destination has shape {list(tensor.shape)}, the box {box} it is to hold has "
                    f"shape {list(box.shape)}"
                )
            converts = tensor.dtype != stored
            if converts and not (cast and tensor.dtype.is_floating_point and stored.is_floating_point):
                hint = (
                    "; load(..., cast=True) converts between floating-point dtypes"
                    if tensor.dtype.is_floating_point and stored.is_floating_point
                    else " (cast=True converts floating-point dtypes only)"
                )
                raise ShardckptUsageError(
                    f"tensor {name!r}: destination is {tensor.dtype}, the checkpoint holds {stored}{hint}"
                )
            view = None if converts else writable_bytes(tensor)
            if view is None:  # GPU (pinned staging), non-contiguous, empty or cast: read into host memory, copy once
                staging = host_staging(box.shape, stored, tensor.device)
                view = writable_bytes(staging)
                fixups.append((tensor, staging))
            targets.append(Target(name, box))
            buffers.append(view if view is not None else np.zeros(0, np.uint8))
        plan = self._plan(targets, entries)
        self.preflight(plan)
        return PendingRead(self, plan, buffers, fixups, began)

    def execute(self, plan: ReadPlan, destinations: Sequence[ByteArray]) -> None:
        """Fetch the plan's requests, at most max_in_flight bytes at a time; verify each, then copy it."""
        self.preflight(plan)
        self.stream(plan, destinations)

    def stream(self, plan: ReadPlan, destinations: Sequence[ByteArray]) -> None:
        """execute() without the preflight (done already): fetch, verify and copy, at most max_in_flight bytes
        fetched and not yet copied (a larger request alone).

        Worker threads each read a request into a slot of one reused buffer, verify it and copy it out while the
        next requests are read. Batched backends (object stores) fetch whole waves instead, then verify and copy.
        """
        if self.data_storage.batched_reads:
            for wave in self.waves(plan):
                for request, fetched in self.fetch_wave(wave):
                    self.copy(request, fetched, destinations)
            return

        def finish(request: ReadRequest, slot: ByteArray) -> None:
            self.verify(request, slot)
            self.copy(request, slot, destinations)  # this request's blocks all matched their checksums

        workers = self._workers(len(plan.requests))
        ordered = self.data_storage.ordered_reads
        # Ordered: this thread reads while the workers finish, so the ring holds a slot for it too.
        size = fetching.ring_size(plan.requests, self.max_in_flight, workers + ordered)
        with (
            self.data_storage.reader() as reader,
            self._read_buffer(size) as buffer,
            ThreadPoolExecutor(max_workers=workers) as pool,
        ):
            read = functools.partial(self.read_request, reader)
            requests = plan.requests
            hinted = [0]  # requests up to this number have been hinted (or need no hint)
            prefetch_ahead = knobs.PREFETCH_AHEAD

            def prefetch(number: int) -> None:
                """Hint the requests within PREFETCH_AHEAD bytes after this one that jump (read-ahead misses them)."""
                ahead, following = 0, number + 1
                while following < len(requests) and ahead < prefetch_ahead:
                    if following > hinted[0]:
                        before, request = requests[following - 1], requests[following]
                        if request.file != before.file or request.start != before.end:
                            reader.prefetch(self.source(request.file)[1], request.start, request.size)
                        hinted[0] = following
                    ahead += requests[following].size
                    following += 1

            fetching.stream(
                plan.requests, buffer, self.max_in_flight, pool, read, finish, ordered=ordered, prefetch=prefetch
            )

    def preflight(self, plan: ReadPlan) -> None:
        """Read and check every local manifest the plan needs and find each piece there, before any data byte."""
        files = sorted({request.file for request in plan.requests})
        with ThreadPoolExecutor(max_workers=max(1, min(self.storage.read_threads, len(files)))) as pool:
            list(pool.map(self.file_index, files))
            list(pool.map(self._check_data_size, files))
        by_file: dict[int, list[tuple[str, int]]] = {}
        for request in plan.requests:
            spans = by_file.setdefault(request.file, [])
            spans.extend((span.tensor, span.piece) for span in request.verify)
        for file, spans in by_file.items():
            self.check_positions(file, spans)

    def waves(self, plan: ReadPlan) -> Iterator[list[ReadRequest]]:
        """The plan's requests in groups of at most max_in_flight bytes (a larger request alone)."""
        wave: list[ReadRequest] = []
        in_flight = 0
        for request in plan.requests:
            if wave and in_flight + request.size > self.max_in_flight:
                yield wave
                wave, in_flight = [], 0
            wave.append(request)
            in_flight += request.size
        if wave:
            yield wave

    def fetch_wave(self, wave: list[ReadRequest]) -> list[tuple[ReadRequest, ByteArray]]:
        """Read a wave's ranges concurrently and verify every block of them; nothing is copied. Compressed ranges are
        decoded on threads as they arrive, while the rest of the wave is still on the wire (over a link that is the
        limit, decoding after the whole wave cost a 1.02x load time for 0.82x the bytes)."""
        decoding: dict[int, Future[ByteArray]] = {}
        compressed = [self.is_compressed(request.file) for request in wave]
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        pool = ThreadPoolExecutor(min(4, cores), "shardckpt-decode") if sum(compressed) > 1 else None

        def arrived(number: int, blob: bytes) -> None:
            if pool is not None and compressed[number]:
                decoding[number] = pool.submit(self._verified_blob, wave[number], blob)

        try:
            try:
                blobs = self.data_storage.read_ranges(
                    [(self.source(r.file)[1], *self._stored(r)) for r in wave], arrived
                )
            except TruncatedError as exc:
                names = sorted({span.tensor for r in wave for span in r.verify})
                raise IntegrityError(f"{exc} while reading tensors {names[:5]}") from exc
            return [
                (request, decoding[n].result() if n in decoding else self._verified_blob(request, blob))
                for n, (request, blob) in enumerate(zip(wave, blobs))
            ]
        finally:
            if pool is not None:
                pool.shutdown(cancel_futures=True)

    def _verified_blob(self, request: ReadRequest, blob: bytes) -> ByteArray:
        """A request's fetched bytes, verified (and decompressed, from a compressed file), or IntegrityError."""
        start, end = self._stored(request)
        if len(blob) != end - start:
            raise IntegrityError(
                f"{self.describe_file(request.file)}: short read of bytes {start}:{end} (got {len(blob)})"
            )
        fetched = np.frombuffer(blob, dtype=np.uint8)
        if self.is_compressed(request.file):
            stored, fetched = fetched, np.empty(request.size, dtype=np.uint8)
            self.decode_range(request.file, request.verify, stored, start, fetched, request.start)
        else:
            self.verify(request, fetched)
        return fetched

    def _stored(self, request: ReadRequest) -> tuple[int, int]:
        """The file bytes a request reads: its own range, or the stored blocks behind it in a compressed file."""
        if self.is_compressed(request.file):
            return self.stored_range(request.file, request.verify)
        return request.start, request.end

    def stored_bytes(self, plan: ReadPlan) -> int:
        """The file bytes the plan's requests read from storage: its fetch_bytes, with the stored size of the blocks
        behind each request of a compressed file in place of the request's logical size."""
        return sum(end - start for start, end in map(self._stored, plan.requests))

    def read_request(self, reader: RangeReader, request: ReadRequest, slot: ByteArray) -> None:
        """Read one request's bytes into `slot` (request.size bytes) through `reader`; nothing is verified yet."""
        path = self.source(request.file)[1]
        compressed = self.is_compressed(request.file)
        start, end = self._stored(request)
        # A compressed request's stored bytes go to the end of its slot, and decompress into it from the start.
        into = slot[slot.size - (end - start) :] if compressed else slot
        try:
            reader.read_into(path, start, into.data)
        except TruncatedError as exc:
            names = sorted({span.tensor for span in request.verify})
            raise IntegrityError(f"{exc} while reading tensors {names[:5]}") from exc
        if compressed:  # checked (both checksums) while decompressing: verify() has nothing left to do
            self.decode_range(request.file, request.verify, into, start, slot, request.start)

    def verify(self, request: ReadRequest, fetched: ByteArray) -> None:
        """Check every block of a request's bytes against its checksum; IntegrityError on the first mismatch."""
        if self.is_compressed(request.file):
            return  # read_request checked every block it decompressed
        for span in request.verify:
            self._verify(request.file, span, fetched, request.start)

    @staticmethod
    def copy(request: ReadRequest, fetched: ByteArray, destinations: Sequence[ByteArray]) -> None:
        apply_copies(request.copies, fetched, request.start, destinations)

    def _workers(self, jobs: int) -> int:
        """Threads for `jobs` reads: the backend's read concurrency, but no more than the cores left for checksums
        and copies (extra threads only contend for them and for the GIL); with ordered reads, the reading thread
        keeps a core busy itself."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        storage = self.data_storage
        return max(1, min(storage.read_threads, cores - storage.ordered_reads, jobs))

    def worker_pool(self, jobs: int) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(max_workers=self._workers(jobs))

    @contextlib.contextmanager
    def _read_buffer(self, size: int) -> Iterator[ByteArray]:
        """This checkpoint's read buffer (grown to `size` bytes if smaller), or a private one while it is in use."""
        with self._lock:
            buffer, busy = self._buffer, self._buffer_busy
            self._buffer_busy = True
        if busy:
            yield fetching.allocate(size)
            return
        try:
            if buffer is None or buffer.size < size:
                buffer = self._buffer = None  # free the old one before touching the new one
                buffer = self._buffer = fetching.allocate(size)
            yield buffer[:size]
        finally:
            with self._lock:
                self._buffer_busy = False


def _allocate(name: str, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    """A host tensor for a read; an allocation failure is a typed error naming the tensor and the size."""
    nbytes = math.prod(shape) * itemsize(dtype)
    try:
        return torch.empty(shape, dtype=torch_dtype(dtype))
    except (RuntimeError, MemoryError) as exc:
        raise ShardckptUsageError(
            f"tensor {name!r}: cannot allocate {list(shape)} {dtype} ({nbytes} bytes): {exc}"
        ) from None


class PendingRead:
    """A checked, planned read into destination tensors (from Checkpoint.prepare); nothing written yet.

    fetch(): read and verify every byte, keeping them, still writing no destination. apply(): write the
    destinations (from the kept bytes, or fetching, verifying and copying wave by wave when fetch() was not called).
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        plan: ReadPlan,
        buffers: list[ByteArray],
        fixups: list[tuple[torch.Tensor, torch.Tensor]],
        began: float,
    ) -> None:
        self.checkpoint, self.plan, self._buffers, self._fixups, self._began = checkpoint, plan, buffers, fixups, began
        self._fetched: list[tuple[ReadRequest, ByteArray]] | None = None

    @property
    def fetched(self) -> bool:
        """Whether every byte of the plan is fetched and verified already (fetch() or use())."""
        return self._fetched is not None

    def use(self, fetched: Sequence[tuple[ReadRequest, ByteArray]]) -> None:
        """Take the plan's requests fetched and verified elsewhere (a shared read) instead of fetching them."""
        if [request for request, _ in fetched] != list(self.plan.requests):
            raise ValueError("use() takes exactly the plan's requests, in order")
        self._fetched = list(fetched)

    def fetch(self) -> None:
        checkpoint, requests = self.checkpoint, self.plan.requests
        fetched: list[tuple[ReadRequest, ByteArray]] = []
        if checkpoint.data_storage.batched_reads:
            for wave in checkpoint.waves(self.plan):
                fetched.extend(checkpoint.fetch_wave(wave))
        else:  # one buffer for everything (kept until apply), filled and verified by the workers
            buffer = fetching.allocate(sum(request.size for request in requests))
            position = 0
            for request in requests:
                fetched.append((request, buffer[position : position + request.size]))
                position += request.size
            slots, ordered = [slot for _, slot in fetched], checkpoint.data_storage.ordered_reads
            with checkpoint.data_storage.reader() as reader, checkpoint.worker_pool(len(fetched)) as pool:
                read = functools.partial(checkpoint.read_request, reader)
                fetching.fetch_all(requests, slots, pool, read, checkpoint.verify, ordered=ordered)
        self._fetched = fetched

    @gc_paused()
    def apply(self, fetch: Callable[[fetching.Step], object] | None = None) -> ReadStats:
        """Write the destinations. fetch(finish): another way to get the bytes (a shared read), which calls
        finish(request, bytes) for each request once its bytes are verified; finish copies them out."""
        if fetch is not None:
            buffers, copy = self._buffers, self.checkpoint.copy
            fetch(lambda request, data: copy(request, data, buffers))
        elif self._fetched is None:
            self.checkpoint.stream(self.plan, self._buffers)
        else:
            fetched, self._fetched = self._fetched, None
            with self.checkpoint.worker_pool(len(fetched)) as pool:
                copy, buffers = self.checkpoint.copy, self._buffers
                fetching.run_all([functools.partial(copy, request, data, buffers) for request, data in fetched], pool)
        for tensor, staging in self._fixups:
            tensor.copy_(staging)
        plan = self.plan
        stored = self.checkpoint.stored_bytes(plan)
        return ReadStats(plan.needed_bytes, stored, len(plan.requests), time.perf_counter() - self._began)


def _count(name: str, value: object, low: int) -> int:
    """`value` as an int >= low (not a bool, a float or a string), else a ShardckptUsageError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ShardckptUsageError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def check_read_limits(max_in_flight: object, max_gap: object, max_request: object = None) -> None:
    """Refuse a read's limits that would make no sense or crawl: max_in_flight < 1 byte, max_gap < 0, max_request
    (None: chosen per read) under knobs.MIN_REQUEST."""
    _count("max_in_flight", max_in_flight, 1)
    _count("max_gap", max_gap, 0)
    if max_request is not None:
        _count("max_request", max_request, knobs.MIN_REQUEST)


def open_checkpoint(
    url: str | Storage,
    *,
    storage_options: dict[str, Any] | None = None,
    max_in_flight: int | None = None,
    max_gap: int | None = None,
    max_request: int | None = None,
    head_only: bool = False,
) -> Checkpoint:
    """Open the committed checkpoint at `url`; NotCommittedError if it has no COMMITTED marker.

    head_only: of a manifest with a piece index (SPEC 11.1) read only the head; Checkpoint.need(names) then reads
    the entries of the tensors a load wants (its other tensors are unknown to it)."""
    storage = open_storage(url, storage_options)
    opening = read_opening(storage, head_only=head_only)
    checkpoint = Checkpoint(
        storage,
        opening.marker,
        opening.manifest,
        max_in_flight=max_in_flight,
        max_gap=max_gap,
        max_request=max_request,
    )
    checkpoint.check_referenced()  # SPEC 8 step 2a at open: a reference to an uncommitted checkpoint fails here
    return checkpoint
