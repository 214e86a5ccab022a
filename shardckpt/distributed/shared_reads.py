"""Collective loads that read each stored byte once per job: the ranks swap the byte ranges their plans need, one
rank fetches each range (planner.share) and hands it to the others that need it: through its shared-memory region
to the ranks of its host (host_memory), by all_to_all over the group to the others.

A peer's bytes are trusted no more than storage's: every rank verifies the block checksums of each of its own read
requests once it is whole, whoever fetched its parts. Memory: a rank holds the requests still arriving (all of them
for verify_first) plus at most `budget` bytes fetched or received: SHARE_DEPTH rounds of that share of it, the
later ones being read while the earliest is handed over and checked.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import functools
import itertools
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack
import numpy as np
import torch
import torch.distributed as dist

from shardckpt import knobs
from shardckpt.distributed.collectives import Group, all_gather_bytes, any_and_least, smallest
from shardckpt.distributed.host_memory import HostLinks, PeerFailed, Region, host_key, links_for
from shardckpt.errors import DistributedError, IntegrityError, ShardckptError, TruncatedError
from shardckpt.planner import ReadPlan, ReadRequest
from shardckpt.planner.share import Segment, SharePlan, plan_shared_reads
from shardckpt.read.checkpoint import Checkpoint
from shardckpt.read.fetching import ByteArray, Step

HINTED = 2  # rounds of its own reads a rank announces to the storage ahead of the one it reads
CHECK_LAG = 1  # rounds a rank's checks may run behind the votes (with SHARE_DEPTH of at least 3)


def node_ids(group: Group) -> list[int] | None:
    """Each rank's node, from SHARDCKPT_NODE or torchrun's GROUP_RANK (None when neither is set anywhere)."""
    return _nodes_and_hosts(group, with_hosts=False)[0]


def _nodes_and_hosts(group: Group, *, with_hosts: bool) -> tuple[list[int] | None, list[str | None]]:
    """node_ids, and each rank's host_key() (None everywhere unless with_hosts), in one collective."""
    node = os.environ.get("SHARDCKPT_NODE", os.environ.get("GROUP_RANK"))
    mine = [node, host_key() if with_hosts else None]
    known = [msgpack.unpackb(b) for b in all_gather_bytes(group, msgpack.packb(mine))]
    hosts = [host if isinstance(host, str) else None for _, host in known]
    if any(node is None for node, _ in known):
        return None, hosts
    names = {name: index for index, name in enumerate(sorted({node for node, _ in known}))}
    return [names[node] for node, _ in known], hosts


@dataclass
class Exchange:
    """A shared read as every rank agreed on it in one gather: the plan, the rounds' depth and size (the smallest of
    the ranks' choices), every rank's /dev/shm region as reserved before it (name, size; "" where none) and this
    rank's own (released once its peers have opened it, or when the read ends)."""

    share: SharePlan
    depth: int
    round_bytes: int
    published: tuple[tuple[str, int], ...]
    reserved: Region | None
    checkers: int  # this rank's SHARE_CHECKERS (its own: threads need no agreement)

    def release(self) -> None:
        if self.reserved is not None:
            self.reserved.release()


