"""Shared memory between the ranks of one host for shared reads: a reader fetches into a /dev/shm file that the
consumers on its host map, so a hand-off is one memcpy (or none) instead of a trip through the group's sockets.

Which ranks share memory is proved, not assumed: a consumer maps a reader's region only after opening the reader's
randomly named file in its own /dev/shm at the agreed size (containers of one machine often have separate ones).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import socket
import time
from collections.abc import Iterator, Sequence

import msgpack
import numpy as np

from shardckpt.distributed.collectives import Group, all_gather_bytes, all_gather_fixed
from shardckpt.planner.share import Segment

SHM_DIR = "/dev/shm"
PREFIX = "shardckpt-share-"  # a file left by a rank killed in the few milliseconds before its peers map it
ORPHAN_AGE = 600.0  # seconds after which a region file still named is a killed rank's (removed by the next read)


def host_key() -> str | None:
    """This host's identity as far as the kernel tells it (host name, boot, the /dev/shm mount), or None when
    there is no writable /dev/shm; equal keys only make two ranks try, the file they open proves it."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as file:
            boot = file.read().strip()
        shm = os.stat(SHM_DIR)
    except OSError:
        return None
    if not os.access(SHM_DIR, os.W_OK | os.X_OK):
        return None
    return f"{socket.gethostname()}|{boot}|{shm.st_dev}:{shm.st_ino}"


def file_identity(fd: int) -> tuple[str, int, int] | None:
    """(boot id, device, inode) of an open file: equal in two processes only when both hold the very same file of
    one running kernel (its device numbers and inodes are its own; the boot id tells kernels apart)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as file:
            boot = file.read().strip()
        found = os.fstat(fd)
    except OSError:
        return None
    return boot, found.st_dev, found.st_ino


class PeerFailed(Exception):
    """Another rank failed during a shared read's exchange; its own error reaches every rank through the load's
    final vote."""


class HostLinks:
    """Which (reader, consumer) pairs hand bytes over through a reader's shared region, the same on every rank, and
    this rank's view of each region it maps. Collective to build (three small all-gathers); `close` drops it."""

    def __init__(self, rank: int, parts: dict[int, int], copies: int = 2) -> None:
        self.rank = rank
        self.parts = parts  # reader -> bytes of one part of its region (one round's reads)
        self.copies = copies  # parts of a region: round n goes to part n % copies
        self.linked: set[tuple[int, int]] = set()  # (reader, consumer): consumer maps the reader's region
        self.views: dict[int, np.ndarray] = {}  # reader -> its region, mapped here (our own: writable)

    @classmethod
    def build(
        cls,
        group: Group,
        rounds: Sequence[Sequence[Segment]],
        *,
        enabled: bool = True,
        hosts: Sequence[str | None] | None = None,
        depth: int = 2,
        published: Sequence[tuple[str, int]] | None = None,
        reserved: Region | None = None,
    ) -> HostLinks:
        """Create this rank's region when a consumer of its reads may share its host, map the regions of the
        readers on this host, and agree on who reaches whom. Every rank takes part whatever `enabled` says (a rank
        that does not take part would leave the others waiting): one that is not enabled maps and offers nothing.
        hosts: every rank's host_key() when known already (SharePlan.hosts; else gathered here).
        depth: rounds a region holds (the same on every rank), so that a reader fills one part while its consumers
        still read others.
        published: every rank's region (name, size) as reserved before the plan and gathered with it (Region.create;
        "" where none), saving the gather of names here; reserved: this rank's own (the caller's: released here)."""
        rank, world = group.rank, group.size
        if hosts is None:
            mine = host_key() if enabled else None
            keys = [msgpack.unpackb(b) for b in all_gather_bytes(group, msgpack.packb(mine))]
        else:
            keys = list(hosts)  # what every rank was told alike: a rank not enabled only declines below
        wanted: dict[int, set[int]] = {}  # reader -> consumers that may share its host
        largest: dict[int, int] = {}
        for segments in rounds:
            fetched: dict[int, int] = {}
            for segment in segments:
                fetched[segment.reader] = fetched.get(segment.reader, 0) + segment.size
                key = keys[segment.reader]
                for consumer in segment.consumers:
                    if consumer != segment.reader and key is not None and keys[consumer] == key:
                        wanted.setdefault(segment.reader, set()).add(consumer)
            for reader, size in fetched.items():
                largest[reader] = max(largest.get(reader, 0), size)
        copies = max(1, min(depth, len(rounds)))
        links = cls(rank, {reader: largest[reader] for reader in wanted}, copies)
        if not wanted:  # the same on every rank: no two ranks that need the same bytes claim one host
            if reserved is not None:
                reserved.release()
            return links
        own: Region | None = None
        # A failure of this rank's own (memory to map a region, say) must not leave the others waiting in the
        # gathers below: it offers and maps nothing, joins both, and every rank learns of it in the last one.
        failure: BaseException | None = None
        mapped: list[int] = []
        try:
            try:
                if rank in wanted and enabled:
                    size = copies * largest[rank]
                    own = reserved if published is not None else Region.create(size)
                    if own is not None and own.allocate(size) is None:
                        own.release()  # no room for its pages: its consumers take its bytes through the group
                        own = None
            except Exception as exc:
                failure = exc
            if published is None:
                fixed = all_gather_fixed(group, (own.name if own else "").encode(), 64)
                published = [(b.decode("ascii", "replace"), copies * largest.get(r, 0)) for r, b in enumerate(fixed)]
            try:
                if own is not None and own.array is not None:
                    links.views[rank] = own.array
                for reader, consumers in wanted.items():
                    name, size = published[reader]
                    if failure is None and enabled and rank in consumers and _region_name(name):
                        view = _attach(name, size, copies * largest[reader])
                        if view is not None:
                            links.views[reader] = view
                            mapped.append(reader)
            except Exception as exc:
                failure, mapped = exc, []
            offer = [mapped, own is not None, None if failure is None else f"{type(failure).__name__}: {failure}"]
            reached = [msgpack.unpackb(b) for b in all_gather_bytes(group, msgpack.packb(offer))]
        finally:
            for region in {id(r): r for r in (own, reserved) if r is not None}.values():
                region.release()  # every peer that maps it has opened it: nothing is left in /dev/shm from here on
        failed = {rank: cause for rank, (_, _, cause) in enumerate(reached) if cause is not None}
        if failed:
            links.close()
            if failure is not None:
                raise failure
            raise PeerFailed(f"another rank failed to set up the shared memory of a shared read: {failed}")
        offering = {reader for reader, (_, offers, _) in enumerate(reached) if offers is True}
        for consumer, (readers, _, _) in enumerate(reached):
            for reader in readers:
                if reader in offering and 0 <= reader < world and reader in wanted and consumer in wanted[reader]:
                    links.linked.add((reader, consumer))
        for reader in list(links.views):
            if reader != rank and (reader, rank) not in links.linked:
                del links.views[reader]
        if own is not None and not any(reader == rank for reader, _ in links.linked):
            del links.views[rank]
        return links

    def region(self, reader: int, round_number: int) -> np.ndarray | None:
        """The part of `reader`'s region that holds its reads of this round (None: not mapped here)."""
        view = self.views.get(reader)
        if view is None:
            return None
        part = self.parts[reader]
        start = (round_number % self.copies) * part
        return view[start : start + part]

    def links(self, reader: int, consumer: int) -> bool:
        return (reader, consumer) in self.linked

    def close(self) -> None:
        self.views.clear()  # the mappings go with the last array over them


