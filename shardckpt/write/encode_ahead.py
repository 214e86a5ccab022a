"""Blocks encoded on threads ahead of the one writer that takes them in file order (format 1.2, SPEC 4.1).

At the codec's pace the writer waits for every block's encoder. At the storage's pace it never waits: the blocks of a
job it reaches that are not encoded yet are stored as they are (raw), and the encoders jump ahead of it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import crc32c

from shardckpt.errors import ShardckptUsageError

PACES = ("codec", "storage")  # what compression_pace= accepts; "codec" is the default (guide: "Save pace")
_PENDING, _STARTED, _DONE, _RAW = 0, 1, 2, 3


class Encoder(Protocol):
    def encode(self, raw: bytes | memoryview, dtype: str) -> bytes | memoryview: ...


class Stored(NamedTuple):
    """One block as the file stores it, the CRC32C of those bytes and of its logical bytes."""

    data: bytes | memoryview
    crc32c: int
    logical_crc32c: int


class EncodeAhead:
    """Encoder threads over `jobs` (each a run of (logical bytes, dtype) blocks), at most `window` jobs ahead of the
    writer; `take(j)` returns job j's stored blocks in order. A context manager: leaving it stops and joins the
    threads, whether the writer finished or failed; an encoder's exception is raised by the writer's next take()."""

    def __init__(
        self,
        jobs: Sequence[Sequence[tuple[memoryview, str]]],
        make_encoder: Callable[[], Encoder],
        *,
        threads: int,
        window: int,
        storage_pace: bool,
    ) -> None:
        self._jobs = jobs
        self._first = [0]  # index of each job's first block in the flat block arrays
        for job in jobs:
            self._first.append(self._first[-1] + len(job))
        self._state = bytearray(self._first[-1])
        self._results: dict[int, Stored] = {}
        self._make_encoder, self._window, self._storage_pace = make_encoder, max(1, window), storage_pace
        self._cond = threading.Condition()
        self._next_job = 0  # the next job an idle encoder takes
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

    def take(self, number: int) -> list[Stored]:
        """Job `number`'s blocks as stored; jobs are taken in order, each once."""
        first, end = self._first[number], self._first[number + 1]
        with self._cond:
            if self._error is not None:  # at the storage's pace too: a failing encoder is a bug to report
                raise self._error
            self._taken = number + 1
            if self._storage_pace:
                # Every block of the job not encoded yet is the writer's, at once: it never waits, not even for a
                # block an encoder is working on (on a busy machine an encoder thread may wait for a core for
                # milliseconds; measured: the writer waited 2.6-3.0 s of a 256 MiB save). That block's result is
                # dropped: at most one block per encoder per job is encoded in vain.
                for index in range(first, end):
                    if self._state[index] != _DONE:
                        self._state[index] = _RAW
                        self.raw_blocks += 1
            self._cond.notify_all()  # the window moved on
        blocks: list[Stored] = []
        for index in range(first, end):
            if self._state[index] == _RAW:  # only this thread sets RAW: its logical bytes are its stored bytes
                raw = self._jobs[number][index - first][0]
                # Without letting go of the GIL (a 64 KiB CRC takes microseconds): each release is a chance for an
                # encoder to take it, and one at nice 19 that a busy machine preempts holds it for milliseconds.
                crc = crc32c.crc32c(raw, gil_release_mode=0)
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
                if self._storage_pace:  # jobs the writer already entered are its own
                    self._next_job = max(self._next_job, self._taken)
                if self._next_job >= len(self._jobs):
                    return None
                if self._next_job < max(self._taken - 1, 0) + self._window:  # the job being written and after
                    self._next_job += 1
                    return self._next_job - 1
                self._cond.wait()

    def _encode_jobs(self) -> None:
        encoder: Encoder | None = None
        block: int | None = None
        if self._storage_pace:
            _lowest_priority()
        try:
            while (number := self._claim_job()) is not None:
                if encoder is None:  # made in this thread: an encoder is not thread-safe
                    encoder = self._make_encoder()
                first = self._first[number]
                for offset, (raw, dtype) in enumerate(self._jobs[number]):
                    with self._cond:
                        if self._stop or self._state[first + offset] != _PENDING:
                            break  # the writer took this block raw: it is ahead, so jump ahead of it
                        self._state[first + offset] = _STARTED
                    block = first + offset
                    data = encoder.encode(raw, dtype)
                    logical = crc32c.crc32c(raw)
                    stored = Stored(data, logical if len(data) == len(raw) else crc32c.crc32c(data), logical)
                    block = None
                    with self._cond:
                        if self._state[first + offset] == _RAW:
                            break  # the writer took it meanwhile (storage pace): it is ahead, so jump ahead of it
                        self._results[first + offset] = stored
                        self._state[first + offset] = _DONE
                        self._cond.notify_all()
        except BaseException as exc:  # the writer raises it; the other encoders end
            with self._cond:
                if self._error is None:  # the first failure is the one the writer reports
                    self._error, self.failed_block = exc, block
                self._cond.notify_all()


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