def plan_exchange(
    group: Group,
    plan: ReadPlan,
    *,
    only_across_nodes: bool,
    chunk: int | None = None,
    shared_memory: bool | None = None,
    budget: int | None = None,
) -> Exchange | None:
    """Every rank's needs, gathered, turned into the one plan every rank computes alike; None (on every rank)
    when the ranks reading on their own would read at most SHARE_MIN_SAVING more bytes than once, or when
    only_across_nodes and the ranks do not span two nodes. One gather carries everything the ranks must agree on
    (nodes, hosts, needs, every knob that cuts the rounds, the regions' names): each collective costs every rank
    of the job a few milliseconds (gloo on 4 ranks here: 4 ms an all_gather, 1 ms an all_reduce).
    chunk: the largest segment (None: knobs.MAX_REQUEST); the smallest of the ranks' choices is used.
    shared_memory: also learn which ranks claim one host, and reserve this rank's region (None: knobs.SHARE_MEMORY).
    budget: bytes in flight per rank (max_in_flight): rounds of budget / SHARE_DEPTH, at most SHARE_ROUND."""
    reserved: Region | None = None
    cause = knob_cause = None
    failure: BaseException | None = None
    depth = rounds = checkers = 0
    saving = 0.0
    host = None
    try:
        # A malformed SHARDCKPT_SHARE_* on some ranks travels in the gather too (raising here would leave the others
        # waiting in it), and fails the load only where the ranks share.
        depth, rounds, chunk, checkers = _knob_choices(budget, chunk)
        saving = knobs.SHARE_MIN_SAVING
        host = host_key() if _shared_memory(shared_memory) else None
    except ShardckptError as exc:
        knob_cause, failure = f"{type(exc).__name__}: {exc}", exc
    try:
        # Sparse until the plan says how much of it this rank's reads fill (HostLinks.build allocates that).
        reserved = Region.create(depth * max(rounds, chunk or 1)) if host is not None else None
    except Exception as exc:  # said in the gather, so that no rank waits for this one in a later collective
        cause, failure = f"{type(exc).__name__}: {exc}", exc
    node = os.environ.get("SHARDCKPT_NODE", os.environ.get("GROUP_RANK"))
    needs = [(request.file, request.start, request.end) for request in plan.requests]
    region = (reserved.name, reserved.size) if reserved is not None else ("", 0)
    mine = Offer(node, host, chunk, needs, depth, rounds, saving, region, cause, knob_cause)
    try:
        offers = read_offers(all_gather_bytes(group, mine.encode()))
        failed = {rank: offer.cause for rank, offer in enumerate(offers) if offer.cause is not None}
        if failed:
            if cause is not None and failure is not None:
                raise failure
            raise PeerFailed(f"another rank failed to set up a shared read: {failed}")
        nodes = nodes_of(offers)
        if only_across_nodes and (nodes is None or len(set(nodes)) < 2):
            _released(reserved)
            return None
        refused = {rank: offer.knob_cause for rank, offer in enumerate(offers) if offer.knob_cause is not None}
        if refused:
            if knob_cause is not None and failure is not None:
                raise failure
            raise PeerFailed(f"another rank refused a setting of shared reads: {refused}")
        agreed = agree(offers, nodes)
        if agreed is None:
            _released(reserved)
            return None
        return Exchange(*agreed, reserved, checkers)
    except BaseException:
        _released(reserved)
        raise


class Offer(NamedTuple):
    """What one rank brings to the exchange's gather (msgpack, no pickle)."""

    node: str | None  # SHARDCKPT_NODE or GROUP_RANK
    host: str | None  # host_key(), None without shared memory
    chunk: int | None  # largest segment
    needs: Sequence[tuple[int, int, int]]  # (file, start, end) of each read request
    depth: int  # SHARE_DEPTH
    rounds: int  # bytes a round
    saving: float  # SHARE_MIN_SAVING
    region: tuple[str, int]  # its /dev/shm region as reserved (name, size), ("", 0) for none
    cause: str | None  # why it could not set up (every rank then raises)
    knob_cause: str | None  # a refused SHARDCKPT_SHARE_* (raised where the ranks share)

    def encode(self) -> bytes:
        return bytes(msgpack.packb(list(self)))


def read_offers(gathered: Sequence[bytes]) -> list[Offer]:
    """Every rank's Offer; tuples straight from msgpack (4,096 ranks of 64 ranges: 0.10 s, not 0.26 s as lists).
    An offer of another shape (a rank running another shardckpt) fails every rank alike, typed."""
    offers = []
    for rank, data in enumerate(gathered):
        fields = msgpack.unpackb(data, use_list=False)
        if not isinstance(fields, tuple) or len(fields) != len(Offer._fields):
            raise DistributedError(
                "load", {rank: "its shared-read offer has another shape: does it run another version of shardckpt?"}
            )
        offers.append(Offer(*fields))
    return offers


def nodes_of(offers: Sequence[Offer]) -> list[int] | None:
    """Each rank's node as a number, or None when some rank names none."""
    if any(offer.node is None for offer in offers):
        return None
    numbers = {name: index for index, name in enumerate(sorted({str(offer.node) for offer in offers}))}
    return [numbers[str(offer.node)] for offer in offers]


