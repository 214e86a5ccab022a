"""Blocks encoded on threads ahead of the one writer that takes them in file order (format 1.2, SPEC 4.1).

At the codec's pace the writer waits for every block's encoder. At the storage's pace it never waits: the blocks of a
job it reaches that are not encoded yet are stored as they are (raw), and the encoders jump ahead of it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import crc32c

from shardckpt.errors import ShardckptUsageError

PACES = ("codec", "storage")  # what compression_pace= accepts; "codec" is the default (guide: "Save pace")
_PENDING, _STARTED, _DONE, _RAW = 0, 1, 2, 3
UNCHECKSUMMED = -1  # the CRCs of a block take(checksum_raw=False) returned raw: the caller computes them


class Encoder(Protocol):
    def encode(self, raw: bytes | memoryview, dtype: str) -> bytes | memoryview: ...


# Logical bytes an encoder claims and encodes at once (one hand-off under the lock, and with a run encoder one
# grouping pass): about 0.5 ms of one core, short enough that a writer overtaking it drops little work.
STRETCH = 256 << 10
OVERTAKEN_REST_MAX = 8  # times its own encoding time an encoder overtaken again and again rests, at most


class Stored(NamedTuple):
    """One block as the file stores it, the CRC32C of those bytes and of its logical bytes."""

    data: bytes | memoryview
    crc32c: int
    logical_crc32c: int


class _Stretch(NamedTuple):
    first: int  # index of its first block in the flat block arrays
    blocks: int  # how many
    run: int  # which run of the job
    start: int  # byte offsets in the run
    end: int


class EncodeAhead:
    """Encoder threads over `jobs` (each a sequence of runs: (logical bytes, dtype)), at most `window` jobs ahead of
    the writer; `take(j)` returns job j's stored blocks in order. A run is cut into blocks of `block_size` bytes
    (None: every run is one block). A context manager: leaving it stops and joins the threads, whether the writer
    finished or failed; an encoder's exception is raised by the writer's next take()."""

    def __init__(
        self,
        jobs: Sequence[Sequence[tuple[memoryview, str]]],
        make_encoder: Callable[[], Encoder],
        *,
        threads: int,
        window: int,
        storage_pace: bool,
        block_size: int | None = None,
        stretch: int = STRETCH,
    ) -> None:
        self._jobs = jobs
        self._block_size = block_size
        self._blocks: list[list[memoryview]] = []  # every job's blocks, in file order
        self._stretches: list[list[_Stretch]] = []
        self._first = [0]  # index of each job's first block in the flat block arrays
        for job in jobs:
            blocks, stretches = _cut(job, self._first[-1], block_size, stretch)
            self._blocks.append(blocks)
            self._stretches.append(stretches)
            self._first.append(self._first[-1] + len(blocks))
        self._state = bytearray(self._first[-1])
        self._results: dict[int, Stored] = {}
        self._make_encoder, self._window, self._storage_pace = make_encoder, max(1, window), storage_pace
        self._cond = threading.Condition()
        self._next_job = 0  # the next job an idle encoder takes (codec pace)
        self._claimed = bytearray(len(jobs))  # jobs an encoder took (storage pace)
        self._taken = 0  # jobs the writer has entered (at the storage's pace, those are its own)
        self._stop = False
        self._error: BaseException | None = None
        self.failed_block: int | None = None  # the block whose encoder raised (None: none, or not in a block)
        self.raw_blocks = 0  # blocks the writer took as they were (storage pace only)
        self._threads = [
            threading.Thread(target=self._encode_jobs, name=f"shardckpt-compress-{n}", daemon=True)
            for n in range(max(1, threads))
        ]

    def __enter__(self) -> EncodeAhead:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()

    @property
    def error(self) -> BaseException | None:
        """What an encoder raised, if one did."""
        return self._error

    def blocks(self, number: int) -> list[memoryview]:
        """Job `number`'s blocks (logical bytes), in file order."""
        return self._blocks[number]

    def take(self, number: int, *, checksum_raw: bool = True) -> list[Stored] | None:
        """Job `number`'s blocks as stored; jobs are taken in order, each once. checksum_raw=False: a block the
        writer took raw comes with both CRCs UNCHECKSUMMED, for the caller to compute where it writes the block,
        and a job whose every block it took raw is None (its blocks() are what to store)."""
        first, end = self._first[number], self._first[number + 1]
        with self._cond:
            if self._error is not None:  # at the storage's pace too: a failing encoder is a bug to report
                raise self._error
            self._taken = number + 1
            whole = False
            if self._storage_pace:
                # Every block of the job not encoded yet is the writer's, at once: it never waits, not even for a
                # block an encoder is working on (on a busy machine an encoder thread may wait for a core for
                # milliseconds; measured: the writer waited 2.6-3.0 s of a 256 MiB save). That block's result is
                # dropped: at most one stretch per encoder per job is encoded in vain.
                if self._state.count(_DONE, first, end) == 0:  # the usual case when the storage is fast: one step
                    self._state[first:end] = bytes([_RAW]) * (end - first)
                    self.raw_blocks += end - first
                    whole = True
                else:
                    for index in range(first, end):
                        if self._state[index] != _DONE:
                            self._state[index] = _RAW
                            self.raw_blocks += 1
            self._cond.notify_all()  # the window moved on
        if whole and not checksum_raw:
            return None
        blocks: list[Stored] = []
        for index in range(first, end):
            if self._state[index] == _RAW:  # only this thread sets RAW: its logical bytes are its stored bytes
                raw = self._blocks[number][index - first]
                crc = raw_crc32c(raw) if checksum_raw else UNCHECKSUMMED
                blocks.append(Stored(raw, crc, crc))
                continue
            with self._cond:
                while (stored := self._results.pop(index, None)) is None:
                    if self._error is not None:
                        raise self._error
                    self._cond.wait()
            blocks.append(stored)
        return blocks

    def _claim_job(self) -> int | None:
        """The next job to encode, or None when the threads should end."""
        with self._cond:
            while True:
                if self._stop or self._error is not None:
                    return None
                if not self._storage_pace:  # in order: the writer waits for each job's blocks in turn
                    if self._next_job >= len(self._jobs):
                        return None
                    if self._next_job < max(self._taken - 1, 0) + self._window:  # the job being written and after
                        self._next_job += 1
                        return self._next_job - 1
                else:
                    # Jobs the writer entered are its own. Of the others in the window, the farthest first: the
                    # nearest is overtaken before much of it is encoded when the storage is faster than the encoders
                    # (that work is dropped), and when it is slower every job in the window is encoded anyway.
                    if self._taken >= len(self._jobs):
                        return None
                    end = min(max(self._taken - 1, 0) + self._window, len(self._jobs))
                    for number in range(end - 1, self._taken - 1, -1):
                        if not self._claimed[number]:
                            self._claimed[number] = 1
                            return number
                self._cond.wait()

    def _encode_jobs(self) -> None:
        encoder: Encoder | None = None
        block: int | None = None
        if self._storage_pace:
            _lowest_priority()
        overtaken = 0  # stretches in a row the writer took before they were encoded (storage pace)
        try:
            while (number := self._claim_job()) is not None:
                if encoder is None:  # made in this thread: an encoder is not thread-safe
                    encoder = self._make_encoder()
                for stretch in self._stretches[number]:
                    first, count = stretch.first, stretch.blocks
                    with self._cond:
                        if self._stop or self._state[first] != _PENDING:
                            break  # the writer took the job raw: it is ahead, so jump ahead of it
                        self._state[first : first + count] = bytes([_STARTED]) * count
                    block = first  # a failure names the stretch's first block
                    began = time.perf_counter()
                    stored = self._encode(encoder, number, stretch)
                    block = None
                    with self._cond:
                        if self._state[first] == _RAW:  # the writer takes a job's blocks all at once
                            # It took these meanwhile (storage pace): the storage outruns the encoders, and their
                            # work was dropped. Each drop in a row doubles a rest (up to OVERTAKEN_REST_MAX of the
                            # stretch's own time) before the next claim: CPU spent in vain still costs a writer on
                            # a small machine (2 cores: 0.80-0.89x a raw save's throughput encoding flat out, against
                            # 0.93-1.0 with idle encoders), while against a slower storage nothing is dropped.
                            overtaken += 1
                            rest = (time.perf_counter() - began) * min(2 ** (overtaken - 1), OVERTAKEN_REST_MAX)
                            self._cond.wait_for(lambda: self._stop, timeout=rest)
                            break  # then jump ahead of it
                        overtaken = 0
                        for index, result in enumerate(stored, first):
                            self._results[index] = result
                        self._state[first : first + count] = bytes([_DONE]) * count
                        self._cond.notify_all()
        except BaseException as exc:  # the writer raises it; the other encoders end
            with self._cond:
                if self._error is None:  # the first failure is the one the writer reports
                    self._error, self.failed_block = exc, block
                self._cond.notify_all()

    def _encode(self, encoder: Encoder, number: int, stretch: _Stretch) -> list[Stored]:
        """A stretch's blocks as stored, with their CRCs: in one call where the encoder encodes runs."""
        first = stretch.first - self._first[number]
        raws = self._blocks[number][first : first + stretch.blocks]
        run, dtype = self._jobs[number][stretch.run]
        encode_run = getattr(encoder, "encode_run", None)
        if encode_run is not None and self._block_size is not None:
            datas = encode_run(memoryview(run).cast("B")[stretch.start : stretch.end], dtype, self._block_size)
        else:
            datas = [encoder.encode(raw, dtype) for raw in raws]
        out = []
        for raw, data in zip(raws, datas):
            logical = crc32c.crc32c(raw)
            out.append(Stored(data, logical if len(data) == len(raw) else crc32c.crc32c(data), logical))
        return out


