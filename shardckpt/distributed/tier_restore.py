"""Restore from the node-local tier onto any world size: the ranks pool what their nodes' local roots hold, take
the newest save complete across them, and every byte range a rank needs comes from a rank whose node holds it.

(all) inventory the node's local root -> (all) share the inventories; choose (catalog.local_tier.choose) -> (the
lowest holder) send COMMITTED, the global manifest and the local manifests -> (all) plan own reads (the planner,
over those manifests) -> (all) share the needs; one reader per range among the holders (planner.share +
planner.partners.tier_readers) -> (readers) read from their local root, hand over (shared_reads.fetch_shared:
a /dev/shm region to the ranks of their host, the group to the others) -> (all) verify every block they use, then
vote: destinations are written only once every rank has all its bytes verified, so a failed or corrupt tier leaves
the state untouched for the fallback to the persistent tier.
"""

from __future__ import annotations

import contextlib
import uuid
import warnings
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch
import torch.distributed as dist

from shardckpt import knobs
from shardckpt.catalog.chain import verify_global_manifest
from shardckpt.catalog.local_tier import LocalCopy, LocalTierWarning, choose, inventory
from shardckpt.distributed import group_calls as calls
from shardckpt.distributed.collectives import Group
from shardckpt.distributed.protocol import prepare_fill
from shardckpt.distributed.shared_reads import fetch_shared
from shardckpt.errors import DistributedError, IntegrityError, NotFoundError, ShardckptError, ShardckptUsageError
from shardckpt.format import layout, limits
from shardckpt.format.manifest import decode_commit_marker
from shardckpt.planner import ReadRequest
from shardckpt.planner.partners import tier_readers
from shardckpt.planner.share import SharePlan, plan_shared_reads
from shardckpt.read.checkpoint import Checkpoint
from shardckpt.read.fetching import ByteArray
from shardckpt.statedict.stateful import loadable_states
from shardckpt.storage import Storage, open_storage


class LocalTierError(DistributedError):
    """A restore from the local tier failed on some rank (a corrupt or vanished copy, a peer's failure); nothing
    was written into the state: the caller tries an older local save, then the persistent tier."""

    key: tuple[str, str, int] | None = None  # the save that failed (catalog.local_tier.LocalCopy.key)
    # (rank, file): who read each file of that save that another node also holds; a retry of the save reads each
    # from a node not tried yet (a corrupt copy on one node costs its step only when no other node has a good one)
    readers: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class TierRestore:
    """What a restore from the local tier did on this rank."""

    name: str
    step: int
    local_bytes: int  # read from this rank's node's local root (for itself or for others)
    received_bytes: int  # handed over by other ranks
    aside: tuple[str, ...]  # what the choice left aside (other jobs' copies, incomplete saves)