def agree(
    offers: Sequence[Offer], nodes: Sequence[int] | None
) -> tuple[SharePlan, int, int, tuple[tuple[str, int], ...]] | None:
    """The plan, rounds in flight, bytes a round and every rank's region, as every rank computes them alike from
    the offers; None when sharing is not worth it. Pure: what each rank of a job spends before its first round."""
    hosts = [offer.host if isinstance(offer.host, str) else None for offer in offers]
    # Every rank cuts the segments and rounds alike (SHARDCKPT_MAX_REQUEST, max_in_flight, SHARE_ROUND or
    # SHARE_DEPTH may differ between ranks: each would plan another exchange, and the ranks' collectives would
    # not match, or a reader would overwrite a part of a region that a peer still reads).
    chunk = max(1, min(int(offer.chunk or 1) for offer in offers))
    share = plan_shared_reads([offer.needs for offer in offers], chunk=chunk, nodes=nodes, hosts=hosts)
    # Worth it only where the ranks would read much twice: a reshard whose ranges touch at their edges (2x2 ->
    # 1x3: 3% more bytes read alone) would route every byte through the exchange to save a few. The largest of
    # the ranks' SHARDCKPT_SHARE_MIN_SAVING decides for all.
    saving = max(float(offer.saving) for offer in offers)
    if not (share.overlaps and share.repeated_bytes > saving * share.total_bytes):
        return None
    depth = max(2, min(int(offer.depth) for offer in offers))
    rounds = max(1, min(int(offer.rounds) for offer in offers))
    return share, depth, rounds, tuple((str(offer.region[0]), int(offer.region[1])) for offer in offers)


def _released(region: Region | None) -> None:
    if region is not None:
        region.release()


class _Assembly:
    """This rank's requests and the pieces of them each round brings (views of a reader's region, of what arrived,
    or of what this rank fetched); a request that one round brings whole and in one run of memory is used where it
    lies, the others are assembled in a buffer of their own."""

    def __init__(self, requests: Sequence[ReadRequest]) -> None:
        self.requests = requests
        self.slots: dict[int, ByteArray] = {}
        self.filled = [0] * len(requests)
        self.pieces: dict[int, list[tuple[int, int, ByteArray, int, bool]]] = {}  # this round's, per request
        self.by_file: dict[int, list[tuple[int, int, int]]] = {}  # file -> sorted (start, end, request number)
        # file -> the largest end of its spans up to each one: a rank's requests may overlap (a strided read cut at
        # max_request), so a span that starts before a segment may still reach into it.
        self.reach: dict[int, list[int]] = {}
        for number, request in enumerate(requests):
            self.by_file.setdefault(request.file, []).append((request.start, request.end, number))
        for file, spans in self.by_file.items():
            spans.sort()
            self.reach[file] = list(itertools.accumulate((end for _, end, _ in spans), max))

    def place(self, segment: Segment, source: ByteArray, offset: int, transient: bool) -> None:
        """A segment's bytes are source[offset : offset + size] (transient: overwritten after the next round)."""
        spans = self.by_file.get(segment.file, [])
        at = bisect.bisect_right(self.reach.get(segment.file, []), segment.start)  # the first span reaching past it
        for start, end, number in spans[at:]:
            if start >= segment.end:
                break
            low, high = max(start, segment.start), min(end, segment.end)
            if low < high:
                piece = (low, high, source, offset + low - segment.start, transient)
                self.pieces.setdefault(number, []).append(piece)

    def settle(self, keep: bool) -> list[tuple[int, ByteArray]]:
        """The requests this round completed, with their bytes. keep: the caller keeps them past the round, so
        none may be a view of a region that a later round overwrites."""
        complete = []
        for number, pieces in self.pieces.items():
            size = self.requests[number].size
            pieces.sort(key=lambda piece: piece[0])
            whole = _one_run(pieces, self.requests[number].start, size)
            if whole is not None and self.filled[number] == 0 and not (keep and pieces[0][4]):
                self.filled[number] = size
                complete.append((number, whole))
                continue
            slot = self.slots.get(number)
            if slot is None:
                slot = self.slots[number] = np.empty(size, dtype=np.uint8)
            base = self.requests[number].start
            for low, high, source, offset, _ in pieces:
                slot[low - base : high - base] = source[offset : offset + high - low]
                self.filled[number] += high - low
            if self.filled[number] == size:
                complete.append((number, self.slots.pop(number)))
        self.pieces = {}
        return complete


