"""ShardWriter: one rank's part of a save — its data file (safetensors) and its local manifest.

Pieces are collected by `add`, then `close` streams them into a create-only file, computing the CRC32C of
every block while the bytes are hot (and piece hashes on threads of their own), makes the file durable, and only
then writes the local manifest.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import crc32c
import numpy as np
import torch

from shardckpt import knobs
from shardckpt.crashpoints import check_crash_at, crash_point
from shardckpt.errors import IntegrityError, ShardckptError, ShardckptUsageError
from shardckpt.format import layout
from shardckpt.format.bulk import gc_paused
from shardckpt.format.codec import check_codec
from shardckpt.format.compressed import FIRST_VERSION as COMPRESSED_VERSION
from shardckpt.format.compressed import LocalCompression
from shardckpt.format.dtypes import itemsize
from shardckpt.format.limits import MAX_BLOCK_SIZE, MAX_LOCAL_MANIFEST_BYTES, MIN_BLOCK_SIZE
from shardckpt.format.local_manifest import LocalManifest, LocalPieces, TensorSpec, encode_local_manifest
from shardckpt.format.references import (
    AUTO_THREADS,
    FIRST_VERSION,
    LocalReferences,
    ReferencedCompression,
    ReferencedPieces,
    piece_hash,
)
from shardckpt.format.strict import FORMAT_VERSION, ObjectEntry, check_name, check_shape
from shardckpt.format.values import check_plain
from shardckpt.planner.box import indices
from shardckpt.storage import Storage, open_storage
from shardckpt.torch_bytes import by_value, check_dense, format_dtype, host_bytes
from shardckpt.write.compressed import Source, Written, write_compressed
from shardckpt.write.encode_ahead import check_pace, given_pace
from shardckpt.write.holders import DamagedHolderWarning, damaged_holders, mark_intact, unchecked
from shardckpt.write.parent import Holder, ParentPieces

WRITE_CHUNK = knobs.WRITE_CHUNK  # bytes handed to the backend per call
PARALLEL_MIN_BYTES = knobs.PARALLEL_MIN_BYTES  # below this one stream is as fast as several
DEFAULT_WRITE_THREADS = knobs.WRITE_THREADS
# Checksummed, then written at once while still in the core's cache; also the local backend's write-behind unit.
HOT_CHUNK = knobs.HOT_CHUNK
DEFAULT_HASH_THREADS = knobs.HASH_THREADS
HASH_IN_FLIGHT = knobs.HASH_IN_FLIGHT  # bytes of copies made for hashing, not yet hashed
HASH_SPLIT_MIN = knobs.HASH_SPLIT_MIN  # a piece this large is split over BLAKE3's own threads


def _references_compressed(references: LocalReferences | None) -> bool:
    return references is not None and any(f.logical_size is not None for f in references.files)


class _Piece(NamedTuple):  # a tuple: a MoE rank adds 100,000+ of them
    name: str
    key: str
    tensor: torch.Tensor
    start: tuple[int, ...]
    length: tuple[int, ...]
    nbytes: int


class _TensorInfo(NamedTuple):
    dtype: str
    shape: tuple[int, ...]
    layout: str


@dataclass(frozen=True)
class WriteStats:
    bytes_written: int  # the data file, header included
    seconds: float
    referenced_bytes: int = 0  # piece bytes stored by reference to the parent's holders instead of written
    # Seconds hashing every piece before anything is written (a save with a parent compares first); 0 for other
    # saves, whose hashes run alongside the writes.
    hash_seconds: float = 0.0
    raw_blocks: int = 0  # compressed save at the storage's pace: blocks written raw, no encoder having started them


# zstd's levels (ZSTD_minCLevel()..ZSTD_maxCLevel()). The compressor keeps 2T + 1 jobs in flight, so a thread count
# far beyond any machine's cores is a typo that would hold a whole rank's bytes at once, not a faster save.
MIN_COMPRESSION_LEVEL, MAX_COMPRESSION_LEVEL = knobs.MIN_COMPRESSION_LEVEL, knobs.MAX_COMPRESSION_LEVEL
MAX_COMPRESSION_THREADS = 1024


def _whole(name: str, value: object, low: int, high: int) -> int:
    """A compression option (given, or its SHARDCKPT_ knob) as an int in low..high, else ShardckptUsageError."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not low <= value <= high:
        raise ShardckptUsageError(
            f"{name} (or SHARDCKPT_{name.upper()}) must be an integer in {low}..{high}, got {value!r}"
        )
    return int(value)