def restore_local(
    state: Mapping[str, Any],
    root: Storage,
    *,
    group: Group | calls.Solo,
    nodes: Sequence[int],
    job: str,
    newer_than: int | None,
    exclude: Collection[tuple[str, str, int]] = (),
    avoid: Collection[tuple[int, int]] = (),
    strict: bool = True,
    optional: Sequence[str] = (),
    cast: bool = False,
    max_in_flight: int | None = None,
) -> TierRestore | None:
    """Fill `state` from the newest local save of `job` above step `newer_than` that the ranks' nodes hold between
    them; None (state untouched) when there is none. Collective. LocalTierError (state untouched) when the
    chosen copy cannot be read whole and verified on every rank."""
    mine: list[LocalCopy] = []
    try:
        mine = inventory(root)
    except NotFoundError:
        pass  # a node with an empty (new) local root
    except Exception as exc:  # whatever it is, this rank must still join the collectives below
        warnings.warn(f"local tier {root.url} unreadable, left out of the restore: {exc!r}", LocalTierWarning, 2)
    everyone = [
        [LocalCopy.unpack(fields) for fields in calls.unpack(raw)]
        for raw in calls.all_gather(group, calls.pack([c.pack() for c in mine]))
    ]
    choice, aside = choose(everyone, job, newer_than, exclude)
    if group.rank == 0:  # once per job: every rank pooled the same inventories
        for note in aside:
            warnings.warn(f"local tier: left aside {note}", LocalTierWarning, 3)
    if choice is None:
        return None
    where = root.child(choice.name)
    source = min(rank for ranks in choice.holders.values() for rank in ranks)
    error: BaseException | None = None
    bundle = None
    if group.rank == source:
        try:
            bundle = calls.pack(_metadata(where, choice.attempt))
        except Exception as exc:
            error = exc
            bundle = calls.pack({"error": f"{type(exc).__name__}: {exc}"})
    opening = calls.unpack(calls.broadcast(group, bundle, source))
    if "error" in opening:
        failed = LocalTierError("local restore", {source: opening["error"]})
        failed.key = choice.key
        raise failed from error
    scratch = open_storage(f"memory://shardckpt-tier/{uuid.uuid4().hex}")
    kept: list[tuple[ReadRequest, ByteArray]] = []
    local_bytes = received = 0
    try:
        prepared = None
        try:
            state, load_statefuls = loadable_states(state)
            checkpoint = _checkpoint(scratch, where, opening, max_in_flight)
            prepared = prepare_fill(checkpoint, state, group.rank, strict, optional, cast)
        except Exception as exc:
            error = exc
        if calls.vote(group, error is not None):
            raise _failure(group, error, choice.key)
        assert prepared is not None
        pending, assign = prepared
        wanted = [knobs.MAX_REQUEST, [[q.file, q.start, q.end] for q in pending.plan.requests]]
        gathered = [msgpack.unpackb(b) for b in calls.all_gather(group, msgpack.packb(wanted))]
        needs = [[tuple(r) for r in ranges] for _, ranges in gathered]
        # Every rank cuts the segments alike (SHARDCKPT_MAX_REQUEST may differ between ranks' environments).
        chunk = max(1, min(size for size, _ in gathered))
        # The nodes whose copy of a file failed a previous try of this save read no more of it, while another holds it.
        tried = {(nodes[rank], file) for rank, file in avoid}
        holders = {
            file: tuple(r for r in ranks if (nodes[r], file) not in tried) or ranks
            for file, ranks in choice.holders.items()
        }
        share, missing = tier_readers(plan_shared_reads(needs, chunk=chunk, nodes=nodes), holders, nodes)
        assert not missing, missing  # choose() took a save whose every file some rank holds
        try:
            if isinstance(group, Group):
                # The shared-read exchange: reads run ahead of the hand-over, ranks of one host take their bytes from
                # the reader's /dev/shm region (host_memory), others through the group, and every consumer verifies
                # its requests on a pool of threads; each request is kept until every rank has voted below.
                kept = fetch_shared(group, checkpoint, pending.plan, share, budget=max_in_flight)
                local_bytes = sum(s.size for s in share.segments if s.reader == group.rank)
                received = sum(s.size for s in share.segments if s.reader != group.rank and group.rank in s.consumers)
            else:
                kept, local_bytes, received = _fetch(
                    group, checkpoint, where, pending.plan.requests, share, checkpoint.max_in_flight
                )
        except Exception as exc:
            error = exc
        if calls.vote(group, error is not None):
            failure = _failure(group, error, choice.key)
            if isinstance(failure, LocalTierError):
                failure.readers = tuple(
                    sorted({(s.reader, s.file) for s in share.segments if len({nodes[r] for r in holders[s.file]}) > 1})
                )
            raise failure
        pending.use(kept)
        pending.apply()
        assign()
        load_statefuls()
    finally:  # the in-memory copies of the local manifests live in a process-wide store: gone with the restore
        with contextlib.suppress(ShardckptError):
            for name in scratch.list(layout.RANKS_DIR):
                scratch.delete(f"{layout.RANKS_DIR}/{name}")
    return TierRestore(choice.name, choice.step, local_bytes, received, tuple(aside))


def _metadata(where: Storage, attempt: str) -> dict[str, Any]:
    """(the source) COMMITTED, the global manifest and every local manifest of the chosen copy, raw."""
    marker_raw = where.read_small(layout.COMMITTED, limits.MAX_COMMIT_MARKER_BYTES)
    marker = decode_commit_marker(marker_raw, where.describe(layout.COMMITTED))
    if marker.attempt != attempt:
        raise IntegrityError(f"{where.describe(layout.COMMITTED)} now names attempt {marker.attempt}, not {attempt}")
    manifest_raw = where.read_small(marker.manifest, limits.MAX_GLOBAL_MANIFEST_BYTES)
    manifest = verify_global_manifest(manifest_raw, marker, where.describe(marker.manifest))
    locals_ = [where.read_small(f.index, limits.MAX_LOCAL_MANIFEST_BYTES) for f in manifest.files]
    return {"marker": marker_raw, "manifest": manifest_raw, "locals": locals_}


class _TierCheckpoint(Checkpoint):
    """A checkpoint whose data files lie on other ranks' nodes: each holder checked the size of every file it
    offered (catalog.local_tier.inventory), and every block read is verified against its CRC by the rank using it."""

    def _check_data_size(self, file: int) -> None:
        return


def _checkpoint(scratch: Storage, where: Storage, opening: Mapping[str, Any], max_in_flight: int | None) -> Checkpoint:
    """The chosen copy's metadata, checked against its COMMITTED, in an in-memory checkpoint the planner reads; its
    data files read from `where` (this rank's node's copy: a rank reads only the files its node holds)."""
    marker = decode_commit_marker(opening["marker"], "the local tier's COMMITTED")
    manifest = verify_global_manifest(opening["manifest"], marker, "the local tier's global manifest")
    if manifest.references or marker.references:  # a local save never references another checkpoint
        raise IntegrityError(f"{where.url}: a local checkpoint that references other checkpoints")
    if len(opening["locals"]) != len(manifest.files):
        raise IntegrityError(f"the local tier sent {len(opening['locals'])} local manifests for {len(manifest.files)}")
    for file, raw in zip(manifest.files, opening["locals"]):
        scratch.write_new(file.index, raw)  # each checked against the global manifest's CRC when the planner reads it
    checkpoint = _TierCheckpoint(scratch, marker, manifest, max_in_flight=max_in_flight)
    checkpoint.data_storage = where
    return checkpoint