def _one_run(pieces: list[tuple[int, int, ByteArray, int, bool]], start: int, size: int) -> ByteArray | None:
    """The request's bytes as one view when its pieces cover it end to end, consecutive in one source."""
    low, _, source, offset, _ = pieces[0]
    if low != start:
        return None
    position, at = start, offset
    for piece_low, piece_high, piece_source, piece_offset, _ in pieces:
        if piece_low != position or piece_source is not source or piece_offset != at:
            return None
        position, at = piece_high, at + piece_high - piece_low
    if position != start + size:
        return None
    return source[offset : offset + size]


def fetch_shared(
    group: Group,
    checkpoint: Checkpoint,
    plan: ReadPlan,
    share: SharePlan,
    *,
    budget: int | None = None,
    finish: Step | None = None,
    shared_memory: bool | None = None,
    exchange: Exchange | None = None,
) -> list[tuple[ReadRequest, ByteArray]]:
    """This rank's requests fetched through the exchange and verified.

    finish(request, bytes): called (on worker threads) for each request as soon as it is whole and verified, which
    then frees its bytes: memory stays within about `budget` plus the requests still arriving; returns []. Without
    it every request is kept and returned (what PendingRead.fetch() holds). Collective: every rank of the group
    calls it with the same `share`. A failure on any rank (a storage error, a short read, a checksum) makes every
    rank raise: the failing one its own error, the others PeerFailed.
    shared_memory: ranks proved to share a host hand bytes over through the reader's /dev/shm region (host_memory)
    instead of the group; the others (and all, when False) through the group. None: knobs.SHARE_MEMORY.
    exchange: what plan_exchange agreed (`share` is its plan): the rounds and regions need no collective more.
    """
    try:
        return _fetch_shared(group, checkpoint, plan, share, budget, finish, shared_memory, exchange)
    finally:
        if exchange is not None:
            exchange.release()