def _zero_one(tensor: torch.Tensor) -> torch.Tensor:
    """A bool tensor whose bytes are 0x00 and 0x01 (SPEC 4: a writer stores no other BOOL byte): `tensor` itself, or,
    for a bool view of other bytes (uint8 memory viewed as bool), a copy holding what torch takes them for (true)."""
    raw = tensor.view(torch.uint8)
    return raw.ne(0) if tensor.numel() and bool(raw.gt(1).any()) else tensor


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def piece_digest(data: Any) -> bytes:
    """BLAKE3-128 of a piece's bytes (SPEC 6.3). The bindings release the GIL from 2 KiB on, so the hash threads
    overlap each other and the writes; a piece of HASH_SPLIT_MIN bytes or more is also split over BLAKE3's threads."""
    large = memoryview(data).nbytes >= HASH_SPLIT_MIN
    return piece_hash(data, threads=AUTO_THREADS if large else 1)


class _PieceHasher:
    """Piece hashes on a small thread pool of their own while the writer goes on writing the same buffers.

    BLAKE3 releases the GIL for buffers over 2 KiB, so a hashed save takes about max(write, hash / threads) rather
    than their sum; each hash is of the very buffer written (no second read of storage). Buffers made for the save
    (staged device copies, gathered small pieces) are bounded: past `copy_limit` bytes not yet hashed, `submit`
    waits for the oldest. threads=0 hashes in the caller's thread (the serial reference).
    """

    def __init__(self, count: int, threads: int, copy_limit: int | None = None) -> None:
        self.digests: list[bytes | None] = [None] * count  # by piece number; each slot written by one job
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="shardckpt-hash") if threads else None
        self.jobs: list[Future[None]] = []
        self.copies: deque[tuple[Future[None], int]] = deque()
        self.copy_bytes, self.copy_limit = 0, HASH_IN_FLIGHT if copy_limit is None else copy_limit

    def submit(self, items: list[tuple[int, Any]], *, copy: bool) -> None:
        """Hash each (piece number, buffer); `copy`: the buffers exist for this save only (bounded, see above)."""
        if self.pool is None:
            self._run(items)
            return
        job = self.pool.submit(self._run, items)
        self.jobs.append(job)
        if copy:
            self.copies.append((job, sum(len(buffer) for _, buffer in items)))
            self.copy_bytes += self.copies[-1][1]
            while self.copy_bytes > self.copy_limit:
                oldest, nbytes = self.copies.popleft()
                oldest.result()
                self.copy_bytes -= nbytes

    def _run(self, items: list[tuple[int, Any]]) -> None:
        for number, buffer in items:
            self.digests[number] = piece_digest(buffer)

    def finish(self) -> list[bytes]:
        """Every piece's hash in piece order, once all are done (a job's error is raised here)."""
        for job in self.jobs:
            job.result()
        self.close()
        missing = [number for number, digest in enumerate(self.digests) if digest is None]
        if missing:  # a lost hash would make a later save reference the wrong bytes
            raise ShardckptError(f"{len(missing)} of {len(self.digests)} pieces were not hashed (first: {missing[0]})")
        return [digest for digest in self.digests if digest is not None]

    def close(self) -> None:
        """Stop the threads; jobs not started are dropped (after an error nothing will read their hashes)."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def _is_copy(tensor: torch.Tensor) -> bool:
    """Whether host_bytes(tensor) makes a buffer of its own rather than a view of the tensor's memory."""
    return tensor.device.type != "cpu" or not tensor.is_contiguous()


class _SmallPieces:
    """Pieces of one block or less (a MoE model has 100,000+ of them): gathered into one buffer of up to HOT_CHUNK
    bytes by one torch.cat, checksummed one by one, written at once, so the backend sees a few large writes rather
    than one call per tensor, and no piece costs a numpy view of its own."""

    def __init__(self, handle: Any, block_size: int, hasher: _PieceHasher | None) -> None:
        self.handle, self.limit = handle, max(HOT_CHUNK, block_size)
        self.hasher = hasher  # given each gathered buffer, when the writer hashes while writing
        self.pending: list[_Piece] = []
        self.numbers: list[int] = []  # each pending piece's number in the file (its hash's slot)
        self.crcs: list[int] = []
        self.size = 0

    def add(self, piece: _Piece, number: int) -> None:
        """Take host piece number `number`; its bytes are read when the buffer fills (before close returns)."""
        self.pending.append(piece)
        self.numbers.append(number)
        self.size += piece.nbytes
        if self.size >= self.limit:
            self._write()

    def flush(self) -> list[np.ndarray]:
        """Write what is buffered; the checksums of every piece added since the last flush, in order."""
        self._write()
        crcs, self.crcs = self.crcs, []
        return [np.array(crcs, dtype=np.uint32)] if crcs else []

    def _write(self) -> None:
        if not self.pending:
            return
        pieces, numbers, self.pending, self.numbers, self.size = self.pending, self.numbers, [], [], 0
        with torch.no_grad():  # plain bytes: no autograd record of the views and the gather
            flats = [piece.tensor.reshape(-1).view(torch.uint8) for piece in pieces]
            gathered = torch.cat(flats) if len(flats) > 1 else flats[0].clone()
        for piece, flat in zip(pieces, flats):
            if flat.numel() != piece.nbytes:
                raise ShardckptError(f"tensor {piece.name!r}: changed size while being saved")
        view = gathered.numpy().data
        position = 0
        spans = []
        for piece, number in zip(pieces, numbers):
            self.crcs.append(int(crc32c.crc32c(view[position : position + piece.nbytes])))
            spans.append((number, view[position : position + piece.nbytes]))
            position += piece.nbytes
        if self.hasher is not None:  # one job per buffer: a job per 1 KiB piece would cost more than its hash
            self.hasher.submit(spans, copy=True)
        self.handle.write(view)


