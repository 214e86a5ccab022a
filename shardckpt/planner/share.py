"""Shared reads: in a collective load, which rank fetches each stored byte range that ranks need, and which ranks it
hands those bytes to, so that every byte is read from storage once per job however many replicas need it.

Pure: ranks' needs in, assignments out. The exchange itself (distributed/) and the checks (every consumer verifies
the block checksums of what it uses, whoever fetched it) live elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from shardckpt.errors import ShardckptUsageError

Range = tuple[int, int, int]  # (file, start, end): bytes [start, end) of a data file, by its piece-table index


@dataclass(frozen=True)
class Segment:
    """Bytes [start, end) of `file`, all needed by the same ranks (`consumers`, ascending), fetched by `reader`."""

    file: int
    start: int
    end: int
    reader: int
    consumers: tuple[int, ...]

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SharePlan:
    """Every byte range any rank needs, once, with its reader; the same on every rank that plans it."""

    world: int
    segments: tuple[Segment, ...]  # ascending (file, start), disjoint
    # Each rank's host as it claims it (None: unknown or no shared memory), when the planner was told: ranks that
    # claim one host try to hand bytes over through shared memory (distributed/host_memory.py).
    hosts: tuple[str | None, ...] | None = None

    @property
    def overlaps(self) -> bool:
        """Whether two ranks need some byte: only then does sharing save a read."""
        return any(len(segment.consumers) > 1 for segment in self.segments)

    @property
    def repeated_bytes(self) -> int:
        """Bytes the ranks would read more than once if each read its own: what sharing saves."""
        return sum(segment.size * (len(segment.consumers) - 1) for segment in self.segments)

    @property
    def total_bytes(self) -> int:
        """Bytes some rank needs, each counted once: what a shared read fetches."""
        return sum(segment.size for segment in self.segments)

    def read_bytes(self, rank: int) -> int:
        """Bytes `rank` fetches from storage."""
        return sum(s.size for s in self.segments if s.reader == rank)

    def rounds(self, budget: int) -> Iterator[tuple[Segment, ...]]:
        """The segments in groups (each ascending) in which no rank fetches plus receives more than `budget` bytes
        (a larger segment with nothing else of its ranks): the memory one exchange holds in flight per rank.
        Each segment goes to the first group where all its ranks still have room, so ranks that share nothing fill
        a group side by side: about (the busiest rank's bytes / budget) groups, not (the job's bytes / budget),
        and each group is a collective of the whole job."""
        groups: list[list[Segment]] = []
        loads: dict[int, list[int]] = {}  # rank -> its bytes in each group so far
        first_open: dict[int, int] = {}  # rank -> groups before this one are full to within a chunk for it
        for segment in self.segments:
            involved = {segment.reader, *segment.consumers}
            size = segment.size
            number = min(first_open.get(rank, 0) for rank in involved)
            while number < len(groups):
                if all(_load(loads, rank, number) + size <= budget for rank in involved):
                    break
                number += 1
            if number == len(groups):
                groups.append([])
            groups[number].append(segment)
            for rank in involved:
                per = loads.setdefault(rank, [])
                per.extend([0] * (number + 1 - len(per)))
                per[number] += size
                while first_open.get(rank, 0) < len(per) and per[first_open.get(rank, 0)] + size > budget:
                    first_open[rank] = first_open.get(rank, 0) + 1
        for group in groups:
            yield tuple(group)


def _load(loads: dict[int, list[int]], rank: int, number: int) -> int:
    per = loads.get(rank)
    return per[number] if per is not None and number < len(per) else 0


def plan_shared_reads(
    needs: Sequence[Sequence[Range]],
    *,
    chunk: int,
    nodes: Sequence[int] | None = None,
    hosts: Sequence[str | None] | None = None,
) -> SharePlan:
    """Assign every byte that some rank of `needs` (one list of ranges per rank) wants to one reader.

    The ranges of all ranks are cut into segments at every range boundary (and into pieces of at most `chunk`
    bytes, so one large tensor is spread over many readers); each segment is fetched by one of the ranks that
    need it: on the node (`nodes[rank]`, when known) where most of its consumers are, the one with the fewest
    bytes to fetch so far, ties to the lower rank. Deterministic: every rank computes the same plan.
    hosts: each rank's host (see SharePlan.hosts), carried along for the exchange.
    """
    if chunk < 1:
        raise ShardckptUsageError(f"chunk must be at least 1 byte, got {chunk}")
    world = len(needs)
    if nodes is not None and len(nodes) != world:
        raise ShardckptUsageError(f"nodes names {len(nodes)} ranks, needs {world}")
    if hosts is not None and len(hosts) != world:
        raise ShardckptUsageError(f"hosts names {len(hosts)} ranks, needs {world}")
    events: dict[int, list[tuple[int, int, int]]] = {}  # file -> (position, +1/-1, rank)
    for rank, ranges in enumerate(needs):
        for file, start, end in ranges:
            if not 0 <= start < end:
                raise ShardckptUsageError(f"rank {rank} needs an empty or negative range {start}:{end} of file {file}")
            events.setdefault(file, []).extend(((start, 1, rank), (end, -1, rank)))
    load = [0] * world
    homes: dict[tuple[int, ...], tuple[int, ...]] = {}  # consumers -> those of them on their home node
    merged: list[Segment] = []
    # Adjacent pieces with the same file, reader and consumers are merged as they are cut, up to `chunk` bytes (fewer
    # reads), without a Segment per piece: at 4,096 ranks with 64 ranges each the planner made 131,072 pieces for
    # 16,384 segments and took 1.4 s a rank, every rank of the job alike.
    file_now, low, high, reader_now = -1, 0, 0, -1
    consumers_now: tuple[int, ...] = ()
    for file in sorted(events):
        active: dict[int, int] = {}  # rank -> how many of its ranges cover the position (overlaps allowed)
        previous = None
        consumers: tuple[int, ...] | None = None  # tuple(sorted(active)), made again after active changes
        for position, delta, rank in sorted(events[file]):
            if previous is not None and position > previous and active:
                if consumers is None:
                    consumers = tuple(sorted(active))
                candidates = homes.get(consumers)
                if candidates is None:
                    candidates = homes[consumers] = _home(consumers, nodes)
                for start in range(previous, position, chunk):
                    end = min(position, start + chunk)
                    reader = candidates[0]  # the fewest bytes so far, ties to the lower rank (candidates ascend)
                    for other in candidates[1:]:
                        if load[other] < load[reader]:
                            reader = other
                    load[reader] += end - start
                    if (file, start, reader, consumers) == (file_now, high, reader_now, consumers_now) and (
                        end - low <= chunk
                    ):
                        high = end
                        continue
                    if reader_now >= 0:
                        merged.append(Segment(file_now, low, high, reader_now, consumers_now))
                    file_now, low, high, reader_now, consumers_now = file, start, end, reader, consumers
            count = active.get(rank, 0) + delta
            if count:
                active[rank] = count
            else:
                del active[rank]
            consumers = None
            previous = position
    if reader_now >= 0:
        merged.append(Segment(file_now, low, high, reader_now, consumers_now))
    return SharePlan(world, tuple(merged), None if hosts is None else tuple(hosts))


def _home(consumers: tuple[int, ...], nodes: Sequence[int] | None) -> tuple[int, ...]:
    """The consumers on the node where most of them are (ties to the lowest node), ascending; all without nodes."""
    if nodes is None:
        return consumers
    counts: dict[int, int] = {}
    for rank in consumers:
        counts[nodes[rank]] = counts.get(nodes[rank], 0) + 1
    best = max(counts.values())
    home = min(node for node, count in counts.items() if count == best)
    return tuple(rank for rank in consumers if nodes[rank] == home)