class Region:
    """A /dev/shm file of this rank: created at a size (no pages yet), then its first bytes allocated up front (a
    full tmpfs refuses there, never as a SIGBUS on a later write) and mapped read-write; unlinked (`release`) once
    the peers have opened it."""

    def __init__(self, name: str, fd: int, size: int) -> None:
        self.name, self.fd, self.size = name, fd, size
        self.array: np.ndarray | None = None

    @classmethod
    def create(cls, size: int) -> Region | None:
        """A new file of `size` bytes (sparse: nothing allocated), or None when this /dev/shm takes no file."""
        _remove_orphans()
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(12)}"
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            return None
        try:
            os.ftruncate(fd, max(size, 1))
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            return None
        return cls(name, fd, max(size, 1))

    def allocate(self, size: int) -> np.ndarray | None:
        """The first `size` bytes (at most the file's), allocated and mapped; None when there is no room."""
        if size > self.size:
            return None
        try:
            os.posix_fallocate(self.fd, 0, max(size, 1))
            mapping = mmap.mmap(self.fd, max(size, 1), prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError):
            return None
        self.array = np.frombuffer(mapping, dtype=np.uint8)
        return self.array

    def release(self) -> None:
        """Unlink the file and close it (a mapping lives on); again: nothing."""
        if self.fd < 0:
            return
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(SHM_DIR, self.name))
        os.close(self.fd)
        self.fd = -1


def _remove_orphans(now: float | None = None) -> None:
    """Delete the regions that ranks killed during a shared read's setup left (a region is unlinked within the
    setup's collectives, seconds after it is made: one named for ORPHAN_AGE is no running read's). Never fails."""
    now = time.time() if now is None else now
    try:
        names = [name for name in os.listdir(SHM_DIR) if name.startswith(PREFIX)]
    except OSError:
        return
    for name in names:
        path = os.path.join(SHM_DIR, name)
        with contextlib.suppress(OSError):
            found = os.lstat(path)
            if now - found.st_mtime > ORPHAN_AGE:
                os.unlink(path)


def _region_name(name: object) -> bool:
    """Whether a peer's published name can only name a region file in SHM_DIR."""
    return isinstance(name, str) and name.startswith(PREFIX) and "/" not in name and "\0" not in name


def _attach(name: str, file_size: int, size: int) -> np.ndarray | None:
    """The first `size` bytes of a peer's region mapped read-only, or None when this /dev/shm has no such file of
    `file_size` bytes (the size it was created at)."""
    if size > file_size:
        return None
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size != max(file_size, 1):
            return None
        mapping = mmap.mmap(fd, max(size, 1), prot=mmap.PROT_READ)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return np.frombuffer(mapping, dtype=np.uint8)


@contextlib.contextmanager
def links_for(
    group: Group,
    rounds: Sequence[Sequence[Segment]],
    enabled: bool,
    hosts: Sequence[str | None] | None,
    depth: int = 2,
    published: Sequence[tuple[str, int]] | None = None,
    reserved: Region | None = None,
) -> Iterator[HostLinks]:
    """HostLinks.build (collective on every rank, `enabled` or not); dropped on exit."""
    links = HostLinks.build(
        group, rounds, enabled=enabled, hosts=hosts, depth=depth, published=published, reserved=reserved
    )
    try:
        yield links
    finally:
        links.close()
