"""Collective loads that read each stored byte once per job: the ranks swap the byte ranges their plans need, one
rank fetches each range (planner.share) and hands it to the others that need it (all_to_all over the group).

A peer's bytes are trusted no more than storage's: every rank verifies the block checksums of each of its own read
requests once it is whole, whoever fetched its parts. Memory: a rank holds its requests' bytes (as a verify_first
load does) plus, per exchange round, at most `budget` bytes fetched or received.
"""

from __future__ import annotations

import bisect
import functools
import os
from collections.abc import Sequence

import msgpack
import numpy as np
import torch
import torch.distributed as dist

from shardckpt import knobs
from shardckpt.distributed.collectives import Group, all_gather_bytes, any_rank
from shardckpt.errors import DistributedError, IntegrityError, TruncatedError
from shardckpt.planner import ReadPlan, ReadRequest
from shardckpt.planner.share import Segment, SharePlan, plan_shared_reads
from shardckpt.read.checkpoint import Checkpoint
from shardckpt.read.fetching import ByteArray, Step, run_all


class PeerFailed(Exception):
    """Another rank failed during the exchange; its own error reaches every rank through the load's final vote."""


def node_ids(group: Group) -> list[int] | None:
    """Each rank's node, from SHARDCKPT_NODE or torchrun's GROUP_RANK (None when neither is set anywhere)."""
    mine = os.environ.get("SHARDCKPT_NODE", os.environ.get("GROUP_RANK"))
    known = [msgpack.unpackb(b) for b in all_gather_bytes(group, msgpack.packb(mine))]
    if any(node is None for node in known):
        return None
    names = {name: index for index, name in enumerate(sorted(set(known)))}
    return [names[node] for node in known]


def plan_exchange(
    group: Group, plan: ReadPlan, *, only_across_nodes: bool, chunk: int = knobs.MAX_REQUEST
) -> SharePlan | None:
    """Every rank's needs, gathered, turned into the one plan every rank computes alike; None (on every rank)
    when no two ranks need the same byte, or when only_across_nodes and the ranks do not span two nodes (then
    nothing but the node names was exchanged)."""
    nodes = node_ids(group)
    if only_across_nodes and (nodes is None or len(set(nodes)) < 2):
        return None
    mine = [[request.file, request.start, request.end] for request in plan.requests]
    everyone = [[tuple(r) for r in msgpack.unpackb(b)] for b in all_gather_bytes(group, msgpack.packb(mine))]
    share = plan_shared_reads(everyone, chunk=chunk, nodes=nodes)
    return share if share.overlaps else None


class _Assembly:
    """This rank's requests, each in a buffer of its own from its first byte to its use, and where a segment's bytes
    land in them."""

    def __init__(self, requests: Sequence[ReadRequest]) -> None:
        self.requests = requests
        self.slots: dict[int, ByteArray] = {}
        self.filled = [0] * len(requests)
        self.complete: list[int] = []  # requests whole since the caller last took them
        self.by_file: dict[int, list[tuple[int, int, int]]] = {}  # file -> sorted (start, end, request number)
        for number, request in enumerate(requests):
            self.by_file.setdefault(request.file, []).append((request.start, request.end, number))
        for spans in self.by_file.values():
            spans.sort()

    def place(self, segment: Segment, data: ByteArray) -> None:
        """Copy a segment's bytes into every request of this rank that overlaps it."""
        spans = self.by_file.get(segment.file, [])
        at = max(0, bisect.bisect_right(spans, (segment.start, float("inf"), 0)) - 1)
        for start, end, number in spans[at:]:
            if start >= segment.end:
                break
            low, high = max(start, segment.start), min(end, segment.end)
            if low >= high:
                continue
            slot = self.slots.get(number)
            if slot is None:
                slot = self.slots[number] = np.empty(end - start, dtype=np.uint8)
            slot[low - start : high - start] = data[low - segment.start : high - segment.start]
            self.filled[number] += high - low
            if self.filled[number] == end - start:
                self.complete.append(number)

    def take_complete(self) -> list[int]:
        complete, self.complete = self.complete, []
        return complete