def _fetch(
    group: Group | calls.Solo,
    checkpoint: Checkpoint,
    where: Storage,
    requests: Sequence[ReadRequest],
    share: SharePlan,
    budget: int,
) -> tuple[list[tuple[ReadRequest, ByteArray]], int, int]:
    """This rank's requests, whole and verified, from the readers of `share`; bytes read locally, bytes received."""
    rank = group.rank
    slots = [np.empty(request.size, dtype=np.uint8) for request in requests]
    by_file: dict[int, list[int]] = {}
    for number, request in enumerate(requests):
        by_file.setdefault(request.file, []).append(number)
    filled = [0] * len(requests)
    local_bytes = received_bytes = 0

    def place(file: int, start: int, data: ByteArray) -> None:
        end = start + data.size
        for number in by_file.get(file, ()):
            request = requests[number]
            low, high = max(request.start, start), min(request.end, end)
            if low < high:
                slots[number][low - request.start : high - request.start] = data[low - start : high - start]
                filled[number] += high - low

    for segments in share.rounds(budget):
        mine = [segment for segment in segments if segment.reader == rank]
        fetched: list[ByteArray] = []
        error: BaseException | None = None
        try:
            for segment in mine:
                data = np.empty(segment.size, dtype=np.uint8)
                where.read_range_into(checkpoint.manifest.files[segment.file].data, segment.start, data.data)
                local_bytes += segment.size
                fetched.append(data)
                if rank in segment.consumers:
                    place(segment.file, segment.start, data)
        except Exception as exc:
            error = exc
        # Every rank leaves the rounds together: one that stopped alone would leave the others in the exchange.
        if calls.vote(group, error is not None):
            raise error if error is not None else IntegrityError("another rank failed to read its local tier")
        if not any(s.reader not in s.consumers or len(s.consumers) > 1 for s in segments):
            continue
        assert isinstance(group, Group)  # one process reads everything itself
        send_parts: list[list[ByteArray]] = [[] for _ in range(group.size)]
        receive: list[list[Any]] = [[] for _ in range(group.size)]
        for segment in segments:
            for consumer in segment.consumers:
                if consumer == segment.reader:
                    continue
                if segment.reader == rank:
                    send_parts[consumer].append(fetched[mine.index(segment)])
                elif consumer == rank:
                    receive[segment.reader].append(segment)
        send_sizes = [sum(part.size for part in parts) for parts in send_parts]
        receive_sizes = [sum(segment.size for segment in parts) for parts in receive]
        outgoing = [p for parts in send_parts for p in parts]
        arrived, position = swap(group, outgoing, send_sizes, receive_sizes), 0
        for source in range(group.size):
            for segment in receive[source]:
                place(segment.file, segment.start, arrived[position : position + segment.size])
                position += segment.size
                received_bytes += segment.size
    short = [n for n, request in enumerate(requests) if filled[n] != request.size]
    if short:
        raise IntegrityError(f"{where.url}: the local tier delivered {len(short)} read requests incomplete")
    for request, slot in zip(requests, slots):
        checkpoint.verify(request, slot)  # whoever read it, this rank checks every block it will use
    return list(zip(requests, slots)), local_bytes, received_bytes


def _failure(
    group: Group | calls.Solo, error: BaseException | None, key: tuple[str, str, int]
) -> LocalTierError | DistributedError:
    """(all, after a vote that found a failure) Every rank's cause, the same error on every rank: LocalTierError
    (try another copy) unless some rank's state does not fit the checkpoint (a usage error: no copy would do, and
    falling back would hide it), which is a DistributedError the caller sees."""
    mine = {"error": f"{type(error).__name__}: {error}", "usage": isinstance(error, ShardckptUsageError)}
    replies = [calls.unpack(reply) for reply in calls.all_gather(group, calls.pack(mine if error is not None else {}))]
    failures = {rank: reply["error"] for rank, reply in enumerate(replies) if "error" in reply}
    if any(reply.get("usage") for reply in replies):
        return DistributedError("restore from the local tier", failures)
    failed = LocalTierError("local restore", failures)
    failed.key = key
    return failed


def swap(group: Group, outgoing: Sequence[ByteArray], send_sizes: list[int], receive_sizes: list[int]) -> ByteArray:
    """One all_to_all_single of bytes: `outgoing` in rank order (send_sizes[r] bytes for rank r); what arrives
    (receive_sizes[r] bytes from rank r), in rank order."""
    sending = np.concatenate(list(outgoing)) if any(send_sizes) else np.empty(0, np.uint8)
    incoming = torch.empty(sum(receive_sizes), dtype=torch.uint8, device=group.device)
    send = torch.from_numpy(sending).to(group.device)
    calls.collective(
        lambda: dist.all_to_all_single(incoming, send, receive_sizes, send_sizes, group=group.handle), group
    )
    arrived: ByteArray = incoming.cpu().numpy()
    return arrived