def _fetch_shared(
    group: Group,
    checkpoint: Checkpoint,
    plan: ReadPlan,
    share: SharePlan,
    budget: int | None,
    finish: Step | None,
    shared_memory: bool | None,
    exchange: Exchange | None,
) -> list[tuple[ReadRequest, ByteArray]]:
    rank = group.rank
    assembly = _Assembly(plan.requests)
    kept: list[tuple[int, ByteArray]] = []  # (the request's number in the plan, its bytes)
    failure: BaseException | None = None
    # `depth` rounds of budget / depth bytes (at most SHARE_ROUND) in flight: the reads of the next depth - 1 rounds
    # (into the other parts of a region, or buffers of their own) run while this round's bytes are still in use, so
    # a reader reads on through a round's vote and checks instead of waiting for its slowest peer at each (HSDP 2x2,
    # 512 MiB, cold: two rounds in flight left each reader idle 10-25 ms a round).
    # The smallest of the ranks' choices: every rank must cut the same rounds (max_in_flight, SHARDCKPT_SHARE_ROUND
    # or SHARDCKPT_SHARE_DEPTH may differ between ranks, and ranks that cut rounds apart would wait in different
    # collectives, or overwrite a part of a region that a peer still reads).
    if exchange is not None:
        depth, round_bytes, checkers = exchange.depth, exchange.round_bytes, exchange.checkers
    else:
        refused: ShardckptError | None = None
        try:
            depth, round_bytes, _, checkers = _knob_choices(budget, 1)
        except ShardckptError as exc:  # -1 in both agreements: every rank raises, none waits for this one
            refused, depth, round_bytes, checkers = exc, -1, -1, 1
        depth = smallest(group, depth)
        usable = depth > 0 and round_bytes > 0
        round_bytes = smallest(group, round_bytes if usable else -1)  # at most budget // depth: its own depth
        if depth < 0 or round_bytes < 0:
            if refused is not None:
                raise refused
            raise PeerFailed("another rank refused a setting of shared reads")
    rounds = list(share.rounds(round_bytes))

    def mine(number: int) -> list[Segment]:
        return [segment for segment in rounds[number] if segment.reader == rank] if number < len(rounds) else []

    def read_round(number: int) -> ByteArray:
        _hint(checkpoint, mine(number + HINTED))
        return _read(checkpoint, mine(number), links.region(rank, number))

    # The storage starts on this rank's first rounds while the ranks make their regions (collective, ~15 ms).
    _hint(checkpoint, [segment for number in range(HINTED) for segment in mine(number)])
    # A round's checks run while the ranks vote on the next one (at most CHECK_LAG rounds behind the votes): before,
    # this thread checked a round before voting on the next, so every round cost the slowest rank's read plus its
    # checks (HSDP 2x2, 512 MiB, cold: ~200 ms of votes and ~200 ms of checks one after the other). A round's part of
    # a region is reused once every rank has checked it: each vote also carries the last round this rank has
    # checked, and round k >= depth is read once every rank has checked round k - depth (a fixed lag cost 2x2 loads
    # a round of reading ahead: 1.36-1.39x per-rank reads against 1.16-1.22x without the lag, DDP 0.95-1.04x
    # against 1.12-1.21x).
    lag = CHECK_LAG if depth > CHECK_LAG + 1 else 0
    with (
        links_for(
            group,
            rounds,
            _shared_memory(shared_memory),
            share.hosts,
            depth,
            published=None if exchange is None else exchange.published,
            reserved=None if exchange is None else exchange.reserved,
        ) as links,
        ThreadPoolExecutor(max_workers=_checkers(len(plan.requests), checkers)) as pool,
        ThreadPoolExecutor(max_workers=1) as reading,
        _cancelled_on_exit() as ahead,
        _cancelled_on_exit() as checking,
    ):
        submitted = min(depth, len(rounds))  # every part of a region is free before the first vote
        ahead.extend(reading.submit(read_round, number) for number in range(submitted))

        def checked(through: int) -> None:
            """Wait for this rank's checks of the rounds up to `through`; the first failure is this rank's."""
            nonlocal failure
            while checking and checking[0].round <= through:
                done = checking.popleft()
                try:
                    done.result()
                except Exception as exc:
                    failure = failure or exc
            if failure is not None:  # nothing more is copied out: cancel the checks of later rounds
                for later in checking:
                    later.cancel()

        for number, segments in enumerate(rounds):
            error: BaseException | None = None
            fetched: ByteArray = np.empty(0, np.uint8)
            handover: _Handover | None = None
            try:
                fetched = ahead.popleft().result()
                positions = _positions(segments)
                # Its buffers are allocated before the vote, so that a rank without the memory for them says so there
                # instead of leaving the others waiting in the round's all_to_all.
                handover = _Handover(group, segments, positions, links)
                checked(number - 1 - lag)
            except Exception as exc:
                error = exc
            # Also the moment every reader's region holds this round: consumers on its host read it after this; and
            # every rank has checked the rounds up to number - 1 - lag, whose parts of a region the reads may reuse.
            failed, checked_everywhere = any_and_least(group, error is not None, _checked_through(checking, number))
            if failed:
                if error is not None:
                    raise error
                raise PeerFailed("another rank failed to fetch its share of a shared read")
            # Reads as far ahead as every rank's checks allow: when they kept up, as without the lag.
            while submitted < min(checked_everywhere + 1 + depth, len(rounds)):
                ahead.append(reading.submit(read_round, submitted))
                submitted += 1
            assert handover is not None
            own_region = links.region(rank, number) is not None
            ready: list[tuple[int, ByteArray]] = []
            # A failure of this rank's own (a checksum; memory to assemble or copy out) ends its own work, not its
            # part in the rounds: it still hands over what it fetched and joins every collective the others run, and
            # raises after them (a rank leaving early would leave them waiting for the group's timeout). What it
            # copied before stays, as in an unshared load.
            if failure is None:
                try:
                    _take(assembly, segments, fetched, positions, links, number, own_region)
                except Exception as exc:
                    failure = exc
            handover.run(fetched)
            if failure is None:
                try:
                    handover.place(assembly)
                    ready = assembly.settle(keep=finish is None)
                    checks = [
                        functools.partial(_check, checkpoint, plan.requests[n], data, finish) for n, data in ready
                    ]
                    checking.append(_RoundChecks(number, [pool.submit(check) for check in checks]))
                except Exception as exc:
                    failure = exc
            if finish is None:
                kept.extend(ready)
        checked(len(rounds))
    if failure is not None:
        raise failure
    missing = [n for n, request in enumerate(plan.requests) if assembly.filled[n] != request.size]
    if missing:  # every byte of a request arrives exactly once (planner.share): a broken plan, never silent
        raise DistributedError("load", {rank: f"shared read left {len(missing)} requests incomplete"})
    # In the plan's order (what PendingRead.use takes): requests complete in the order their last bytes arrive, those
    # from a linked region before those through the group within a round.
    return [(plan.requests[number], data) for number, data in sorted(kept, key=lambda item: item[0])]