class ShardWriter:
    """Writes one rank's pieces of a checkpoint at `url`.

    All ranks of one save use the same `attempt` id; a retry after a failure uses a new one, so it never
    touches a file of the failed attempt. Tensors handed to `add` must not change until `close` returns.
    """

    def __init__(
        self,
        url: str | Storage,
        *,
        rank: int,
        world_size: int,
        attempt: str = "0",
        block_size: int | None = None,
        step: int | None = None,
        storage_options: dict[str, Any] | None = None,
        write_threads: int = DEFAULT_WRITE_THREADS,
        parent: ParentPieces | None = None,
        piece_hashes: bool | None = None,
        hash_threads: int = DEFAULT_HASH_THREADS,
        compression: str | None = None,
        compression_level: int | None = None,
        compression_threads: int | None = None,
        compression_pace: str | None = None,
    ) -> None:
        """block_size: bytes per CRC32C block, a power of two in 4 KiB..64 MiB; None: knobs.BLOCK_SIZE (64 KiB).
        parent: an incremental save's parent (write.parent.open_parent): a piece whose bytes hash equal to the
        parent's piece of the same identity is stored by reference to the file that holds it (SPEC 6.2).
        piece_hashes: record the hash of every piece written, which a parent needs (default: knobs.PIECE_HASHES, or
        on when there is a parent). hash_threads: threads hashing pieces while they are written (0: in line).
        compression: "zstd" stores every block compressed (format 1.2, SPEC 4.1), None (default) raw; the level and
        threads default to knobs.COMPRESSION_LEVEL and knobs.COMPRESSION_THREADS. compression_pace: "codec" waits for
        every block's encoder, "storage" writes a block no encoder has started raw (never slower than the disk; the
        ratio depends on spare cores; local disk only); default "storage" if knobs.COMPRESSION_STORAGE_PACE else
        "codec"."""
        if not 0 <= rank < world_size:
            raise ShardckptUsageError(f"rank {rank} is outside 0..{world_size - 1}")
        check_crash_at()  # a misspelt crash point is refused before this rank writes a byte, not at the point
        block_size = knobs.BLOCK_SIZE if block_size is None else block_size  # read here: a load never reads it
        if not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE or block_size & (block_size - 1):
            raise ShardckptUsageError(  # the default is the knob's: name it too, as the compression options do
                f"block_size (or SHARDCKPT_BLOCK_SIZE) must be a power of two in {MIN_BLOCK_SIZE}..{MAX_BLOCK_SIZE}, "
                f"got {block_size!r}"
            )
        self.compression = check_codec(compression)
        self.compression_level, self.compression_threads, self.paced_threads = 1, 1, 1  # raw: never read
        compression_pace = given_pace(compression_pace, self.compression)
        if compression_pace is None:
            compression_pace = "storage" if self.compression and knobs.COMPRESSION_STORAGE_PACE else "codec"
        self.compression_pace = check_pace(compression_pace)
        if self.compression is not None:  # unused otherwise: a raw save never fails over a compression knob
            level = knobs.COMPRESSION_LEVEL if compression_level is None else compression_level
            threads = knobs.COMPRESSION_THREADS if compression_threads is None else compression_threads
            self.compression_level = _whole("compression_level", level, MIN_COMPRESSION_LEVEL, MAX_COMPRESSION_LEVEL)
            threads = _whole("compression_threads", threads, 0, MAX_COMPRESSION_THREADS)
            self.compression_threads = threads or min(8, _cores())
            # Where the storage's pace is in effect (a local file), one fewer by default: the writer's thread keeps a
            # core, and fewer encoders contend with it for the GIL. Uploads compress at the codec's pace: all cores.
            self.paced_threads = threads or max(1, min(8, _cores() - 1))
        self.storage = open_storage(url, storage_options)
        self.rank, self.world_size, self.block_size, self.step = rank, world_size, block_size, step
        self.write_threads = max(1, write_threads)
        self.hash_threads = max(0, hash_threads)
        self.attempt = layout.validate_attempt(attempt)
        self.parent = parent
        # An incremental save hashes its own pieces: it compares them, and it is the next save's parent.
        self.piece_hashes = bool(knobs.PIECE_HASHES or parent is not None) if piece_hashes is None else piece_hashes
        if parent is not None and not self.piece_hashes:
            raise ShardckptUsageError("an incremental save (parent=) compares piece hashes: piece_hashes must be on")
        self._pieces: list[_Piece] = []
        self._tensors: dict[str, _TensorInfo] = {}
        self._keys: set[str] = set()
        self._piece_counts: dict[str, int] = {}
        self._objects: dict[str, ObjectEntry] = {}
        self._closed = False
        self.stats: WriteStats | None = None
        self.encoded_manifest: bytes | None = None  # the local manifest exactly as written, after close()
        # After close(), of a raw file: each piece's offset in the data file and the tensor its bytes were written
        # from (a replica can be sent from that memory rather than read back); empty when the file is compressed.
        self.placed: tuple[tuple[int, torch.Tensor], ...] = ()

    # ------------------------------------------------------------------------------------------ adding

    def add(
        self,
        name: str,
        tensor: torch.Tensor,
        *,
        global_shape: Sequence[int] | None = None,
        offsets: Sequence[int] | None = None,
        flat_offset: int | None = None,
    ) -> None:
        """Add this rank's piece of global tensor `name`.

        Box piece: `tensor` is the region at `offsets` of a tensor of `global_shape` (default: the whole
        tensor). Flat piece (ZeRO partitions): `tensor` holds elements [flat_offset, flat_offset + numel) of
        the row-major flattened global tensor.
        """
        self._check_open()
        check_name(name, "tensor name")
        if name == "__metadata__":
            raise ShardckptUsageError("'__metadata__' is reserved by safetensors and cannot name a tensor")
        if not isinstance(tensor, torch.Tensor):
            raise ShardckptUsageError(f"tensor {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
        check_dense(name, tensor)
        if tensor.dtype == torch.bool:
            tensor = _zero_one(tensor)
        dtype = format_dtype(tensor.dtype)
        shape = tuple(tensor.shape) if global_shape is None else indices(global_shape, f"tensor {name!r}: global_shape")
        check_shape(shape, f"tensor {name!r}")
        start: tuple[int, ...]
        length: tuple[int, ...]
        if global_shape is None and offsets is None and flat_offset is None:  # a whole tensor (most adds)
            layout_name, start, length = "box", (0,) * len(shape), shape
        elif flat_offset is not None:
            if offsets is not None:
                raise ShardckptUsageError(f"tensor {name!r}: give offsets or flat_offset, not both")
            layout_name, start, length = (
                "flat",
                indices((flat_offset,), f"tensor {name!r}: flat_offset"),
                (tensor.numel(),),
            )
            if start[0] < 0 or start[0] + tensor.numel() > math.prod(shape):
                raise ShardckptUsageError(
                    f"tensor {name!r}: elements {start[0]}:{start[0] + tensor.numel()} lie outside "
                    f"its {math.prod(shape)} elements"
                )
        else:
            layout_name = "box"
            start = indices(offsets, f"tensor {name!r}: offsets") if offsets is not None else (0,) * len(shape)
            length = tuple(int(d) for d in tensor.shape)
            if len(start) != len(shape) or len(length) != len(shape):
                raise ShardckptUsageError(
                    f"tensor {name!r}: piece of shape {list(length)} at offsets {list(start)} does not match "
                    f"the rank of global shape {list(shape)}"
                )
            if any(o < 0 or o + n > d for o, n, d in zip(start, length, shape)):
                raise ShardckptUsageError(
                    f"tensor {name!r}: piece of shape {list(length)} at offsets {list(start)} lies outside "
                    f"global shape {list(shape)}"
                )
        info = _TensorInfo(dtype, shape, layout_name)
        known = self._tensors.setdefault(name, info)
        if known != info:
            raise ShardckptUsageError(f"tensor {name!r}: added as {known} and again as {info}")
        if tensor.numel() == 0:
            return  # an empty piece stores nothing; the entry above still records dtype and shape
        count = self._piece_counts.get(name, 0)  # a dict, not a scan: adding n pieces stays O(n)
        key = name if count == 0 else f"{name}#{count}"
        if key in self._keys:
            raise ShardckptUsageError(f"tensor {name!r}: safetensors key {key!r} collides with another tensor")
        self._keys.add(key)
        self._piece_counts[name] = count + 1
        nbytes = tensor.numel() * tensor.element_size()
        # A lazy conjugate or negative view is stored by value (a copy of this piece), as torch.save stores it.
        self._pieces.append(_Piece(name, key, by_value(tensor), start, length, nbytes))

    def add_object(self, name: str, value: Any, *, per_rank: bool = False) -> None:
        """Add a plain value (step, RNG state, scheduler, ...); per_rank values are kept for this rank only."""
        self._check_open()
        check_name(name, "object name")
        check_plain(value, f"object {name!r}")
        self._objects[name] = ObjectEntry(name, self.rank if per_rank else None, value)

    # ----------------------------------------------------------------------------------------- writing

    @gc_paused()
    def close(self) -> LocalManifest:
        """Write the data file, make it durable, then write the local manifest; returns the manifest."""
        self._check_open()
        self._closed = True
        began = time.perf_counter()
        data_path = layout.data_path(self.rank, self.attempt)
        referenced: list[tuple[_Piece, Holder, bytes]] = []
        digests: list[bytes] | None = None
        hasher: _PieceHasher | None = None
        hash_seconds = 0.0
        if self.parent is not None:
            # Hashed before anything is written: a piece equal to the parent's is not written at all.
            digests, referenced = self._match_parent(self.parent)
            hash_seconds = time.perf_counter() - began
        elif self.piece_hashes:
            hasher = _PieceHasher(len(self._pieces), self.hash_threads)
        header = self._header() if self.compression is None else b""
        offsets: list[int] = []
        crcs: list[np.ndarray] = []
        compressed: LocalCompression | None = None
        raw_blocks = 0
        try:
            if self.compression is None:
                position = self._write_data(data_path, header, hasher, offsets, crcs)
            else:
                written = self._write_compressed(data_path, hasher)
                position, header, compressed = written.data_size, written.header, written.compression
                offsets, crcs, raw_blocks = written.offsets, [written.crc32c], written.raw_blocks
            if hasher is not None:
                digests = hasher.finish()
        finally:
            if hasher is not None:
                hasher.close()
        stored = self.storage.size(data_path)
        if stored != position:  # a backend that lost bytes without an error must not get this far
            raise IntegrityError(f"{self.storage.describe(data_path)} holds {stored} bytes after writing {position}")
        specs, pieces = self._table(offsets)
        if self.compression is None and self.parent is None:
            self.placed = tuple(zip(offsets, (piece.tensor for piece in self._pieces)))
        references = None
        if digests is not None:
            if len(digests) != pieces.count:  # a lost hash would make a later save reference the wrong bytes
                raise ShardckptError(f"rank {self.rank}: {len(digests)} piece hashes for {pieces.count} pieces")
            references = self._references(specs, b"".join(digests), referenced)
        manifest = LocalManifest(
            attempt=self.attempt,
            rank=self.rank,
            world_size=self.world_size,
            data=data_path,
            data_size=position,
            header_size=len(header),
            header_crc32c=int(crc32c.crc32c(header)),
            block_size=self.block_size,
            tensors=specs,
            pieces=pieces,
            crc32c=np.concatenate(crcs).astype(np.uint32) if crcs else np.zeros(0, np.uint32),
            objects=tuple(self._objects.values()),
            step=self.step,
            version=max(
                FORMAT_VERSION if references is None else FIRST_VERSION,
                FORMAT_VERSION if compressed is None and not _references_compressed(references) else COMPRESSED_VERSION,
            ),
            references=references,
            compression=compressed,
        )
        self.encoded_manifest = encode_local_manifest(manifest)
        manifest_path = layout.local_manifest_path(self.rank, self.attempt)
        self.storage.write_new(manifest_path, self.encoded_manifest)
        if self.storage.read_small(manifest_path, MAX_LOCAL_MANIFEST_BYTES) != self.encoded_manifest:
            raise IntegrityError(f"{self.storage.describe(manifest_path)} does not hold the bytes just written")
        crash_point("after_local_manifest", self.rank)
        referenced_bytes = sum(p.nbytes for p, _, _ in referenced)
        self.stats = WriteStats(position, time.perf_counter() - began, referenced_bytes, hash_seconds, raw_blocks)
        return manifest

    def _write_data(
        self, data_path: str, header: bytes, hasher: _PieceHasher | None, offsets: list[int], crcs: list[np.ndarray]
    ) -> int:
        """Write the data file: the header, then the pieces, filling `offsets` and `crcs`; returns its size."""
        position = len(header)
        with self.storage.open_new(data_path) as handle:
            total = sum(piece.nbytes for piece in self._pieces)
            small = sum(piece.nbytes for piece in self._pieces if piece.nbytes <= self.block_size)
            # Host tensors only: device tensors would all need host copies at once (the sequential path stages one).
            # Mostly small pieces (a MoE state) go the sequential way, which writes them in buffers: a thread-pool
            # job per piece would cost more than its bytes.
            parallel = getattr(handle, "supports_write_at", False) and self.write_threads > 1 and 2 * small < total
            if parallel and total >= PARALLEL_MIN_BYTES and all(p.tensor.device.type == "cpu" for p in self._pieces):
                handle.write_at(header, 0)
                self._write_parallel(handle, len(header), hasher, offsets, crcs)
                return position + total
            handle.write(header)
            buffered = _SmallPieces(handle, self.block_size, hasher)
            for number, piece in enumerate(self._pieces):
                offsets.append(position)
                if piece.nbytes <= self.block_size and piece.tensor.device.type == "cpu":
                    buffered.add(piece, number)
                else:
                    crcs.extend(buffered.flush())
                    crcs.append(self._write_piece(handle, piece, number, hasher))
                position += piece.nbytes
                crash_point("writing_data", self.rank)
            crcs.extend(buffered.flush())
        return position

    def _write_compressed(self, data_path: str, hasher: _PieceHasher | None) -> Written:
        """The data file of a compressed save: every block compressed on threads, hashed (logical bytes) alongside."""
        datas = [host_bytes(piece.tensor) for piece in self._pieces]
        for number, (piece, data) in enumerate(zip(self._pieces, datas)):
            if data.size != piece.nbytes:
                raise ShardckptError(f"tensor {piece.name!r}: changed size while being saved")
            if hasher is not None:  # piece hashes cover the logical bytes (SPEC 4.1)
                hasher.submit([(number, data.data)], copy=False)
        sources = [Source(piece.key, self._tensors[piece.name].dtype, data) for piece, data in zip(self._pieces, datas)]
        metadata = {"format": "shardckpt", "version": "{}.{}".format(*COMPRESSED_VERSION), "attempt": self.attempt,
                    "rank": str(self.rank)}  # fmt: skip
        with self.storage.open_new(data_path) as handle:
            return write_compressed(
                handle,
                metadata,
                sources,
                block_size=self.block_size,
                level=self.compression_level,
                threads=self.compression_threads,
                paced_threads=self.paced_threads,
                codec=self.compression or "zstd",
                pace=self.compression_pace,
                write_threads=self.write_threads,
                progress=lambda: crash_point("writing_data", self.rank),
                where=self.storage.describe(data_path),
            )

    # ------------------------------------------------------------------------------------- incremental

    def _match_parent(self, parent: ParentPieces) -> tuple[list[bytes], list[tuple[_Piece, Holder, bytes]]]:
        """Hash every piece; keep to write those the parent lacks or holds with other bytes, return the others
        with their holders. Equality is decided by content only (SPEC 6.3): same identity, size and hash."""
        hashes = self._hash_pieces(self._pieces)
        written: list[_Piece] = []
        digests: list[bytes] = []
        referenced: list[tuple[_Piece, Holder, bytes]] = []
        for piece, digest in zip(self._pieces, hashes):
            info = self._tensors[piece.name]
            holder = parent.holders.get((piece.name, info.dtype, info.shape, info.layout, piece.start, piece.length))
            # A compressed holder's blocks are referenced as stored, so only with this save's block size (SPEC 6.2).
            same_blocks = holder is None or holder.stored_offset is None or holder.block_size == self.block_size
            if holder is not None and holder.nbytes == piece.nbytes and holder.digest == digest and same_blocks:
                referenced.append((piece, holder, digest))
            else:
                written.append(piece)
                digests.append(digest)
        if referenced and knobs.VERIFY_REFERENCED and parent.root is not None:
            # A flipped bit in a holder would reach every later child: such pieces are written anew (their bytes
            # hash equal to the recorded hash, so they are the bytes the holder should hold).
            holders = [holder for _, holder, _ in referenced]
            checking = unchecked(parent.root, holders, knobs.VERIFY_REFERENCED_EVERY)
            found = damaged_holders(parent.root, [holders[index] for index in checking])
            damaged = {checking[index]: why for index, why in found.items()}
            mark_intact(parent.root, [holders[index] for index in checking if index not in damaged])
            for why in sorted(set(damaged.values()))[:1]:
                warnings.warn(
                    f"rank {self.rank}: {len(damaged)} piece(s) of the parent are damaged in their holder files "
                    f"(e.g. {why}): this save writes them anew instead of referencing them; `shardckpt verify` the "
                    "checkpoints that reference them",
                    DamagedHolderWarning,
                    stacklevel=4,
                )
            for index in sorted(damaged):
                written.append(referenced[index][0])
                digests.append(referenced[index][2])
            referenced = [row for index, row in enumerate(referenced) if index not in damaged]
        self._pieces = written
        return digests, referenced

    def _hash_pieces(self, pieces: Sequence[_Piece]) -> list[bytes]:
        """The hash of every piece on the hash threads: the largest first, so that no long hash starts last (one
        piece is one job, split over BLAKE3's threads from HASH_SPLIT_MIN bytes); small pieces a buffer's worth per
        job."""
        hasher = _PieceHasher(len(pieces), self.hash_threads)
        try:
            batch: list[tuple[int, Any]] = []
            batch_bytes = 0
            for number in sorted(range(len(pieces)), key=lambda n: -pieces[n].nbytes):
                piece = pieces[number]
                data = host_bytes(piece.tensor)
                if data.size != piece.nbytes:
                    raise ShardckptError(f"tensor {piece.name!r}: changed size while being saved")
                if piece.nbytes > self.block_size:
                    hasher.submit([(number, data.data)], copy=_is_copy(piece.tensor))
                    continue
                batch.append((number, data.data))
                batch_bytes += piece.nbytes
                if batch_bytes >= HOT_CHUNK:
                    hasher.submit(batch, copy=True)
                    batch, batch_bytes = [], 0
            if batch:
                hasher.submit(batch, copy=True)
            return hasher.finish()
        finally:
            hasher.close()

    def _references(
        self, specs: tuple[TensorSpec, ...], digests: bytes, referenced: list[tuple[_Piece, Holder, bytes]]
    ) -> LocalReferences:
        """The 1.1 part of the local manifest: the written pieces' hashes and the referenced piece table."""
        if not referenced:
            return LocalReferences(digests, (), None)
        paths = sorted({holder.file.path for _, holder, _ in referenced})
        files = {holder.file.path: holder.file for _, holder, _ in referenced}
        rows = sorted(referenced, key=lambda row: (paths.index(row[1].file.path), row[1].offset))
        index = {spec.name: number for number, spec in enumerate(specs)}
        crcs = [self._carried_crcs(piece, holder) for piece, holder, _ in rows]
        table = ReferencedPieces(
            np.array([index[piece.name] for piece, _, _ in rows], dtype=np.int64),
            np.array([paths.index(holder.file.path) for _, holder, _ in rows], dtype=np.int64),
            np.array([holder.offset for _, holder, _ in rows], dtype=np.int64),
            np.array([value for piece, _, _ in rows for value in piece.start], dtype=np.int64),
            np.array([value for piece, _, _ in rows for value in piece.length], dtype=np.int64),
            np.concatenate(crcs).astype(np.uint32) if crcs else np.zeros(0, np.uint32),
            b"".join(digest for _, _, digest in rows),
            k_of=np.array([spec.k for spec in specs], dtype=np.int64),
            size_of=np.array([itemsize(spec.dtype) for spec in specs], dtype=np.int64),
            block_size=self.block_size,
        )
        compressed = [holder for _, holder, _ in rows if holder.stored_offset is not None]
        if compressed:  # rows in row order, each with its holder's stored blocks (SPEC 6.2, format 1.2)
            table.compression = ReferencedCompression(
                np.array([holder.stored_offset for holder in compressed], dtype=np.int64),
                np.concatenate([np.asarray(holder.stored, np.uint32) for holder in compressed]),
                np.concatenate([np.asarray(holder.logical_crc32c, np.uint32) for holder in compressed]),
            )
        return LocalReferences(digests, tuple(files[path] for path in paths), table)

    def _carried_crcs(self, piece: _Piece, holder: Holder) -> np.ndarray:
        """The block checksums a reference carries: the holder's when block sizes agree, else of the (equal) bytes."""
        if holder.block_size == self.block_size:
            return np.asarray(holder.crc32c, dtype=np.uint32)
        view = host_bytes(piece.tensor).data
        block = self.block_size
        return np.array([crc32c.crc32c(view[at : at + block]) for at in range(0, piece.nbytes, block)], np.uint32)

    def _check_open(self) -> None:
        if self._closed:
            raise ShardckptUsageError("this ShardWriter is closed")

    def _header(self) -> bytes:
        """The safetensors header: u64 length, JSON padded with spaces to a multiple of 8."""
        entries: dict[str, Any] = {
            "__metadata__": {
                "format": "shardckpt",
                "version": f"{FORMAT_VERSION[0]}.{FORMAT_VERSION[1]}",
                "attempt": self.attempt,
                "rank": str(self.rank),
            }
        }
        position = 0
        for piece in self._pieces:
            info = self._tensors[piece.name]
            shape = list(piece.length)
            entries[piece.key] = {
                "dtype": info.dtype,
                "shape": shape,
                "data_offsets": [position, position + piece.nbytes],
            }
            position += piece.nbytes
        text = json.dumps(entries, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        return len(text).to_bytes(8, "little") + text

    def _write_parallel(
        self, handle: Any, header_size: int, hasher: _PieceHasher | None, offsets: list[int], crcs: list[np.ndarray]
    ) -> None:
        """Several streams into one file: chunks checksummed and written at their offsets by a thread pool.

        CRC32C, BLAKE3 and pwrite all release the GIL, so a rank writes at the disk's multi-stream rate. A piece's
        hash is one sequential pass, so each piece is one job of the hash threads, the largest first, all queued
        before the first write: hashing runs alongside the whole write, and no long hash starts at its end.
        """
        block = self.block_size
        chunk_size = max(WRITE_CHUNK // block, 1) * block
        jobs: list[Any] = []
        position = header_size
        datas = [host_bytes(piece.tensor) for piece in self._pieces]
        for piece, data in zip(self._pieces, datas):
            if data.size != piece.nbytes:
                raise ShardckptError(f"tensor {piece.name!r}: changed size while being saved")
        if hasher is not None:  # the copies (non-contiguous pieces) are held by the write jobs anyway
            for number in sorted(range(len(datas)), key=lambda n: -self._pieces[n].nbytes):
                hasher.submit([(number, datas[number].data)], copy=False)
        for piece, data in zip(self._pieces, datas):
            piece_crcs = np.empty(-(-piece.nbytes // block), dtype=np.uint32)
            offsets.append(position)
            crcs.append(piece_crcs)
            for chunk_start in range(0, piece.nbytes, chunk_size):
                jobs.append(
                    (
                        data.data[chunk_start : chunk_start + chunk_size],
                        position + chunk_start,
                        piece_crcs,
                        chunk_start // block,
                    )
                )
            position += piece.nbytes

        step = max(HOT_CHUNK // block, 1) * block

        def run(job: Any) -> None:
            chunk, file_offset, piece_crcs, first_block = job
            # Checksum a cache-sized part, then write it while its bytes are still in cache: the copy into the
            # page cache then reads them from cache, not from memory a second time.
            for part in range(0, len(chunk), step):
                for offset in range(part, min(part + step, len(chunk)), block):
                    piece_crcs[first_block + offset // block] = crc32c.crc32c(chunk[offset : offset + block])
                handle.write_at(chunk[part : part + step], file_offset + part)

        with ThreadPoolExecutor(max_workers=self.write_threads) as pool:
            for number, _ in enumerate(pool.map(run, jobs)):
                if number == 0:
                    crash_point("writing_data", self.rank)

    def _write_piece(self, handle: Any, piece: _Piece, number: int, hasher: _PieceHasher | None) -> np.ndarray:
        """Write piece `number` in checksummed chunks, its hash running alongside; returns its block checksums."""
        data = host_bytes(piece.tensor)
        if data.size != piece.nbytes:
            raise ShardckptError(f"tensor {piece.name!r}: changed size while being saved")
        view = data.data
        if hasher is not None:  # the hash threads read the very buffer written below
            hasher.submit([(number, view)], copy=_is_copy(piece.tensor))
        block = self.block_size
        crcs = np.empty(-(-piece.nbytes // block), dtype=np.uint32)
        # A whole number of blocks per chunk, so a block never straddles two chunks. Disks take cache-sized
        # chunks (checksummed while hot); streaming backends large ones (each may become an upload part).
        target = HOT_CHUNK if getattr(handle, "supports_write_at", False) else WRITE_CHUNK
        chunk_size = max(target // block, 1) * block
        for chunk_start in range(0, piece.nbytes, chunk_size):
            chunk = view[chunk_start : chunk_start + chunk_size]
            for offset in range(0, len(chunk), block):
                crcs[(chunk_start + offset) // block] = crc32c.crc32c(chunk[offset : offset + block])
            handle.write(chunk)
        return crcs

    def _table(self, offsets: list[int]) -> tuple[tuple[TensorSpec, ...], LocalPieces]:
        """The tensor table (in order of first add) and the pieces in file order."""
        specs = tuple(TensorSpec(name, info.dtype, info.shape, info.layout) for name, info in self._tensors.items())
        index = {spec.name: number for number, spec in enumerate(specs)}
        pieces = LocalPieces(
            specs,
            np.array([index[piece.name] for piece in self._pieces], dtype=np.int64),
            np.array(offsets, dtype=np.int64),
            np.array([value for piece in self._pieces for value in piece.start], dtype=np.int64),
            np.array([value for piece in self._pieces for value in piece.length], dtype=np.int64),
        )
        return specs, pieces

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None and not self._closed:
            self.close()
