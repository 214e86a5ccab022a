"""What a node's local tier holds (committed local copies, their job, the data files present) and which copy a
restore takes: the newest step of this job complete across the copies of the surviving ranks. Torch-free.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import warnings
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from shardckpt.catalog.chain import read_global_manifest
from shardckpt.catalog.deletion import delete_objects, layout_objects
from shardckpt.catalog.listing import list_root
from shardckpt.catalog.retention import delete_checkpoint
from shardckpt.errors import NotFoundError, ShardckptError
from shardckpt.format.layout import COMMITTED, parse_data_path
from shardckpt.storage import Storage

# The global manifest's metadata key naming the job a local copy belongs to (the Checkpointer's persistent root,
# unless given): a tier another job left on a node is never mixed into this one's restore.
JOB_KEY = "shardckpt.tier.job"
# The save's layout, for the tools (ops.local_tier): each rank's node (an index), its node's directory as
# "host:realpath" (what tells `shardckpt ls` which node's directory it looks at), and the peers setting. A restore
# never relies on them: it looks at what is there.
NODES_KEY = "shardckpt.tier.nodes"
HOMES_KEY = "shardckpt.tier.homes"
PEERS_KEY = "shardckpt.tier.peers"


def home(root: Storage) -> str:
    """A node's local tier directory as recorded in a local save: this host's name and the directory's real path."""
    # A path's bytes that are not UTF-8 (os.fsdecode's surrogates) would not pack: escaped, as a record only.
    path = os.fsencode(os.path.realpath(root.url)).decode("utf-8", "backslashreplace")
    return f"{socket.gethostname()}:{path}"


# A local save's name (distributed.tier_save.local_name): step, its job's tag (job_tag; absent in names of earlier
# releases), then attempt. Only such names are pruned uncommitted.
LOCAL_NAME = re.compile(r"step-[0-9]{8,}(?:-[0-9a-f]{8})?-[0-9a-z]{1,64}")
TAGGED_LOCAL_NAME = re.compile(r"step-[0-9]{8,}-[0-9a-f]{8}-[0-9a-z]{1,64}")  # with its job's tag (job_tag)


def job_tag(job: str) -> str:
    """The short hash of a job that its local saves' names carry: an uncommitted save is known as the job's from its
    first file, so that a restart of the job can delete it at once (a crash leaves no manifest saying whose it is)."""
    return hashlib.sha256(job.encode("utf-8", "surrogatepass")).hexdigest()[:8]


class LocalTierWarning(UserWarning):
    """A node's local tier holds something a restore or a save leaves aside (another job's copies, a broken copy)."""


@dataclass(frozen=True)
class LocalCopy:
    """One committed local checkpoint on a node: its identity, and the data files (piece-table indexes) it holds
    whole (present, of the recorded size)."""

    name: str
    attempt: str
    step: int | None
    job: str | None
    manifest_crc32c: int
    files: int  # how many data files the checkpoint has in all
    held: tuple[int, ...]
    created: float = 0.0  # COMMITTED's creation time (Unix seconds)

    @property
    def key(self) -> tuple[str, str, int]:
        """What two nodes' copies of one save share, and copies of different saves never do."""
        return (self.name, self.attempt, self.manifest_crc32c)

    def pack(self) -> list[object]:
        return [
            self.name,
            self.attempt,
            self.step,
            self.job,
            self.manifest_crc32c,
            self.files,
            list(self.held),
            self.created,
        ]

    @classmethod
    def unpack(cls, fields: Sequence[object]) -> LocalCopy:
        name, attempt, step, job, crc, files, held, created = fields
        assert isinstance(name, str) and isinstance(attempt, str) and isinstance(crc, int) and isinstance(files, int)
        assert (step is None or isinstance(step, int)) and (job is None or isinstance(job, str))
        assert isinstance(held, list) and isinstance(created, (int, float))
        return cls(name, attempt, step, job, crc, files, tuple(int(file) for file in held), float(created))


