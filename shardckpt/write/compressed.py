"""Writing a compressed data file (format 1.2, SPEC 4.1): blocks compressed on a bounded thread pipeline, in order.

zstd, CRC32C and the byte grouping's numpy copies release the GIL, so `threads` blocks compress at once while the
caller's thread writes finished ones (encode_ahead.py); at most 2T + 1 jobs of HOT_CHUNK logical bytes are in flight.
"""

from __future__ import annotations

import contextlib
import json
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from shardckpt import knobs
from shardckpt.errors import ShardckptError
from shardckpt.format.codec import BlockEncoder
from shardckpt.format.compressed import LocalCompression
from shardckpt.write.encode_ahead import UNCHECKSUMMED, EncodeAhead, Encoder, Stored, raw_crc32c

HOT_CHUNK = knobs.HOT_CHUNK  # logical bytes per compression job


class Source(NamedTuple):
    """One piece to store: its safetensors key, dtype, logical bytes (a buffer of exactly its size)."""

    key: str
    dtype: str
    data: Any


class Written(NamedTuple):
    data_size: int  # bytes in the file
    header: bytes
    offsets: list[int]  # logical offset of every piece
    crc32c: np.ndarray  # of every block's stored bytes
    compression: LocalCompression
    raw_blocks: int = 0  # blocks written raw because no encoder had started them (storage pace)


def header_bytes(metadata: dict[str, str], entries: Sequence[tuple[str, str, list[int], int]], size: int = 0) -> bytes:
    """A safetensors header of (key, dtype, shape, nbytes) entries packed back to back, padded with spaces to a
    multiple of 8 and to at least `size` bytes in all (u64 length included)."""
    table: dict[str, Any] = {"__metadata__": metadata}
    position = 0
    for key, dtype, shape, nbytes in entries:
        table[key] = {"dtype": dtype, "shape": shape, "data_offsets": [position, position + nbytes]}
        position += nbytes
    text = json.dumps(table, separators=(",", ":")).encode()
    text += b" " * max(-len(text) % 8, size - 8 - len(text))
    return len(text).to_bytes(8, "little") + text


