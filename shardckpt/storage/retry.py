"""Bounded retries with exponential backoff for object-store requests: a policy and the async loop that applies it.

What counts as transient is the caller's decision (a classifier); the bound is both a try count and a deadline.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from shardckpt.errors import ShardckptUsageError, StorageError

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """At most `attempts` tries of one request, and no retry that would end after `deadline` seconds.

    The wait before try n+1 is uniform in [0, min(max_delay, base_delay * 2**(n-1))] ("full jitter"), so
    many ranks hit by one throttling burst do not come back in lockstep.
    """

    attempts: int = 10
    base_delay: float = 0.1
    max_delay: float = 10.0
    deadline: float = 120.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.base_delay < 0 or self.max_delay < 0 or self.deadline <= 0:
            raise ShardckptUsageError(f"invalid retry policy {self}: attempts >= 1, delays >= 0, deadline > 0")

    def delay(self, tries: int) -> float:
        """Seconds to wait after `tries` failed tries."""
        return random.uniform(0.0, min(self.max_delay, self.base_delay * 2 ** (tries - 1)))


class RetriesExhaustedError(StorageError):
    """A request kept failing with transient errors until the policy's try count or deadline ran out."""


async def retrying(
    policy: RetryPolicy,
    what: str,
    call: Callable[[int], Awaitable[T]],
    transient: Callable[[BaseException], bool],
) -> T:
    """`await call(try_number)` until it succeeds, fails for good, or the policy's bound is reached.

    A non-transient error propagates unchanged (the caller maps it); exhausting the bound raises
    RetriesExhaustedError naming `what`, chained to the last error. Each try runs for at most the time left
    before the deadline: a reply that trickles in a byte at a time never trips a socket's read timeout.
    """
    began = time.monotonic()
    tries = 0
    while True:
        tries += 1
        left = policy.deadline - (time.monotonic() - began)
        try:
            async with asyncio.timeout(max(left, 0.0)) as bound:
                return await call(tries)
        except Exception as exc:
            if bound.expired():  # this try ran into the deadline: no time is left for another
                elapsed = time.monotonic() - began
                raise RetriesExhaustedError(
                    f"{what} did not finish within the retry deadline ({policy.deadline:g} s; {tries} tries in "
                    f"{elapsed:.1f} s): the endpoint answers too slowly"
                ) from exc
            if not transient(exc):
                raise
            wait = policy.delay(tries)
            elapsed = time.monotonic() - began
            if tries >= policy.attempts or elapsed + wait > policy.deadline:
                raise RetriesExhaustedError(
                    f"{what} failed {tries} times in {elapsed:.1f} s (retry bound: {policy.attempts} tries, "
                    f"{policy.deadline:g} s); last error: {type(exc).__name__}: {exc}"
                ) from exc
            await asyncio.sleep(wait)
