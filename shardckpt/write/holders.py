"""The holder check of an incremental save: before a piece is stored by reference, the bytes its holder file holds
are read and checked against the block CRC32Cs the reference will carry, so a damaged holder is never referenced.

Without it a flipped bit in a holder reaches every later child through their references while each save reports
success. The check costs one range read of the referenced bytes (what loading those pieces reads): a process checks
a holder range at most once per VERIFY_REFERENCED_EVERY seconds, so a run's saves that reference one frozen base do
not each read it again (on an object store, each read is egress).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import crc32c

from shardckpt import knobs
from shardckpt.errors import ShardckptError
from shardckpt.storage import Storage
from shardckpt.write.parent import Holder

BATCH_BYTES = knobs.VERIFY_CHUNK  # bytes read per batch of range requests (each request at most MAX_REQUEST)

# Holder ranges this process found intact, and when: (holder root, file path, offset, size) -> monotonic seconds.
# A file's path names its attempt, and committed files never change, so a key never names other bytes.
_verified: dict[tuple[str, str, int, int], float] = {}
_verified_lock = threading.Lock()


def unchecked(root: Storage, holders: Sequence[Holder], every: float) -> list[int]:
    """Indexes of `holders` this process has not found intact within the last `every` seconds."""
    now = time.monotonic()
    with _verified_lock:
        return [
            index
            for index, holder in enumerate(holders)
            if now - _verified.get(_key(root, holder), -float("inf")) >= every
        ]


def mark_intact(root: Storage, holders: Sequence[Holder]) -> None:
    now = time.monotonic()
    with _verified_lock:
        for holder in holders:
            _verified[_key(root, holder)] = now


def _key(root: Storage, holder: Holder) -> tuple[str, str, int, int]:
    return (root.url, holder.file.path, holder.offset, holder.nbytes)


def damaged_holders(root: Storage, holders: Sequence[Holder]) -> dict[int, str]:
    """index in `holders` -> why its bytes cannot be referenced: a block whose CRC32C differs from the holder's
    record, or a read that failed (a holder file gone, shorter, unreadable). `root` holds the holder files."""
    segments = []  # (holder index, first block, path, start, end): block-aligned, at most MAX_REQUEST bytes each
    for index, holder in enumerate(holders):
        if holder.stored is not None and holder.stored_offset is not None:
            segments.extend(_stored_segments(index, holder))
            continue
        step = max(holder.block_size, knobs.MAX_REQUEST // holder.block_size * holder.block_size)
        for begin in range(0, holder.nbytes, step):
            end = min(holder.nbytes, begin + step)
            at = holder.offset + begin
            segments.append((index, begin // holder.block_size, holder.file.path, at, holder.offset + end))
    damaged: dict[int, str] = {}
    batch: list[tuple[int, int, str, int, int]] = []
    batch_bytes = 0
    for segment in [*segments, None]:
        if segment is not None and (not batch or batch_bytes + segment[4] - segment[3] <= BATCH_BYTES):
            batch.append(segment)
            batch_bytes += segment[4] - segment[3]
            continue
        _check_batch(root, holders, batch, damaged)
        batch, batch_bytes = ([segment], segment[4] - segment[3]) if segment is not None else ([], 0)
    return damaged


def _stored_segments(index: int, holder: Holder) -> list[tuple[int, int, str, int, int]]:
    """A compressed holder's stored blocks (SPEC 6.2) in segments of whole blocks, each at most MAX_REQUEST bytes
    (or one block)."""
    assert holder.stored is not None and holder.stored_offset is not None
    sizes = [int(size) for size in holder.stored.tolist()]
    segments = []
    first, at, begin = 0, holder.stored_offset, holder.stored_offset
    for number, size in enumerate(sizes):
        if at > begin and at + size - begin > knobs.MAX_REQUEST:
            segments.append((index, first, holder.file.path, begin, at))
            first, begin = number, at
        at += size
    segments.append((index, first, holder.file.path, begin, at))
    return segments


def _check_batch(
    root: Storage, holders: Sequence[Holder], batch: list[tuple[int, int, str, int, int]], damaged: dict[int, str]
) -> None:
    batch = [segment for segment in batch if segment[0] not in damaged]
    if not batch:
        return
    results: list[bytes | ShardckptError]
    try:
        results = list(root.read_ranges([(path, start, end) for _, _, path, start, end in batch]))
    except ShardckptError:
        results = [_read(root, path, start, end) for _, _, path, start, end in batch]  # the failure names its holder
    for (index, first, path, start, end), data in zip(batch, results):
        if isinstance(data, ShardckptError):
            damaged.setdefault(index, f"{root.describe(path)}: cannot read bytes {start}..{end}: {data}")
            continue
        if len(data) != end - start:
            damaged.setdefault(index, f"{root.describe(path)}: {len(data)} bytes at {start}, expected {end - start}")
            continue
        why = _mismatch(holders[index], first, memoryview(data))
        if why is not None:
            damaged.setdefault(index, f"{root.describe(path)}: {why}")


def _read(root: Storage, path: str, start: int, end: int) -> bytes | ShardckptError:
    try:
        return root.read_range(path, start, end)
    except ShardckptError as exc:
        return exc


def _mismatch(holder: Holder, first: int, view: memoryview) -> str | None:
    if holder.stored is not None:  # compressed: stored blocks of their own sizes, checked by their stored CRC32C
        at = 0
        for block in range(first, len(holder.stored)):
            if at >= len(view):
                break
            size = int(holder.stored[block])
            if crc32c.crc32c(view[at : at + size]) != int(holder.crc32c[block]):
                return f"stored block {block} of the piece at byte {holder.offset} does not match its CRC32C"
            at += size
        return None
    size = holder.block_size
    for number, at in enumerate(range(0, len(view), size)):
        block = first + number
        if block >= len(holder.crc32c):
            return f"the piece at byte {holder.offset} has no CRC32C recorded for its block {block}"
        if crc32c.crc32c(view[at : at + size]) != int(holder.crc32c[block]):
            return f"block {block} of the piece at byte {holder.offset} does not match its CRC32C"
    return None


class DamagedHolderWarning(UserWarning):
    """An incremental save found a parent's piece damaged in its holder file: it wrote the piece anew instead."""