def fetch_shared(
    group: Group,
    checkpoint: Checkpoint,
    plan: ReadPlan,
    share: SharePlan,
    *,
    budget: int = knobs.MAX_IN_FLIGHT,
    finish: Step | None = None,
) -> list[tuple[ReadRequest, ByteArray]]:
    """This rank's requests fetched through the exchange and verified.

    finish(request, bytes): called (on worker threads) for each request as soon as it is whole and verified, which
    then frees its bytes: memory stays within about `budget` plus the requests still arriving; returns []. Without
    it every request is kept and returned (what PendingRead.fetch() holds). Collective: every rank of the group
    calls it with the same `share`. A failure on any rank (a storage error, a short read, a checksum) makes every
    rank raise: the failing one its own error, the others PeerFailed.
    """
    rank = group.rank
    assembly = _Assembly(plan.requests)
    kept: list[tuple[ReadRequest, ByteArray]] = []
    failure: BaseException | None = None
    with checkpoint.worker_pool(len(plan.requests)) as pool:
        for segments in share.rounds(budget):
            mine = [segment for segment in segments if segment.reader == rank]
            error: BaseException | None = None
            fetched: list[ByteArray] = []
            try:
                fetched = _read(checkpoint, mine)
            except Exception as exc:
                error = exc
            if any_rank(group, error is not None):
                if error is not None:
                    raise error
                raise PeerFailed("another rank failed to fetch its share of a shared read")
            for segment, data in zip(mine, fetched):
                if rank in segment.consumers:
                    assembly.place(segment, data)
            _exchange(group, segments, dict(zip(mine, fetched)), assembly)
            ready = [(plan.requests[n], assembly.slots.pop(n)) for n in assembly.take_complete()]
            if failure is None:
                # A checksum failure is this rank's own: it still takes part in the rounds the others run and raises
                # after them; what it copied before stays, as in an unshared load.
                try:
                    run_all([functools.partial(_check, checkpoint, req, data, finish) for req, data in ready], pool)
                except Exception as exc:
                    failure = exc
            if finish is None:
                kept.extend(ready)
    if failure is not None:
        raise failure
    missing = [n for n, request in enumerate(plan.requests) if assembly.filled[n] != request.size]
    if missing:  # every byte of a request arrives exactly once (planner.share): a broken plan, never silent
        raise DistributedError("load", {rank: f"shared read left {len(missing)} requests incomplete"})
    return kept


def _check(checkpoint: Checkpoint, request: ReadRequest, data: ByteArray, finish: Step | None) -> None:
    checkpoint.verify(request, data)
    if finish is not None:
        finish(request, data)


def _read(checkpoint: Checkpoint, segments: Sequence[Segment]) -> list[ByteArray]:
    """The bytes of `segments` from storage (concurrently, as the backend reads best)."""
    if not segments:
        return []
    buffer = np.empty(sum(segment.size for segment in segments), dtype=np.uint8)
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
    return outs


def _exchange(
    group: Group, segments: Sequence[Segment], fetched: dict[Segment, ByteArray], assembly: _Assembly
) -> None:
    """One all_to_all: each reader sends each segment it fetched to its other consumers, in segment order."""
    rank, world = group.rank, group.size
    send_parts: list[list[ByteArray]] = [[] for _ in range(world)]
    receive: list[list[Segment]] = [[] for _ in range(world)]
    for segment in segments:
        for consumer in segment.consumers:
            if consumer == segment.reader:
                continue
            if segment.reader == rank:
                send_parts[consumer].append(fetched[segment])
            elif consumer == rank:
                receive[segment.reader].append(segment)
    send_sizes = [sum(part.size for part in parts) for parts in send_parts]
    receive_sizes = [sum(segment.size for segment in segments) for segments in receive]
    if not _anyone_sends(segments):  # the same answer on every rank: all skip the collective, or none
        return
    outgoing = np.concatenate([p for parts in send_parts for p in parts]) if any(send_sizes) else np.empty(0, np.uint8)
    send = torch.from_numpy(outgoing).to(group.device)
    incoming = torch.empty(sum(receive_sizes), dtype=torch.uint8, device=group.device)
    dist.all_to_all_single(incoming, send, receive_sizes, send_sizes, group=group.handle)
    received = incoming.cpu().numpy()
    position = 0
    for source in range(world):
        for segment in receive[source]:
            assembly.place(segment, received[position : position + segment.size])
            position += segment.size


def _anyone_sends(segments: Sequence[Segment]) -> bool:
    """Whether any rank sends anything in this round: every rank must then join the all_to_all."""
    return any(len(segment.consumers) > 1 for segment in segments)