def _take(
    assembly: _Assembly,
    segments: Sequence[Segment],
    fetched: ByteArray,
    positions: dict[Segment, int],
    links: HostLinks,
    number: int,
    own_region: bool,
) -> None:
    """Place this round's segments that this rank needs and has already: fetched itself, or in a linked region."""
    rank = links.rank
    for segment in segments:
        if rank not in segment.consumers:
            continue
        if segment.reader == rank:
            assembly.place(segment, fetched, positions[segment], own_region)
        elif links.links(segment.reader, rank):
            region = links.region(segment.reader, number)
            assert region is not None
            assembly.place(segment, region, positions[segment], True)


def _checked_through(checking: collections.deque[Any], number: int) -> int:
    """The last round before `number` whose checks (and all earlier ones) have ended here, without waiting."""
    for pending in checking:
        if not pending.done():
            return int(pending.round) - 1
    return number - 1


class _RoundChecks:
    """The checks of one round's completed requests, running on the pool."""

    def __init__(self, round_number: int, futures: list[Future[None]]) -> None:
        self.round, self.futures = round_number, futures

    def result(self) -> None:
        """Wait for all of them; the first failure (in request order) is raised once all have ended."""
        wait(self.futures)
        for future in self.futures:
            future.result()

    def done(self) -> bool:
        return all(future.done() for future in self.futures)

    def cancel(self) -> None:
        for future in self.futures:
            future.cancel()


@contextlib.contextmanager
def _cancelled_on_exit() -> Iterator[collections.deque[Any]]:
    """Work submitted ahead (reads, checks); what has not started yet is cancelled when the rounds end early (a
    failure). The pools' own exits then wait for what runs, before any region is unmapped."""
    ahead: collections.deque[Any] = collections.deque()
    try:
        yield ahead
    finally:
        for future in ahead:
            future.cancel()