def write_compressed(
    handle: Any,
    metadata: dict[str, str],
    sources: Sequence[Source],
    *,
    block_size: int,
    level: int,
    threads: int,
    paced_threads: int | None = None,
    codec: str = "zstd",
    pace: str = "codec",
    progress: Callable[[], None] | None = None,
    encoder: Callable[[], Encoder] | None = None,
    write_threads: int = 1,
    where: str = "the data file",
) -> Written:
    """Write header and compressed pieces to `handle`; each piece a U8 entry of its stored size (SPEC 4.1).

    The header's final numbers are known only after compressing. Stored sizes never exceed logical ones, so a header
    written with the logical sizes is at least as long as the final one: on a positional handle (local disk) that
    header goes first and the final one, space-padded to the same length, over it at the end (memory: the jobs in
    flight). An object store's upload holds its first part (header included) until the end and sends the others
    as they fill; a streaming handle that can do neither holds the rank's stored bytes until the end.
    pace: "codec" waits for every block's encoder; "storage" (positional handles only) writes a block that no encoder
    has started raw (encode_ahead.py), on `paced_threads` encoders (default: `threads`). encoder: makes one block
    encoder per thread (default: BlockEncoder(level)).
    write_threads: threads writing a positional handle at once (pwrite), as a raw save's large files are.
    where: the file, as errors name it: an encoder's failure is a ShardckptError naming it, the tensor and block."""
    sizes = [memoryview(source.data).nbytes for source in sources]
    placeholder = header_bytes(metadata, [(s.key, "U8", [n], n) for s, n in zip(sources, sizes)])
    header_size = len(placeholder)
    positional = getattr(handle, "supports_write_at", False)
    # An object store's upload whose first part can wait for the header streams the blocks as they are compressed.
    rewrites_head = not positional and getattr(handle, "supports_head_rewrite", False)
    held: list[bytes] = []  # the stored bytes of a handle that can do neither, written after the header
    if rewrites_head:
        handle.hold_head(header_size)
    if positional or rewrites_head:
        handle.write(placeholder)
    chunks = _chunks(sources, sizes, max(HOT_CHUNK // block_size, 1) * block_size)
    block_count = sum(-(-len(chunk) // block_size) for job in chunks for chunk, _ in job)
    stored_crcs = np.empty(block_count, dtype=np.uint32)
    stored_sizes = np.empty(block_count, dtype=np.int64)
    logical_crcs = np.empty(block_count, dtype=np.uint32)
    # Only a local file's writes wait for the storage itself: an upload's return at once while max_in_flight bytes
    # are on the wire (a held stream's, always), so at the storage's pace most blocks would go raw. Those go at the
    # codec's pace whatever was asked (the link is the limit there, and the upload overlaps the encoders).
    storage_pace = pace == "storage" and positional
    count = paced_threads if storage_pace and paced_threads else threads
    ahead = EncodeAhead(
        chunks,
        encoder or (lambda: BlockEncoder(level)),
        threads=count,
        window=2 * max(1, count) + 1,
        storage_pace=storage_pace,
        block_size=block_size,
    )
    writes = _Positional(handle, header_size, write_threads if positional else 0)
    # At the storage's pace most blocks go raw, and their CRCs are computed by the threads that write them, as a raw
    # save's are: on the writer's thread alone they held its throughput at 0.87-0.90x a raw save's with no encoder
    # running at all (512 MiB, 2 cores).
    checksum = _Checksums(stored_crcs, logical_crcs)
    first = 0
    with ahead, writes, _encoder_failure(ahead, sources, sizes, block_size, where):
        for number in range(len(chunks)):
            raws = ahead.blocks(number)
            blocks = ahead.take(number, checksum_raw=not storage_pace)
            if blocks is None:  # every block raw (storage pace): each chunk written as it is, checksummed by its writer
                stored_sizes[first : first + len(raws)] = [len(raw) for raw in raws]
                at = 0
                for chunk, _ in chunks[number]:
                    count = -(-len(chunk) // block_size)
                    writes.write(chunk, checksum.of(list(zip(range(first + at, first + at + count), raws[at:]))))
                    at += count
                first += len(raws)
                if progress is not None:
                    progress()
                continue
            unchecksummed: list[tuple[int, memoryview]] = []
            for index, block in enumerate(blocks, first):
                stored_sizes[index] = len(block.data)
                if block.crc32c == UNCHECKSUMMED:
                    unchecksummed.append((index, memoryview(block.data)))
                else:
                    stored_crcs[index], logical_crcs[index] = block.crc32c, block.logical_crc32c
            first += len(blocks)
            for data in _joined(chunks[number], raws, blocks, block_size):
                if positional:  # the first write of the job checksums its raw blocks, then writes them from cache
                    writes.write(data, checksum.of(unchecksummed))
                    unchecksummed = []
                elif rewrites_head:
                    handle.write(data)
                else:
                    held.append(bytes(data))
            if unchecksummed:  # only a positional handle's storage pace leaves blocks to checksum
                raise AssertionError(f"{len(unchecksummed)} raw blocks of job {number} left without a CRC")
            if progress is not None:
                progress()
        writes.finish()
    piece_stored = _per_piece(stored_sizes, sizes, block_size)
    header = header_bytes(metadata, [(s.key, "U8", [n], n) for s, n in zip(sources, piece_stored)], header_size)
    if len(header) != header_size:  # stored <= logical makes this impossible; a wrong file must never be written
        raise AssertionError(f"compressed header of {len(header)} bytes, {header_size} reserved")
    if positional:
        handle.write_at(header, 0)
    elif rewrites_head:
        handle.write_head(header)
    else:
        handle.write(header)
        for data in held:
            handle.write(data)
    offsets = (header_size + np.concatenate([[0], np.cumsum(sizes)[:-1]])).astype(np.int64).tolist() if sizes else []
    table = LocalCompression(codec, header_size + sum(sizes), stored_sizes.astype(np.uint32), logical_crcs)
    return Written(header_size + int(stored_sizes.sum()), header, offsets, stored_crcs, table, ahead.raw_blocks)


@contextlib.contextmanager
def _encoder_failure(
    ahead: EncodeAhead, sources: Sequence[Source], sizes: list[int], block_size: int, where: str
) -> Iterator[None]:
    """An encoder's exception (a bug, or memory running out) as a ShardckptError naming the file, the tensor and the
    block it was compressing, not a bare RuntimeError or zstd error from a worker thread."""
    try:
        yield
    except ShardckptError:
        raise
    except Exception as exc:
        if exc is not ahead.error:  # the handle's own failures are typed and described already
            raise
        what = "a block"
        if ahead.failed_block is not None:
            block = ahead.failed_block
            for source, size in zip(sources, sizes):
                count = -(-size // block_size)
                if block < count:
                    what = f"tensor {source.key!r}, block {block} of the piece"
                    break
                block -= count
        raise ShardckptError(f"{where}: {what} could not be compressed: {type(exc).__name__}: {exc}") from exc


class _Checksums:
    """The CRC32C arrays of a file's blocks, filled by whichever thread checksums a raw block (stored == logical)."""

    def __init__(self, stored: np.ndarray, logical: np.ndarray) -> None:
        self.stored, self.logical = stored, logical

    def of(self, blocks: list[tuple[int, memoryview]]) -> Callable[[], None] | None:
        """A job checksumming `blocks` (index, raw bytes), or None when there are none."""
        if not blocks:
            return None

        def run() -> None:
            for index, raw in blocks:
                self.stored[index] = self.logical[index] = raw_crc32c(raw)

        return run


class _Positional:
    """Buffers written at increasing offsets of a positional handle by `threads` threads (a raw save's large files
    are filled by 2), at most 2 per thread in flight; 0 or 1 thread: in the caller's. A write may carry a job run
    just before it on the same thread (checksums of its bytes, still in cache after). Leaving it without finish()
    drops what is queued (the write failed)."""

    def __init__(self, handle: Any, position: int, threads: int) -> None:
        self.handle, self.position, self.threads = handle, position, threads
        self.pool = ThreadPoolExecutor(threads, "shardckpt-write") if threads > 1 else None
        self.pending: deque[Future[None]] = deque()

    def write(self, data: bytes | memoryview, before: Callable[[], None] | None = None) -> None:
        if self.pool is None:
            self._write(data, self.position, before)
        else:
            while len(self.pending) >= 2 * self.threads:
                self.pending.popleft().result()
            self.pending.append(self.pool.submit(self._write, data, self.position, before))
        self.position += len(data)

    def _write(self, data: bytes | memoryview, position: int, before: Callable[[], None] | None) -> None:
        if before is not None:
            before()
        self.handle.write_at(data, position)

    def finish(self) -> None:
        while self.pending:
            self.pending.popleft().result()

    def __enter__(self) -> _Positional:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def _chunks(sources: Sequence[Source], sizes: list[int], chunk_size: int) -> list[list[tuple[memoryview, str]]]:
    """The pieces cut into compression jobs of about `chunk_size` logical bytes: a large piece in chunks, small pieces
    batched together (a job per bias vector would cost a hand-off between threads per few KiB). A chunk's blocks
    start at its first byte, so each piece's blocks start at its own first byte."""
    jobs: list[list[tuple[memoryview, str]]] = []
    batch: list[tuple[memoryview, str]] = []
    batched = 0
    for source, size in zip(sources, sizes):
        data = memoryview(source.data).cast("B")
        for at in range(0, size, chunk_size):
            part = data[at : at + chunk_size]
            if batch and batched + len(part) > chunk_size:
                jobs.append(batch)
                batch, batched = [], 0
            batch.append((part, source.dtype))
            batched += len(part)
    if batch:
        jobs.append(batch)
    return jobs


def _joined(
    chunks: list[tuple[memoryview, str]], blocks: list[memoryview], stored: list[Stored], block_size: int
) -> list[bytes | memoryview]:
    """A job's stored bytes as buffers to write in order: a chunk whose every block is stored raw is its own memory
    (written without a copy: at the storage's pace most are), the others' blocks joined."""
    out: list[bytes | memoryview] = []
    at = 0
    for chunk, _ in chunks:
        count = -(-len(chunk) // block_size)
        mine = stored[at : at + count]
        if all(len(block.data) == len(raw) for block, raw in zip(mine, blocks[at : at + count])):
            out.append(chunk)
        else:
            out.append(b"".join(block.data for block in mine))
        at += count
    return out


def _per_piece(stored_sizes: np.ndarray, sizes: list[int], block_size: int) -> list[int]:
    totals, at = [], 0
    for size in sizes:
        count = -(-size // block_size)
        totals.append(int(stored_sizes[at : at + count].sum()))
        at += count
    return totals
