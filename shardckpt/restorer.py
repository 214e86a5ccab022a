"""Opening a committed checkpoint and reading any box of any tensor, verifying every byte it reads.

open() checks COMMITTED and the manifest's checksum; reads go planner -> coalesced range reads (concurrent,
bounded bytes in flight) -> block checksums from the file's local manifest -> strided copies into destinations.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
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
from shardckpt.format.dtypes import itemsize
from shardckpt.format.manifest import (
    CommitMarker,
    GlobalManifest,
    TensorEntry,
    crc32c_of,
    decode_commit_marker,
    decode_global_manifest,
    decode_local_manifest,
)
from shardckpt.planner import Box, ReadPlan, ReadRequest, Target, VerifySpan, check_cover, plan_reads
from shardckpt.planner.execute import apply_copy
from shardckpt.planner.plan import DEFAULT_MAX_GAP, DEFAULT_MAX_REQUEST
from shardckpt.storage import Storage, open_storage
from shardckpt.torch_bytes import torch_dtype, writable_bytes

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


def read_commit_marker(storage: Storage) -> CommitMarker | None:
    try:
        raw = storage.read_small(layout.COMMITTED, limits.MAX_COMMIT_MARKER_BYTES)
    except NotFoundError:
        return None
    return decode_commit_marker(raw, storage.describe(layout.COMMITTED))


def read_global_manifest(storage: Storage, marker: CommitMarker) -> GlobalManifest:
    """The manifest COMMITTED points at, after checking its size and CRC32C against the marker."""
    where = storage.describe(marker.manifest)
    raw = storage.read_small(marker.manifest, limits.MAX_GLOBAL_MANIFEST_BYTES)
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


class _FileIndex:
    """The checksums of one data file: piece offsets (sorted), sizes, first block of each, CRC32C per block."""

    def __init__(self, offsets: np.ndarray, sizes: np.ndarray, first_block: np.ndarray, crcs: np.ndarray) -> None:
        self.offsets, self.sizes, self.first_block, self.crcs = offsets, sizes, first_block, crcs


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
        self._indexes: dict[int, _FileIndex] = {}
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

    def read_into(self, items: Sequence[tuple[str, Box, torch.Tensor]]) -> ReadStats:
        """Fill each destination tensor with box `Box` of its tensor; all reads planned and coalesced together."""
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
            if view is None:  # GPU, non-contiguous or empty: read into a host buffer and copy once
                staging = torch.empty(box.shape, dtype=tensor.dtype)
                view = writable_bytes(staging)
                fixups.append((tensor, staging))
            targets.append(Target(name, box))
            buffers.append(view if view is not None else np.zeros(0, np.uint8))
        plan = self._plan(targets)
        self.execute(plan, buffers)
        for tensor, staging in fixups:
            tensor.copy_(staging)
        return ReadStats(plan.needed_bytes, plan.fetch_bytes, len(plan.requests), time.perf_counter() - began)

    def execute(self, plan: ReadPlan, destinations: Sequence[ByteArray]) -> None:
        """Fetch the plan's requests in waves of at most max_in_flight bytes, verify, then copy."""
        wave: list[ReadRequest] = []
        in_flight = 0
        for request in plan.requests:
            if wave and in_flight + request.size > self.max_in_flight:
                self._run_wave(wave, destinations)
                wave, in_flight = [], 0
            wave.append(request)
            in_flight += request.size
        if wave:
            self._run_wave(wave, destinations)

    def _run_wave(self, wave: list[ReadRequest], destinations: Sequence[ByteArray]) -> None:
        files = self.manifest.files
        try:
            blobs = self.storage.read_ranges([(files[r.file].data, r.start, r.end) for r in wave])
        except TruncatedError as exc:
            names = sorted({span.tensor for r in wave for span in r.verify})
            raise IntegrityError(f"{exc} while reading tensors {names[:5]}") from exc
        for request, blob in zip(wave, blobs):
            if len(blob) != request.size:
                raise IntegrityError(
                    f"{self.storage.describe(files[request.file].data)}: short read of bytes "
                    f"{request.start}:{request.end} (got {len(blob)})"
                )
            fetched = np.frombuffer(blob, dtype=np.uint8)
            for span in request.verify:
                self._verify(request.file, span, fetched, request.start)
            for copy in request.copies:
                apply_copy(copy, fetched, request.start, destinations[copy.target])

    # ------------------------------------------------------------------------------------- integrity

    def file_index(self, file: int) -> _FileIndex:
        with self._lock:
            index = self._indexes.get(file)
        if index is None:
            index = self._load_index(file)
            with self._lock:
                self._indexes[file] = index
        return index

    def _load_index(self, file: int) -> _FileIndex:
        entry = self.manifest.files[file]
        where = self.storage.describe(entry.index)
        try:
            raw = self.storage.read_small(entry.index, limits.MAX_LOCAL_MANIFEST_BYTES)
        except NotFoundError:
            raise IntegrityError(f"{where} is missing (checksums of {entry.data})") from None
        if len(raw) != entry.index_size or crc32c_of(raw) != entry.index_crc32c:
            raise IntegrityError(
                f"{where}: {len(raw)} bytes with CRC32C {crc32c_of(raw):#010x}, but the global manifest promises "
                f"{entry.index_size} bytes with CRC32C {entry.index_crc32c:#010x}"
            )
        local = decode_local_manifest(raw, where)
        if (local.attempt, local.rank, local.data, local.data_size, local.block_size) != (
            self.manifest.attempt,
            entry.rank,
            entry.data,
            entry.data_size,
            self.manifest.block_size,
        ):
            raise FormatError(f"{where}: does not describe {entry.data} of attempt {self.manifest.attempt}")
        offsets = [t.pieces.offset for t in local.tensors]
        sizes = [np.prod(t.pieces.length, axis=1, dtype=np.int64) * itemsize(t.dtype) for t in local.tensors]
        all_offsets = np.concatenate(offsets) if offsets else np.zeros(0, np.int64)
        all_sizes = np.concatenate(sizes) if sizes else np.zeros(0, np.int64)
        order = np.argsort(all_offsets, kind="stable")
        all_offsets, all_sizes = all_offsets[order], all_sizes[order]
        blocks = -(-all_sizes // local.block_size)
        first_block = np.concatenate([[0], np.cumsum(blocks)[:-1]]).astype(np.int64) if blocks.size else blocks
        if int(blocks.sum()) != local.crc32c.size:
            raise FormatError(f"{where}: {local.crc32c.size} checksums for {int(blocks.sum())} blocks")
        # Pieces sit back to back from the end of the header to the end of the file, as the writer packs them.
        ends = np.concatenate([[local.header_size], all_offsets + all_sizes])
        if (all_offsets != ends[:-1]).any() or int(ends[-1]) != local.data_size:
            raise FormatError(f"{where}: pieces are not packed back to back between the header and the end of file")
        return _FileIndex(all_offsets, all_sizes, first_block, local.crc32c)

    def _verify(self, file: int, span: VerifySpan, fetched: ByteArray, fetched_start: int) -> None:
        index = self.file_index(file)
        path = self.storage.describe(self.manifest.files[file].data)
        position = int(np.searchsorted(index.offsets, span.piece_offset))
        if (
            position >= index.offsets.size
            or index.offsets[position] != span.piece_offset
            or index.sizes[position] != span.piece_size
        ):
            raise IntegrityError(
                f"{path}: tensor {span.tensor!r}: the piece at byte {span.piece_offset} is not in the local manifest"
            )
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
