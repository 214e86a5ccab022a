"""Opening a committed checkpoint and reading any box of any tensor, verifying every byte it reads.

open() checks COMMITTED and the manifest's checksum; reads go planner -> coalesced range reads (concurrent,
bounded bytes in flight) -> block checksums from the file's local manifest -> strided copies into destinations.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import crc32c
import numpy as np
import numpy.typing as npt
import torch

from shardckpt.errors import (
    FormatError,
    IntegrityError,
    NotCommittedError,
    NotFoundError,
    ShardckptUsageError,
    StorageError,
    TruncatedError,
)
from shardckpt.format import layout, limits
from shardckpt.format.local_manifest import LocalManifest, decode_local_manifest
from shardckpt.format.manifest import (
    CommitMarker,
    GlobalManifest,
    TensorEntry,
    crc32c_of,
    decode_commit_marker,
    decode_global_manifest,
)
from shardckpt.planner import Box, ReadPlan, ReadRequest, Target, VerifySpan, check_cover, plan_reads
from shardckpt.planner.box import box_as_flat_range
from shardckpt.planner.execute import apply_copy
from shardckpt.planner.plan import DEFAULT_MAX_GAP, DEFAULT_MAX_REQUEST
from shardckpt.storage import Storage, open_storage
from shardckpt.torch_bytes import host_staging, torch_dtype, writable_bytes

DEFAULT_MAX_IN_FLIGHT = 256 << 20
ByteArray = npt.NDArray[np.uint8]


class TensorInfo(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


@dataclass(frozen=True)
class ReadStats:
    needed_bytes: int
    fetched_bytes: int
    requests: int
    seconds: float


def read_marker_bytes(storage: Storage) -> bytes | None:
    """The raw COMMITTED marker, or None when the checkpoint is not committed."""
    try:
        return storage.read_small(layout.COMMITTED, limits.MAX_COMMIT_MARKER_BYTES)
    except NotFoundError:
        return None


def read_commit_marker(storage: Storage) -> CommitMarker | None:
    raw = read_marker_bytes(storage)
    return None if raw is None else decode_commit_marker(raw, storage.describe(layout.COMMITTED))


def read_global_manifest(storage: Storage, marker: CommitMarker) -> GlobalManifest:
    """The manifest COMMITTED points at, after checking its size and CRC32C against the marker."""
    raw = storage.read_small(marker.manifest, limits.MAX_GLOBAL_MANIFEST_BYTES)
    return verify_global_manifest(raw, marker, storage.describe(marker.manifest))


def verify_global_manifest(raw: bytes, marker: CommitMarker, where: str) -> GlobalManifest:
    """Check manifest bytes (read here or received from a peer) against COMMITTED, then decode them."""
    if len(raw) != marker.manifest_size or crc32c_of(raw) != marker.manifest_crc32c:
        raise IntegrityError(
            f"{where}: {len(raw)} bytes with CRC32C {crc32c_of(raw):#010x}, but COMMITTED promises "
            f"{marker.manifest_size} bytes with CRC32C {marker.manifest_crc32c:#010x}"
        )
    manifest = decode_global_manifest(raw, where)
    if (manifest.attempt, manifest.world_size, manifest.step) != (marker.attempt, marker.world_size, marker.step):
        raise FormatError(
            f"{where}: attempt {manifest.attempt}, {manifest.world_size} ranks, step {manifest.step} disagree with "
            f"COMMITTED (attempt {marker.attempt}, {marker.world_size} ranks, step {marker.step})"
        )
    return manifest


class FileIndex:
    """One data file's local manifest as a lookup: piece offsets (file order), sizes, first block, checksums."""

    def __init__(self, local: LocalManifest) -> None:
        self.local = local
        self.offsets, self.sizes, self.crcs = local.pieces.offset, local.pieces.nbytes, local.crc32c
        blocks = -(-self.sizes // local.block_size)
        self.first_block = np.concatenate([[0], np.cumsum(blocks)[:-1]]).astype(np.int64) if blocks.size else blocks

    def find(self, entry: TensorEntry, piece: int) -> int | str:
        """Position of piece `piece` of `entry` in this file, or why the local manifest does not hold it."""
        offset = int(entry.pieces.offset[piece])
        position = int(np.searchsorted(self.offsets, offset))
        if position >= self.offsets.size or self.offsets[position] != offset:
            return f"the local manifest has no piece at byte {offset}"
        spec = self.local.tensors[int(self.local.pieces.tensor[position])]
        first = int(self.local.pieces.position[position])
        start = tuple(self.local.pieces.start[first : first + spec.k].tolist())
        length = tuple(self.local.pieces.length[first : first + spec.k].tolist())
        if spec.layout != entry.layout:  # stored as a box by this rank, described as an element range globally
            flat = box_as_flat_range(spec.shape, start, length)
            start, length = ((flat[0],), (flat[1],)) if flat else (start, length)
        wanted = (tuple(entry.pieces.start[piece].tolist()), tuple(entry.pieces.length[piece].tolist()))
        if (spec.name, spec.dtype, spec.shape, start, length) != (entry.name, entry.dtype, entry.shape, *wanted):
            return (
                f"the piece at byte {offset} is {spec.name!r} {spec.dtype} {list(spec.shape)} start {list(start)} "
                f"length {list(length)} in the local manifest, but start {list(wanted[0])} length "
                f"{list(wanted[1])} of {entry.name!r} {entry.dtype} {list(entry.shape)} in the global manifest"
            )
        return position


class Checkpoint:
    """A committed checkpoint opened for reading. Use `shardckpt.open(url)`."""

    def __init__(
        self,
        storage: Storage,
        marker: CommitMarker,
        manifest: GlobalManifest,
        *,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        max_gap: int = DEFAULT_MAX_GAP,
        max_request: int = DEFAULT_MAX_REQUEST,
    ) -> None:
        self.storage, self.marker, self.manifest = storage, marker, manifest
        self.url = storage.url
        self.max_in_flight, self.max_gap, self.max_request = max_in_flight, max_gap, max_request
        self._checked: set[str] = set()
        self._indexes: dict[int, FileIndex] = {}
        self._sized: set[int] = set()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------------- description

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        return {e.name: TensorInfo(e.shape, torch_dtype(e.dtype), e.nbytes) for e in self.manifest.tensors}

    @property
    def objects(self) -> dict[str, Any]:
        """Values shared by all ranks."""
        return {o.name: o.value for o in self.manifest.objects if o.rank is None}

    def rank_objects(self, rank: int) -> dict[str, Any]:
        """Values saved by `rank` for itself (RNG state and the like)."""
        return {o.name: o.value for o in self.manifest.objects if o.rank == rank}

    @property
    def step(self) -> int | None:
        return self.manifest.step

    def entry(self, name: str) -> TensorEntry:
        """The manifest entry of `name`, with its pieces range- and coverage-checked on first use."""
        entry = self.manifest.tensor(name)
        if entry is None:
            raise ShardckptUsageError(f"tensor {name!r} is not in {self.url}")
        if name not in self._checked:
            check_cover(name, entry.shape, entry.layout, entry.pieces.start, entry.pieces.length)
            self._checked.add(name)
        return entry

    # --------------------------------------------------------------------------------------- planning

    def plan(self, wanted: Mapping[str, Sequence[tuple[Sequence[int], Sequence[int]]]]) -> ReadPlan:
        """Plan reads of {name: [(offsets, shape), ...]}: which byte ranges of which files, nothing else."""
        targets = [
            Target(name, Box(tuple(int(o) for o in offsets), tuple(int(s) for s in shape)))
            for name, boxes in wanted.items()
            for offsets, shape in boxes
        ]
        return self._plan(targets)

    def _plan(self, targets: Sequence[Target]) -> ReadPlan:
        entries = {t.name: self.entry(t.name) for t in targets}
        return plan_reads(
            entries,
            targets,
            block_size=self.manifest.block_size,
            max_gap=self.max_gap,
            max_request=self.max_request,
        )

    # ---------------------------------------------------------------------------------------- reading

    def read(self, name: str, offsets: Sequence[int] | None = None, shape: Sequence[int] | None = None) -> torch.Tensor:
        """Box (`offsets`, `shape`) of tensor `name` (default: all of it) as a new tensor, bit-exact."""
        entry = self.entry(name)
        box_offsets = tuple(offsets) if offsets is not None else (0,) * len(entry.shape)
        box_shape = tuple(shape) if shape is not None else tuple(d - o for d, o in zip(entry.shape, box_offsets))
        out = torch.empty(box_shape, dtype=torch_dtype(entry.dtype))
        self.read_into([(name, Box(box_offsets, box_shape), out)])
        return out

    def read_into(self, items: Sequence[tuple[str, Box, torch.Tensor]], *, verify_first: bool = False) -> ReadStats:
        """Fill each destination tensor with box `Box` of its tensor; all reads planned and coalesced together.

        No destination byte is written before every destination, the coverage of every tensor read and every local
        manifest the reads need are checked, and no byte is copied before its block's checksum is. verify_first:
        fetch and verify every byte before writing any (holds the fetched bytes, about the destinations' size, in
        memory); otherwise bytes are copied as each wave of reads verifies, and a failure leaves earlier copies.
        """
        pending = self.prepare(items)
        if verify_first:
            pending.fetch()
        return pending.apply()

    def prepare(self, items: Sequence[tuple[str, Box, torch.Tensor]]) -> PendingRead:
        """Plan a read into destination tensors and check everything but the data bytes; writes nothing."""
        began = time.perf_counter()
        targets, buffers, fixups = [], [], []
        for name, box, tensor in items:
            entry = self.entry(name)
            if tuple(tensor.shape) != box.shape or tensor.dtype != torch_dtype(entry.dtype):
                raise ShardckptUsageError(
                    f"tensor {name!r}: destination is {tensor.dtype} {list(tensor.shape)}, the checkpoint holds "
                    f"{torch_dtype(entry.dtype)} and the box {box} has shape {list(box.shape)}"
                )
            view = writable_bytes(tensor)
            if view is None:  # GPU (pinned staging), non-contiguous or empty: read into host memory, copy once
                staging = host_staging(box.shape, tensor.dtype, tensor.device)
                view = writable_bytes(staging)
                fixups.append((tensor, staging))
            targets.append(Target(name, box))
            buffers.append(view if view is not None else np.zeros(0, np.uint8))
        plan = self._plan(targets)
        self.preflight(plan)
        return PendingRead(self, plan, buffers, fixups, began)

    def execute(self, plan: ReadPlan, destinations: Sequence[ByteArray]) -> None:
        """Fetch the plan's requests in waves of at most max_in_flight bytes; verify each wave, then copy it."""
        self.preflight(plan)
        self.stream(plan, destinations)

    def stream(self, plan: ReadPlan, destinations: Sequence[ByteArray]) -> None:
        """execute() without the preflight (done already): fetch, verify and copy wave by wave."""
        for wave in self.waves(plan):
            for request, fetched in self.fetch_wave(wave):
                self.copy(request, fetched, destinations)

    def preflight(self, plan: ReadPlan) -> None:
        """Read and check every local manifest the plan needs and find each piece there, before any data byte."""
        files = sorted({request.file for request in plan.requests})
        with ThreadPoolExecutor(max_workers=max(1, min(self.storage.read_threads, len(files)))) as pool:
            list(pool.map(self.file_index, files))
            list(pool.map(self._check_data_size, files))
        for request in plan.requests:
            for span in request.verify:
                self._position(request.file, span)

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
        """Read a wave's ranges concurrently and verify every block of them; nothing is copied."""
        files = self.manifest.files
        try:
            blobs = self.storage.read_ranges([(files[r.file].data, r.start, r.end) for r in wave])
        except TruncatedError as exc:
            names = sorted({span.tensor for r in wave for span in r.verify})
            raise IntegrityError(f"{exc} while reading tensors {names[:5]}") from exc
        fetched_wave = []
        for request, blob in zip(wave, blobs):
            if len(blob) != request.size:
                raise IntegrityError(
                    f"{self.storage.describe(files[request.file].data)}: short read of bytes "
                    f"{request.start}:{request.end} (got {len(blob)})"
                )
            fetched = np.frombuffer(blob, dtype=np.uint8)
            for span in request.verify:
                self._verify(request.file, span, fetched, request.start)
            fetched_wave.append((request, fetched))
        return fetched_wave

    @staticmethod
    def copy(request: ReadRequest, fetched: ByteArray, destinations: Sequence[ByteArray]) -> None:
        for copy in request.copies:
            apply_copy(copy, fetched, request.start, destinations[copy.target])

    # ------------------------------------------------------------------------------------- integrity

    def file_index(self, file: int) -> FileIndex:
        with self._lock:
            index = self._indexes.get(file)
        if index is None:
            index = self._load_index(file)
            with self._lock:
                self._indexes[file] = index
        return index

    def _load_index(self, file: int) -> FileIndex:
        entry = self.manifest.files[file]
        where = self.storage.describe(entry.index)
        raw = self.storage.read_small(entry.index, limits.MAX_LOCAL_MANIFEST_BYTES)
        if len(raw) != entry.index_size or crc32c_of(raw) != entry.index_crc32c:
            raise IntegrityError(
                f"{where}: {len(raw)} bytes with CRC32C {crc32c_of(raw):#010x}, but the global manifest promises "
                f"{entry.index_size} bytes with CRC32C {entry.index_crc32c:#010x}"
            )
        local = decode_local_manifest(raw, where)
        if (local.attempt, local.rank, local.world_size, local.data, local.data_size, local.block_size) != (
            self.manifest.attempt,
            entry.rank,
            self.manifest.world_size,
            entry.data,
            entry.data_size,
            self.manifest.block_size,
        ):
            raise FormatError(f"{where}: does not describe {entry.data} of attempt {self.manifest.attempt}")
        # decode_local_manifest checked that pieces are in file order, packed, and that checksums count right.
        return FileIndex(local)

    def _check_data_size(self, file: int) -> None:
        """A data file of another size than the manifest says is truncated or has grown: refuse it (once per file)."""
        if file in self._sized:
            return
        entry = self.manifest.files[file]
        actual = self.storage.size(entry.data)
        if actual != entry.data_size:
            kind = "truncated" if actual < entry.data_size else "has trailing bytes"
            raise IntegrityError(
                f"{self.storage.describe(entry.data)} {kind}: {actual} bytes, the manifest says {entry.data_size}"
            )
        with self._lock:
            self._sized.add(file)

    def _position(self, file: int, span: VerifySpan) -> int:
        position = self.file_index(file).find(self.entry(span.tensor), span.piece)
        if isinstance(position, str):
            path = self.storage.describe(self.manifest.files[file].data)
            raise IntegrityError(f"{path}: tensor {span.tensor!r}: {position}")
        return position

    def _verify(self, file: int, span: VerifySpan, fetched: ByteArray, fetched_start: int) -> None:
        index = self.file_index(file)
        path = self.storage.describe(self.manifest.files[file].data)
        position = self._position(file, span)
        block = self.manifest.block_size
        first = (span.start - span.piece_offset) // block
        last = -(-(span.end - span.piece_offset) // block)
        base = int(index.first_block[position])
        for number in range(first, last):
            lo = span.piece_offset + number * block
            hi = min(lo + block, span.piece_offset + span.piece_size)
            actual = crc32c.crc32c(fetched[lo - fetched_start : hi - fetched_start].data)
            expected = int(index.crcs[base + number])
            if actual != expected:
                raise IntegrityError(
                    f"{path}: tensor {span.tensor!r}: block {number} of the piece at byte {span.piece_offset} "
                    f"(file bytes {lo}:{hi}) fails its checksum (stored {expected:#010x}, read {actual:#010x})"
                )


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

    def fetch(self) -> None:
        fetched: list[tuple[ReadRequest, ByteArray]] = []
        for wave in self.checkpoint.waves(self.plan):
            fetched.extend(self.checkpoint.fetch_wave(wave))
        self._fetched = fetched

    def apply(self) -> ReadStats:
        if self._fetched is None:
            self.checkpoint.stream(self.plan, self._buffers)
        else:
            for request, fetched in self._fetched:
                self.checkpoint.copy(request, fetched, self._buffers)
            self._fetched = None
        for tensor, staging in self._fixups:
            tensor.copy_(staging)
        plan = self.plan
        return ReadStats(plan.needed_bytes, plan.fetch_bytes, len(plan.requests), time.perf_counter() - self._began)


def open_checkpoint(
    url: str | Storage,
    *,
    storage_options: dict[str, Any] | None = None,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    max_gap: int = DEFAULT_MAX_GAP,
    max_request: int = DEFAULT_MAX_REQUEST,
) -> Checkpoint:
    """Open the committed checkpoint at `url`; NotCommittedError if it has no COMMITTED marker."""
    storage = open_storage(url, storage_options)
    try:
        marker = read_commit_marker(storage)
    except StorageError as exc:
        raise StorageError(f"cannot read {storage.describe(layout.COMMITTED)}: {exc}") from exc
    if marker is None:
        raise NotCommittedError(
            f"{storage.url} is not committed (no {layout.COMMITTED} marker): the save is incomplete, failed, "
            "or still running"
        )
    manifest = read_global_manifest(storage, marker)
    return Checkpoint(storage, marker, manifest, max_in_flight=max_in_flight, max_gap=max_gap, max_request=max_request)