def inventory(root: Storage) -> list[LocalCopy]:
    """Every committed checkpoint directly under `root` (a node's local tier) that reads back; one that does not
    (a broken manifest) is left out with a LocalTierWarning."""
    copies = []
    listing = list_root(root)
    for entry in listing.entries:
        if entry.error is not None and entry.alias_of is None:  # a COMMITTED that does not read: say why it is unused
            warnings.warn(f"local tier {root.describe(entry.name)} left aside: {entry.error}", LocalTierWarning, 2)
    for entry in listing.committed():
        if entry.marker is None:
            continue
        checkpoint = root.child(entry.name)
        try:
            manifest = read_global_manifest(checkpoint, entry.marker)
            held = tuple(
                index for index, file in enumerate(manifest.files) if _whole(checkpoint, file.data, file.data_size)
            )
        except ShardckptError as exc:
            warnings.warn(f"local tier {checkpoint.url} left aside: {exc}", LocalTierWarning, stacklevel=2)
            continue
        job = manifest.metadata.get(JOB_KEY)
        copies.append(
            LocalCopy(
                entry.name,
                entry.marker.attempt,
                manifest.step,
                job if isinstance(job, str) else None,
                entry.marker.manifest_crc32c,
                len(manifest.files),
                held,
                entry.marker.created,
            )
        )
    return copies


def _whole(checkpoint: Storage, path: str, size: int) -> bool:
    try:
        return checkpoint.size(path) == size
    except NotFoundError:
        return False


@dataclass(frozen=True)
class Footprint:
    """What a node's local tier takes: data bytes of its own ranks' files and of the replicas it keeps for peers,
    and of the manifests (every file of its checkpoints' directories counted once)."""

    checkpoints: int
    own_bytes: int
    replica_bytes: int
    other_bytes: int  # manifests, markers, other jobs' checkpoints and leftovers


def footprint(root: Storage, own_ranks: Collection[int]) -> Footprint:
    """The footprint of a node's local tier (`own_ranks`: the ranks of the node, whose files are not replicas)."""
    own = replicas = other = checkpoints = 0
    try:
        names = root.list()
    except NotFoundError:  # no local save on this node yet
        names = []
    for name in names:
        checkpoint = root.child(name)
        try:
            objects = layout_objects(checkpoint)
        except NotFoundError:  # a file, not a checkpoint directory
            continue
        for path, _ in objects:
            size = checkpoint.size(path)
            if path.startswith("data/"):
                rank, _ = parse_data_path(path)
                own, replicas = (own + size, replicas) if rank in own_ranks else (own, replicas + size)
            else:
                other += size
        checkpoints += 1
    return Footprint(checkpoints, own, replicas, other)


@dataclass(frozen=True)
class Choice:
    """The local checkpoint a restore takes, and which ranks hold each of its data files."""

    name: str
    attempt: str
    step: int
    holders: dict[int, tuple[int, ...]]  # data file index -> ranks whose node holds it
    key: tuple[str, str, int]  # LocalCopy.key


def choose(
    copies: Sequence[Sequence[LocalCopy]],
    job: str,
    newer_than: int | None,
    exclude: Collection[tuple[str, str, int]] = (),
) -> tuple[Choice | None, list[str]]:
    """The newest save of `job` (by step) whose data files the ranks' copies (`copies[rank]`) hold between them,
    with a step above `newer_than` (the newest persistent checkpoint's) and not in `exclude` (saves that failed to
    restore); and what was left aside, in words."""
    saves: dict[tuple[str, str, int], dict[int, set[int]]] = {}
    facts: dict[tuple[str, str, int], LocalCopy] = {}
    others: set[str] = set()
    for rank, held in enumerate(copies):
        for copy in held:
            if copy.job != job:
                others.add(f"{copy.name} (job {copy.job!r})")
                continue
            facts[copy.key] = copy
            for file in copy.held:
                saves.setdefault(copy.key, {}).setdefault(file, set()).add(rank)
    aside = [f"another job's local checkpoint {name}" for name in sorted(others)]
    best: Choice | None = None
    best_created = 0.0
    for key, copy in facts.items():
        holders = saves.get(key, {})
        if copy.step is None or len(holders) != copy.files or set(holders) != set(range(copy.files)):
            aside.append(f"{copy.name}: {len(holders)} of its {copy.files} data files survive")
            continue
        if (newer_than is not None and copy.step <= newer_than) or key in exclude:
            continue
        # The newest order of SPEC 14 (step, then commit time, then name): of two saves of one step (a run resumed
        # from an older checkpoint saved it again), the later one, never the one a coin toss of attempt ids picks.
        if best is None or (copy.step, copy.created, copy.name) > (best.step, best_created, best.name):
            best = Choice(copy.name, copy.attempt, copy.step, {f: tuple(sorted(r)) for f, r in holders.items()}, key)
            best_created = copy.created
    return best, aside


