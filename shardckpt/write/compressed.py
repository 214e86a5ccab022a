"""Writing a compressed data file (format 1.2, SPEC 4.1): blocks compressed on a bounded thread pipeline, in order.

zstd, CRC32C and the byte grouping's numpy copies release the GIL, so `threads` blocks compress at once while the
caller's thread writes finished ones; at most `window` jobs of HOT_CHUNK logical bytes are in flight.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import crc32c
import numpy as np

from shardckpt import knobs
from shardckpt.format.codec import BlockEncoder
from shardckpt.format.compressed import LocalCompression

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
    codec: str = "zstd",
    progress: Callable[[], None] | None = None,
) -> Written:
    """Write header and compressed pieces to `handle`; each piece a U8 entry of its stored size (SPEC 4.1).

    The header's final numbers are known only after compressing. Stored sizes never exceed logical ones, so a header
    written with the logical sizes is at least as long as the final one: on a positional handle (local disk) that
    header goes first and the final one, space-padded to the same length, over it at the end (memory: the jobs in
    flight). A streaming handle (object stores) cannot go back: the rank's stored bytes are held until the end."""
    sizes = [memoryview(source.data).nbytes for source in sources]
    placeholder = header_bytes(metadata, [(s.key, "U8", [n], n) for s, n in zip(sources, sizes)])
    header_size = len(placeholder)
    positional = getattr(handle, "supports_write_at", False)
    held: list[bytes] = []
    if positional:
        handle.write(placeholder)
    local = threading.local()

    def compress(job: list[tuple[memoryview, str]]) -> tuple[list[Any], list[int], list[int], list[int]]:
        encoder = getattr(local, "encoder", None)
        if encoder is None:
            encoder = local.encoder = BlockEncoder(level)
        blocks, stored_crcs, stored_sizes, logical_crcs = [], [], [], []
        for chunk, dtype in job:  # each piece's blocks start at its own first byte
            for at in range(0, len(chunk), block_size):
                raw = chunk[at : at + block_size]
                stored = encoder.encode(raw, dtype)
                blocks.append(stored)
                stored_crcs.append(crc32c.crc32c(stored))
                stored_sizes.append(len(stored))
                logical_crcs.append(crc32c.crc32c(raw))
        return blocks, stored_crcs, stored_sizes, logical_crcs

    jobs = _jobs(sources, sizes, max(HOT_CHUNK // block_size, 1) * block_size)
    stored_crcs: list[int] = []
    stored_sizes: list[int] = []
    logical_crcs: list[int] = []
    window = 2 * max(1, threads) + 1
    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="shardckpt-compress") as pool:
        pending: deque[Future[Any]] = deque()
        submitted = 0
        try:
            while submitted < len(jobs) or pending:
                while submitted < len(jobs) and len(pending) < window:
                    pending.append(pool.submit(compress, jobs[submitted]))
                    submitted += 1
                blocks, crcs, stored, logical = pending.popleft().result()
                data = b"".join(blocks)
                if positional:
                    handle.write(data)
                else:
                    held.append(data)
                stored_crcs.extend(crcs)
                stored_sizes.extend(stored)
                logical_crcs.extend(logical)
                if progress is not None:
                    progress()
        finally:
            for future in pending:
                future.cancel()
    piece_stored = _per_piece(stored_sizes, sizes, block_size)
    header = header_bytes(metadata, [(s.key, "U8", [n], n) for s, n in zip(sources, piece_stored)], header_size)
    if len(header) != header_size:  # stored <= logical makes this impossible; a wrong file must never be written
        raise AssertionError(f"compressed header of {len(header)} bytes, {header_size} reserved")
    if positional:
        handle.write_at(header, 0)
    else:
        handle.write(header)
        for data in held:
            handle.write(data)
    offsets = (header_size + np.concatenate([[0], np.cumsum(sizes)[:-1]])).astype(np.int64).tolist() if sizes else []
    table = LocalCompression(
        codec,
        header_size + sum(sizes),
        np.array(stored_sizes, dtype=np.uint32),
        np.array(logical_crcs, dtype=np.uint32),
    )
    return Written(header_size + sum(stored_sizes), header, offsets, np.array(stored_crcs, dtype=np.uint32), table)


def _jobs(sources: Sequence[Source], sizes: list[int], chunk_size: int) -> list[list[tuple[memoryview, str]]]:
    """The pieces cut into compression jobs of about `chunk_size` logical bytes: a large piece in chunks, small pieces
    batched together (a job per bias vector would cost a hand-off between threads per few KiB)."""
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


def _per_piece(stored_sizes: list[int], sizes: list[int], block_size: int) -> list[int]:
    totals, at = [], 0
    for size in sizes:
        count = -(-size // block_size)
        totals.append(sum(stored_sizes[at : at + count]))
        at += count
    return totals