def _cut(
    job: Sequence[tuple[memoryview, str]], first: int, block_size: int | None, stretch: int
) -> tuple[list[memoryview], list[_Stretch]]:
    """A job's blocks (views of its runs) and its stretches: runs of consecutive blocks of one run, about `stretch`
    bytes each, whose first block is flat index `first` onwards."""
    blocks: list[memoryview] = []
    stretches: list[_Stretch] = []
    for number, (run, _) in enumerate(job):
        view = memoryview(run).cast("B")
        size = len(view)
        step = block_size or max(size, 1)
        per = max(stretch // step, 1)
        starts = range(0, size, step) if size or block_size else range(1)  # without block_size: a block per run
        for at in range(0, len(starts), per):
            group = starts[at : at + per]
            stretches.append(_Stretch(first + len(blocks), len(group), number, group[0], min(group[-1] + step, size)))
            blocks.extend(view[start : min(start + step, size)] for start in group)
    return blocks, stretches


def raw_crc32c(raw: bytes | memoryview) -> int:
    """The CRC32C of a block stored raw at the storage's pace, without letting go of the GIL (a 64 KiB CRC takes
    microseconds): each release is a chance for an encoder to take it, and one at nice 19 that a busy machine
    preempts holds it for milliseconds."""
    return int(crc32c.crc32c(raw, gil_release_mode=0))


def _lowest_priority() -> None:
    """Run this thread at nice 19 (Linux: a thread is a task with its own nice value): at the storage's pace the
    encoders get only the CPU that the writer, the training and everything else leave. With 2 cores at load 12,
    256 MiB saves ran at 0.56-1.09x the uncompressed speed this way against 0.25-0.38x at equal priority."""
    if sys.platform == "linux":  # elsewhere PRIO_PROCESS with a thread id could name another process
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def given_pace(pace: Any, compression: str | None) -> str | None:
    """An explicit compression_pace= checked with the compression it comes with: None stays None (the writer then
    follows SHARDCKPT_COMPRESSION_STORAGE_PACE, which an uncompressed save ignores); a pace without compression
    means nothing, so it is refused rather than silently dropped."""
    if pace is None:
        return None
    checked = check_pace(pace)
    if compression is None:
        raise ShardckptUsageError(
            f'compression_pace={checked!r} applies only with compression="zstd" (without compression every block is '
            'stored raw): drop compression_pace or pass compression="zstd"'
        )
    return checked


def check_pace(pace: Any) -> str:
    """A compression_pace value (given, or from its knob) if valid, else ShardckptUsageError naming the valid ones."""
    if pace in PACES:
        return str(pace)
    raise ShardckptUsageError(f"unknown compression_pace {pace!r}: valid are {', '.join(map(repr, PACES))}")