def discard_local(root: Storage, name: str) -> bool:
    """Delete what a failed local save of this tier left in a node's root (its attempt only, COMMITTED first where
    the node committed before another failed); whether anything was there."""
    checkpoint = root.child(name)
    try:
        paths = [path for path, _ in layout_objects(checkpoint)]
        committed = checkpoint.exists(COMMITTED)
    except NotFoundError:
        return False
    delete_objects(root, name, [COMMITTED, *paths] if committed else paths)
    return True


def discard_leftovers(root: Storage, job: str) -> list[str]:
    """(one rank per node, while no save of `job` is under way) Delete the local saves of `job` that never committed on
    this node (a crash or a kill mid-save): named with its job_tag, no other job's; the names deleted."""
    mine = re.compile(rf"step-[0-9]{{8,}}-{job_tag(job)}-[0-9a-z]{{1,64}}")
    try:
        listing = list_root(root)
    except NotFoundError:  # no local save on this node yet
        return []
    deleted = []
    for entry in listing.entries:
        if entry.alias_of is not None or not entry.owned or not mine.fullmatch(entry.name):
            continue
        checkpoint = root.child(entry.name)
        if entry.marker is None and entry.error is None and not checkpoint.exists(COMMITTED):
            delete_objects(root, entry.name, [path for path, _ in layout_objects(checkpoint)])
            deleted.append(entry.name)
    return deleted


def prune_local(
    root: Storage, keep: int, job: str, *, now: float, grace: float, keep_names: Sequence[str] = ()
) -> list[str]:
    """(one rank per node, between its saves) Delete what a node's local tier no longer needs: local saves that never
    committed here and committed checkpoints of other jobs, each once older than `grace` seconds at `now` (another job
    sharing the root may be writing them), then all but the newest `keep` of this job's (never one in keep_names);
    the names deleted."""
    listing = list_root(root)
    deleted = []
    for entry in listing.entries:
        leftover = entry.marker is None and entry.alias_of is None and entry.owned
        if leftover and LOCAL_NAME.fullmatch(entry.name) and entry.name not in keep_names:
            checkpoint = root.child(entry.name)
            objects = [path for path, _ in layout_objects(checkpoint)]
            times = [checkpoint.modified(path) for path in objects]
            if all(time is not None and time < now - grace for time in times):
                delete_objects(root, entry.name, objects)
                deleted.append(entry.name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LocalTierWarning)  # a broken copy is reported by the restore that meets it
        copies = inventory(root)
    readable = {copy.name for copy in copies}
    for copy in copies:
        if copy.job != job and copy.name not in keep_names and copy.created < now - grace:
            delete_checkpoint(root, copy.name)
            deleted.append(copy.name)
    # Retention counts this job's copies only: another job's newer steps must not push this one's out, nor this
    # job's push out another's still in its grace period. A committed copy whose manifest does not read (no job
    # known) goes as another job's does, once older than the grace period.
    mine = {copy.name for copy in copies if copy.job == job}
    ours = []  # oldest first, as retention orders them
    for entry in list_root(root).committed():
        if not entry.owned or entry.name in deleted or entry.marker is None:
            continue
        if entry.name not in readable and entry.name not in keep_names and entry.marker.created < now - grace:
            delete_checkpoint(root, entry.name)
            deleted.append(entry.name)
        elif entry.name in mine:
            ours.append(entry.name)
    for name in ours[: max(0, len(ours) - keep)]:
        if name not in keep_names:
            delete_checkpoint(root, name)
            deleted.append(name)
    return deleted
