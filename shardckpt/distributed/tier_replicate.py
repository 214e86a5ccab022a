"""The node-local tier's replication: each rank's data file to its partners on other nodes, received straight into
the replica file and sent from the memory the file was written from, so no buffer the size of a file exists.

(partners) create each replica at its final size; one whose source file this rank opens on its own host (the very
inode: same boot, device and inode) is copied by the kernel -> (all) share which replicas come that way -> (all)
rounds of point-to-point messages for the others: round k carries bytes [k*window, (k+1)*window) of every file,
cut at its pieces (one message per piece part, sent from the piece's tensor; small ones merged and read back from
the file), received into a mapping of that window of the replica -> (partners) close the replicas.
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from shardckpt import knobs
from shardckpt.distributed import group_calls as calls
from shardckpt.distributed.collectives import Group
from shardckpt.distributed.host_memory import file_identity
from shardckpt.errors import AlreadyExistsError, IntegrityError, StorageError
from shardckpt.format import layout
from shardckpt.format.local_manifest import LocalManifest
from shardckpt.storage import Storage
from shardckpt.storage.local import LocalStorage
from shardckpt.storage.mapped import MappedFile, open_mapped

# Adjacent ranges under SMALL_PIECE (the header, norms, biases, 100,000 MoE pieces) travel merged into messages of up
# to SMALL_MESSAGE bytes, read back from the file: a message per small tensor would cost more than its bytes.
SMALL_PIECE = 64 << 10
SMALL_MESSAGE = 1 << 20


@dataclass(frozen=True)
class Outgoing:
    """This rank's data file as sent: its path under the save, and each piece's offset with the tensor it was
    written from (ShardWriter.placed: a message inside one such piece is sent from that memory)."""

    path: str
    placed: Sequence[tuple[int, torch.Tensor]]


def identity_of(where: Storage, path: str) -> list[Any] | None:
    """What lets a rank of the same host open this very file: its real path (bytes: any name packs), host boot,
    device and inode (None when the storage is not a local directory or the file cannot be opened)."""
    if not isinstance(where, LocalStorage):
        return None
    full = os.fsencode(os.path.realpath(where.full(path)))
    try:
        fd = os.open(full, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        found = file_identity(fd)
    finally:
        os.close(fd)
    return None if found is None else [full, *found]


def schedule_of(manifest: LocalManifest, window: int) -> list[list[tuple[int, int]]]:
    """messages() of a data file, from its local manifest: what sender and receiver both compute alike."""
    return messages(int(manifest.data_size), int(manifest.header_size), manifest.pieces.offset.tolist(), window)


def messages(size: int, header_size: int, offsets: Sequence[int], window: int) -> list[list[tuple[int, int]]]:
    """The byte ranges a data file of `size` bytes travels in, by round (round k: inside [k*window, (k+1)*window)):
    cut at the header's end, at every piece's offset and at every multiple of `window`; the parts of pieces under
    SMALL_PIECE (and of the header) merged while together under SMALL_MESSAGE, a larger piece's parts alone."""
    bounds = sorted(cut for cut in {0, size, header_size, *offsets} if 0 <= cut <= size)
    points = sorted(set(bounds) | set(range(window, size, window)))
    rounds: list[list[tuple[int, int]]] = [[] for _ in range(-(-size // window))]
    low, small = 0, False  # the open range [low, start), and whether it is a run of small pieces
    for start, end in zip(points, points[1:]):
        at = bisect.bisect_right(
            bounds, start
        )  # the piece (or header) this part belongs to: [bounds[at-1], bounds[at])
        tiny = bounds[at] - bounds[at - 1] < SMALL_PIECE
        # Merge into the open run while both are small and stay inside one window (one round, one mapping).
        if not (small and tiny and end - low <= SMALL_MESSAGE and start // window == low // window):
            if start > low:
                rounds[low // window].append((low, start))
            low, small = start, tiny
    if size > low:
        rounds[low // window].append((low, size))
    return rounds


class _Sender:
    """The memory each outgoing message is sent from: a piece's tensor when the message lies inside one piece whose
    bytes are its memory (a contiguous CPU tensor), else a buffer read back from this rank's own file."""

    def __init__(self, where: Storage, outgoing: Outgoing) -> None:
        self.where, self.path = where, outgoing.path
        ordered = sorted(outgoing.placed, key=lambda item: item[0])
        self.offsets = [offset for offset, _ in ordered]
        self.tensors = [tensor for _, tensor in ordered]

    def source(self, low: int, high: int) -> torch.Tensor:
        found = bisect.bisect_right(self.offsets, low) - 1
        if found >= 0:
            tensor, offset = self.tensors[found], self.offsets[found]
            if tensor.device.type == "cpu" and tensor.is_contiguous() and not (tensor.is_conj() or tensor.is_neg()):
                flat = tensor.reshape(-1).view(torch.uint8)  # the bytes the writer wrote (host_bytes' view)
                if high - offset <= flat.numel():
                    return flat[low - offset : high - offset]
        buffer = scratch(high - low)
        self.where.read_range_into(self.path, low, buffer.data)
        return torch.from_numpy(buffer)


def scratch(size: int) -> np.ndarray:
    """Every buffer the replication allocates (small merged messages, bytes a failed rank still sends or receives):
    one place, so that a test can hold it to its bound."""
    return np.zeros(size, dtype=np.uint8)


def replicate(
    group: Group,
    where: Storage,
    manifests: Sequence[LocalManifest],
    outgoing: Outgoing,
    identities: Sequence[list[Any] | None],
    partners: Sequence[tuple[int, ...]],
    *,
    window: int | None = None,
    same_host: bool = True,
) -> None:
    """(all) Each rank's data file to each of its partners, which keep it under its own name in `where` (this
    rank's save directory). A rank that cannot create its replicas says so before any byte moves (then none
    does); one that fails later (a read, a copy) still takes part in every message. Either raises its own error;
    the caller's vote tells the others."""
    rank, world = group.rank, group.size
    window = knobs.LOCAL_TIER_IN_FLIGHT if window is None else window
    sources = [source for source in range(world) if rank in partners[source]]
    error: BaseException | None = None
    replicas: dict[int, MappedFile] = {}
    kernel: dict[int, int] = {}  # source -> an open descriptor of its very file, on this host
    beside: list[int] = []  # sources whose bytes do not come through the group (copied here, or there already)
    complete = False
    try:
        try:
            for source in sources:
                path, size = layout.data_path(source, manifests[source].attempt), int(manifests[source].data_size)
                replica = _open_replica(where, path, size)
                if replica is None:
                    beside.append(source)
                    continue
                replicas[source] = replica
                found = _open_source(identities[source], size) if same_host else None
                if found is not None:
                    kernel[source] = found
                    beside.append(source)
        except Exception as exc:
            error = exc
        plan = {"failed": error is not None, "beside": beside, "window": window}
        plans = [calls.unpack(raw) for raw in calls.all_gather(group, calls.pack(plan))]
        # Every rank cuts the files alike, whatever SHARDCKPT_LOCAL_TIER_IN_FLIGHT each one's environment says.
        window = min(int(other["window"]) for other in plans)
        window = max(mmap.ALLOCATIONGRANULARITY, window - window % mmap.ALLOCATIONGRANULARITY)
        # A rank that cannot create its replicas: nothing moves anywhere, it raises below, the caller's vote tells
        # the others (their replicas are aborted, never closed as whole).
        if not any(plan["failed"] for plan in plans):
            for source, fd in kernel.items():
                try:
                    replicas[source].copy_from(fd)
                except Exception as exc:
                    error = error or exc
            targets = [target for target in partners[rank] if rank not in plans[target]["beside"]]
            through = [source for source in sources if source not in plans[rank]["beside"]]
            error = _exchange(group, where, manifests, outgoing, targets, through, replicas, window, error)
            complete = error is None
    finally:
        for fd in kernel.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        for replica in replicas.values():
            if not complete:
                replica.abort()
                continue
            try:
                replica.close()
            except Exception as exc:
                error, complete = exc, False
    if error is not None:
        raise error


def _exchange(
    group: Group,
    where: Storage,
    manifests: Sequence[LocalManifest],
    outgoing: Outgoing,
    targets: Sequence[int],
    sources: Sequence[int],
    replicas: dict[int, MappedFile],
    window: int,
    error: BaseException | None,
) -> BaseException | None:
    """The point-to-point rounds: this rank's file to `targets`, the files of `sources` into their replicas; the
    first error (this rank keeps sending and receiving after it). A message is tagged with its number in its
    file's schedule, so each pair matches its messages whatever else runs beside."""
    if not targets and not sources:
        return error
    schedule = _Schedule(
        sender=_Sender(where, outgoing),
        mine=schedule_of(manifests[group.rank], window) if targets else [],
        theirs={source: schedule_of(manifests[source], window) for source in sources},
    )
    for number in range(max([len(schedule.mine), *(len(plan) for plan in schedule.theirs.values())])):
        # The round's mappings close once its tensors are gone (_round's frame): a mapping outliving its round
        # would keep its pages in this process's resident set.
        with contextlib.ExitStack() as mapped:
            error = _round(group, schedule, number, targets, replicas, mapped, error)
    return error


@dataclass
class _Schedule:
    sender: _Sender
    mine: list[list[tuple[int, int]]]  # this rank's file, by round
    theirs: dict[int, list[list[tuple[int, int]]]]  # each source's file, by round
    sent: int = 0  # messages of this rank's file posted so far (the tag of the next)
    received: dict[int, int] = field(default_factory=dict)  # source -> its messages received so far


def _round(
    group: Group,
    schedule: _Schedule,
    number: int,
    targets: Sequence[int],
    replicas: dict[int, MappedFile],
    mapped: contextlib.ExitStack,
    error: BaseException | None,
) -> BaseException | None:
    """Post this round's sends and receives, wait for all of them; the first error."""
    on_host = group.device.type == "cpu"
    posted: list[tuple[str, torch.Tensor, int, int]] = []
    for low, high in schedule.mine[number] if number < len(schedule.mine) else ():
        try:
            data = schedule.sender.source(low, high) if error is None else torch.from_numpy(scratch(high - low))
        except Exception as exc:  # the partners wait for these bytes all the same: zeros, and the vote fails
            error, data = exc, torch.from_numpy(scratch(high - low))
        data = data if on_host else data.to(group.device)
        for target in targets:
            posted.append(("send", data, target, schedule.sent))
        schedule.sent += 1
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    for source, plan in schedule.theirs.items():
        part = plan[number] if number < len(plan) else []
        if not part:
            continue
        base = part[0][0]
        region = _region(mapped, replicas[source], base, part[-1][1], error is None)
        for low, high in part:
            into = region[low - base : high - base]
            if not on_host:  # a device group receives on its device, then copies into the mapping
                copies.append((into, torch.empty(high - low, dtype=torch.uint8, device=group.device)))
                into = copies[-1][1]
            number_of = schedule.received.get(source, 0)
            posted.append(("recv", into, source, number_of))
            schedule.received[source] = number_of + 1
    calls.collective(lambda: [work.wait() for work in _post(group, posted) if work is not None], group)
    for into, arrived in copies:
        into.copy_(arrived)
    return error


def _post(group: Group, posted: Sequence[tuple[str, torch.Tensor, int, int]]) -> list[Any]:
    """Start the round's sends and receives ((kind, tensor, group peer, tag)); their works. On a device group
    (NCCL) as one batch: two ranks sending to each other one op at a time would each wait for the other."""
    if group.device.type == "cpu":
        return [
            dist.isend(tensor, group=group.handle, group_dst=peer, tag=tag)
            if kind == "send"
            else dist.irecv(tensor, group=group.handle, group_src=peer, tag=tag)
            for kind, tensor, peer, tag in posted
        ]
    ops = [
        dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, group=group.handle, group_peer=peer, tag=tag)
        for kind, tensor, peer, tag in posted
    ]
    return list(dist.batch_isend_irecv(ops)) if ops else []


def _region(mapped: contextlib.ExitStack, replica: MappedFile, low: int, high: int, usable: bool) -> torch.Tensor:
    """Bytes [low, high) of a replica, mapped for this round; after a failure, a scratch buffer that takes them."""
    if usable:
        with contextlib.suppress(StorageError):  # then received into scratch; the failure is recorded already
            return torch.from_numpy(mapped.enter_context(replica.window(low, high)))
    return torch.from_numpy(scratch(high - low))


def _open_replica(where: Storage, path: str, size: int) -> MappedFile | None:
    """A new replica file at its final size; None when the very file is there already (two simulated nodes sharing
    one directory: its source wrote it), which must then have its size (every byte is verified against its CRCs
    when read)."""
    if not isinstance(where, LocalStorage):
        raise StorageError(f"{where.url}: a local tier is a local directory")
    try:
        return open_mapped(where, path, size)
    except AlreadyExistsError:
        if where.size(path) != size:
            raise IntegrityError(f"{where.describe(path)} exists with another size than this save's file") from None
        return None


def _open_source(identity: list[Any] | None, size: int) -> int | None:
    """A descriptor of a partner's data file opened here when it is that very file (the same boot, device and
    inode, of its size): then this host's kernel copies it. None otherwise (another host, another mount)."""
    if not identity or not isinstance(identity[0], bytes):
        return None
    path, *expected = identity
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    found = file_identity(fd)
    if found is None or list(found) != list(expected) or os.fstat(fd).st_size != size:
        os.close(fd)
        return None
    return fd