def _checkers(jobs: int, limit: int) -> int:
    """Threads that verify and copy out: a thread per core (the reads run on a thread of their own and wait on the
    storage, not a core; this thread only waits for a round), never more than the jobs or `limit`."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, jobs, limit))


def _knob_choices(budget: int | None, chunk: int | None) -> tuple[int, int, int, int]:
    """This rank's rounds in flight, bytes a round, largest segment (chunk, else MAX_REQUEST) and checking threads:
    its knobs (budget None: MAX_IN_FLIGHT), each of which may be refused (ShardckptUsageError naming the variable)."""
    budget = knobs.MAX_IN_FLIGHT if budget is None else budget
    depth = max(2, knobs.SHARE_DEPTH)
    rounds = max(1, min(budget // depth, knobs.SHARE_ROUND))
    return depth, rounds, knobs.MAX_REQUEST if chunk is None else chunk, knobs.SHARE_CHECKERS


def _shared_memory(choice: bool | None) -> bool:
    return bool(knobs.SHARE_MEMORY) if choice is None else choice


def _positions(segments: Sequence[Segment]) -> dict[Segment, int]:
    """Where each segment lies in its reader's bytes of the round: the reader's segments back to back, in order."""
    used: dict[int, int] = {}
    positions = {}
    for segment in segments:
        positions[segment] = used.get(segment.reader, 0)
        used[segment.reader] = positions[segment] + segment.size
    return positions


def _check(checkpoint: Checkpoint, request: ReadRequest, data: ByteArray, finish: Step | None) -> None:
    checkpoint.verify(request, data)
    if finish is not None:
        finish(request, data)


def _hint(checkpoint: Checkpoint, segments: Sequence[Segment]) -> None:
    """Announce segments this rank reads soon, so that the storage starts on them while it reads others (local
    disk: the kernel reads them ahead; a rank's segments are every few chunks of a file, which the kernel's own
    read-ahead does not follow, so without it each rank waited on one read at a time). Only a hint: it never fails,
    the read itself reports any error (and fails every rank alike)."""
    if not segments:
        return
    try:
        with checkpoint.data_storage.reader() as reader:
            for segment in segments:
                reader.prefetch(checkpoint.source(segment.file)[1], segment.start, segment.size)
    except (ShardckptError, OSError):
        pass


def _read(checkpoint: Checkpoint, segments: Sequence[Segment], region: ByteArray | None) -> ByteArray:
    """The bytes of `segments` from storage, back to back (in `region` when given), read concurrently as the
    backend reads best."""
    total = sum(segment.size for segment in segments)
    if not segments:
        return np.empty(0, np.uint8)
    buffer = region[:total] if region is not None else np.empty(total, dtype=np.uint8)
    outs, position = [], 0
    for segment in segments:
        outs.append(buffer[position : position + segment.size])
        position += segment.size
    storage = checkpoint.data_storage
    try:
        storage.read_ranges_into(
            [(checkpoint.source(segment.file)[1], segment.start) for segment in segments], [o.data for o in outs]
        )
    except TruncatedError as exc:
        raise IntegrityError(f"{exc} (a shared read of {checkpoint.url})") from exc
    return buffer


class _Handover:
    """One round's all_to_all for what does not go through a shared region: each reader sends each segment it
    fetched to its other consumers, in segment order. Its buffers are allocated when it is made, before the round's
    vote; `run` then only copies and joins the collective, which a rank that failed its own work still does."""

    def __init__(
        self, group: Group, segments: Sequence[Segment], positions: dict[Segment, int], links: HostLinks
    ) -> None:
        rank, world = group.rank, group.size
        self.group = group
        self.sends: list[list[tuple[int, int]]] = [[] for _ in range(world)]  # per consumer: (position, size)
        receive: list[list[Segment]] = [[] for _ in range(world)]
        self.anyone = False
        for segment in segments:
            for consumer in segment.consumers:
                if consumer == segment.reader or links.links(segment.reader, consumer):
                    continue
                self.anyone = True  # the same answer on every rank: all join the collective, or none
                if segment.reader == rank:
                    self.sends[consumer].append((positions[segment], segment.size))
                elif consumer == rank:
                    receive[segment.reader].append(segment)
        self.send_sizes = [sum(size for _, size in parts) for parts in self.sends]
        self.receive_sizes = [sum(segment.size for segment in segments) for segments in receive]
        self.received_segments = [segment for segments in receive for segment in segments]
        on_host = group.device.type == "cpu"
        send_total, receive_total = sum(self.send_sizes), sum(self.receive_sizes)
        self.outgoing = np.empty(send_total if self.anyone else 0, dtype=np.uint8)
        self.send = (
            torch.from_numpy(self.outgoing)
            if on_host
            else torch.empty(send_total, dtype=torch.uint8, device=group.device)
        )
        self.incoming = torch.empty(receive_total if self.anyone else 0, dtype=torch.uint8, device=group.device)
        self.received = self.incoming.numpy() if on_host else np.empty(self.incoming.numel(), dtype=np.uint8)

    def run(self, fetched: ByteArray) -> None:
        """Send this rank's share of `fetched` and receive the others' (nothing when no rank hands over here)."""
        if not self.anyone:
            return
        position = 0
        for parts in self.sends:
            for at, size in parts:
                self.outgoing[position : position + size] = fetched[at : at + size]
                position += size
        if self.send.device.type != "cpu":
            self.send.copy_(torch.from_numpy(self.outgoing))
        dist.all_to_all_single(self.incoming, self.send, self.receive_sizes, self.send_sizes, group=self.group.handle)
        if self.incoming.device.type != "cpu":
            torch.from_numpy(self.received).copy_(self.incoming)

    def place(self, assembly: _Assembly) -> None:
        """The received segments into this rank's requests."""
        position = 0
        for segment in self.received_segments:
            assembly.place(segment, self.received, position, False)
            position += segment.size
