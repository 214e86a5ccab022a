"""The node-local tier a Checkpointer keeps beside its persistent root: frequent saves into each node's local
storage, copied to peers on other nodes, restored from whatever survived (distributed.tier_save / tier_restore).
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from shardckpt import knobs
from shardckpt.catalog.local_tier import (
    Footprint,
    LocalTierWarning,
    discard_leftovers,
    discard_local,
    footprint,
    inventory,
    prune_local,
)
from shardckpt.distributed import group_calls as calls
from shardckpt.distributed.collectives import Group
from shardckpt.distributed.shared_reads import node_ids
from shardckpt.distributed.tier_restore import LocalTierError, TierRestore, restore_local
from shardckpt.distributed.tier_save import save_local
from shardckpt.errors import ShardckptError, ShardckptUsageError
from shardckpt.storage.volatile import open_local_tier


class LocalTier:
    """Saves every `every_steps` steps into `root` on each node (one directory per node: tmpfs or local NVMe),
    keeping the newest `keep` of this `job` there and deleting other jobs' local checkpoints; each rank's files are
    also kept by `peers` ranks on other nodes. All ranks of `group` call every method together."""

    def __init__(
        self,
        root: str,
        *,
        group: Group | calls.Solo,
        job: str,
        every_steps: int,
        keep: int,
        peers: int,
        durable: bool | None = None,
        block_size: int | None = None,
        persistent: str | None = None,
    ) -> None:
        for what, value, low in (("local_every_steps", every_steps, 1), ("local_keep", keep, 1), ("peers", peers, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ShardckptUsageError(f"{what} must be an integer >= {low}, got {value!r}")
        if not isinstance(root, str) or not root or "://" in root:
            raise ShardckptUsageError(f"local_root must be a directory path on the node, got {root!r}")
        if persistent is not None and _nested(root, persistent):
            # Local checkpoints there would be listed, ordered and pruned as persistent ones (and the reverse).
            raise ShardckptUsageError(
                f"local_root {root!r} and the persistent root {persistent!r} overlap: give the local tier a "
                "directory of its own, outside the persistent root (e.g. /dev/shm/<job>)"
            )
        if isinstance(group, Group):
            _check_agreement(group, job, peers, every_steps)
        self.storage = open_local_tier(root, durable)
        self.job, self.every_steps, self.keep, self.peers, self.block_size = job, every_steps, keep, peers, block_size
        # Each rank's node: SHARDCKPT_NODE, else torchrun's GROUP_RANK; without either, one node for all ranks.
        found = node_ids(group) if isinstance(group, Group) else None
        self.nodes: list[int] = found if found is not None else [0] * group.size
        if peers and group.size > 1 and len(set(self.nodes)) < 2 and group.rank == 0:
            warnings.warn(
                f"local tier {root}: every rank is on one node (SHARDCKPT_NODE or torchrun's GROUP_RANK names a "
                f"rank's node), so peers={peers} keeps no copy elsewhere: losing the node loses the local tier",
                LocalTierWarning,
                3,
            )
        self.last_step: int | None = None
        self._failed: list[str] = []  # failed local saves whose files this node has still to delete
        self._tidy = False  # whether this job's crash leftovers on the nodes are deleted (at restore or first save)
        self.last_restore: TierRestore | None = None

    def footprint(self, rank: int) -> Footprint:
        """What this rank's node's local tier takes now (its own ranks' files, replicas kept for peers, the rest)."""
        return footprint(self.storage, [r for r, node in enumerate(self.nodes) if node == self.nodes[rank]])

    def held(self, group: Group | calls.Solo) -> list[str]:
        """The names of this job's committed local checkpoints that any node holds (collective: each rank lists its
        node's root, an unreadable root counting as empty)."""
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", LocalTierWarning)  # a restore reports broken copies
                mine = [copy.name for copy in inventory(self.storage) if copy.job == self.job]
        except ShardckptError:
            mine = []
        return sorted({name for raw in calls.all_gather(group, calls.pack(mine)) for name in calls.unpack(raw)})

    def due(self, step: int) -> bool:
        return step % self.every_steps == 0 and step != self.last_step

    def save(
        self, state: Mapping[str, Any] | Callable[[], Mapping[str, Any]], step: int, group: Group | calls.Solo
    ) -> str | None:
        """Save `state` as this step's local checkpoint on every node, then prune each node's tier; its name.

        A failed local save (tmpfs full, a rank's state) warns on every rank and returns None: training goes on
        with the local checkpoints it has and the persistent ones, which the failure does not touch."""
        self.last_step = step
        started: list[str] = []
        node_lead = group.rank == min(r for r, node in enumerate(self.nodes) if node == self.nodes[group.rank])
        try:
            if not self._tidy:
                if node_lead:
                    self._discard_leftovers()
                # No rank writes into its new save before every node has deleted this job's leftovers: a leftover's
                # name and the new one's differ only by attempt.
                calls.vote(group, False)
                self._tidy = True
            name, _ = save_local(
                state,
                self.storage,
                group=group,
                nodes=self.nodes,
                step=step,
                job=self.job,
                peers=self.peers,
                block_size=self.block_size,
                started=started,
            )
        except ShardckptError as exc:
            warnings.warn(f"local save of step {step} failed, nothing of it used: {exc}", LocalTierWarning, 3)
            self._failed.extend(started)
            if node_lead:  # every rank has learned the failure: none writes into the attempt any more
                self._discard_failed()
            return None
        if node_lead:
            self._discard_failed()  # what an earlier failure could not delete
            try:
                prune_local(
                    self.storage, self.keep, self.job, now=time.time(), grace=knobs.LOCAL_TIER_GRACE, keep_names=(name,)
                )
            except Exception as exc:  # the save is committed: pruning costs space, not data (and no rank may stop)
                warnings.warn(f"local tier {self.storage.url}: retention failed: {exc}", LocalTierWarning, 2)
        return name

    def _discard_leftovers(self) -> None:
        """(one rank per node, no save under way) Delete at once what a crash or kill of this job mid-save left on this
        node: it is never used, and on a tmpfs sized for the kept checkpoints it would fail every later save until
        the grace period that other jobs' leftovers get (their names carry another job's tag)."""
        try:
            discard_leftovers(self.storage, self.job)
        except Exception as exc:  # costs room, not data: the grace period still deletes it
            warnings.warn(
                f"local tier {self.storage.url}: cannot delete this job's leftovers: {exc}", LocalTierWarning, 3
            )

    def _discard_failed(self) -> None:
        """(one rank per node) Delete this node's part of the failed local saves at once: left for the grace period,
        a tmpfs that filled up once (the failed attempt's partial files on top of the kept checkpoints) would stay
        full, failing every later local save, and take host memory from everything else on the node."""
        for name in list(self._failed):
            try:
                discard_local(self.storage, name)
            except Exception as exc:  # tried again after the next save
                warnings.warn(
                    f"local tier {self.storage.url}: cannot delete failed save {name}: {exc}", LocalTierWarning, 3
                )
            else:
                self._failed.remove(name)

    def restore(
        self,
        state: Mapping[str, Any],
        group: Group | calls.Solo,
        *,
        newer_than: int | None,
        optional: Sequence[str] = (),
        cast: bool = False,
        max_in_flight: int | None = None,
    ) -> TierRestore | None:
        """Fill `state` from the newest local checkpoint of this job above `newer_than` that the nodes hold between
        them; None (state untouched) when there is none or it fails (a LocalTierWarning says why)."""
        if group.rank == min(r for r, node in enumerate(self.nodes) if node == self.nodes[group.rank]):
            self._discard_leftovers()  # a restore writes nothing into the tier: no rank can be writing what goes
        self._tidy = True
        failed: list[tuple[str, str, int]] = []
        avoid: tuple[tuple[int, int], ...] = ()
        retried: set[tuple[str, str, int]] = set()
        while True:  # each failed save is left out and the next older one tried: every rank sees the same failures
            try:
                restored = restore_local(
                    state,
                    self.storage,
                    group=group,
                    nodes=self.nodes,
                    job=self.job,
                    newer_than=newer_than,
                    exclude=failed,
                    avoid=avoid,
                    optional=optional,
                    cast=cast,
                    max_in_flight=max_in_flight,
                )
                break
            except LocalTierError as exc:
                warnings.warn(f"restore from the local tier failed, nothing of it used: {exc}", LocalTierWarning, 2)
                if exc.key is None or exc.key in failed:
                    return None
                if exc.readers and exc.key not in retried:  # the same save once more, from the nodes not yet tried
                    retried.add(exc.key)
                    avoid = exc.readers
                    continue
                avoid = ()
                failed.append(exc.key)
        if restored is not None:
            self.last_step, self.last_restore = restored.step, restored
        return restored


def _check_agreement(group: Group, job: str, peers: int, every_steps: int) -> None:
    """(all) ShardckptUsageError on every rank when the ranks name different jobs, peers or local_every_steps. The
    job tags every local save's name and decides which copies a restore pools: ranks that disagree saved under
    different names and, at the restore, chose different saves (one restoring from the tier, another not); peers
    and the cadence decide which collectives a save runs. Either way the ranks' collectives mismatched: a hang."""
    # The job as bytes: one from a path that is not UTF-8 holds surrogates (os.fsdecode), which do not pack as a str.
    mine = calls.pack([job.encode("utf-8", "surrogatepass"), peers, every_steps])
    settings = [calls.unpack(raw) for raw in calls.all_gather(group, mine)]
    jobs = [raw.decode("utf-8", "surrogatepass") for raw, _, _ in settings]
    if len(set(jobs)) > 1:
        named = ", ".join(f"rank {rank}: {other!r}" for rank, other in enumerate(jobs) if other != jobs[0])
        raise ShardckptUsageError(
            f"the ranks disagree on the local tier's job (rank 0: {jobs[0]!r}, {named}): its default is the "
            "persistent root's real path, which differs where nodes reach it by other paths (mount points, links); "
            "pass local_job= with one string on every rank"
        )
    for what, index in (("peers", 1), ("local_every_steps", 2)):
        values = [setting[index] for setting in settings]
        if len(set(values)) > 1:
            named = ", ".join(f"rank {rank}: {value}" for rank, value in enumerate(values) if value != values[0])
            raise ShardckptUsageError(
                f"the ranks disagree on the local tier's {what} (rank 0: {values[0]}, {named}): "
                "give every rank the same"
            )


def _nested(local: str, persistent: str) -> bool:
    """Whether two roots are the same directory or one lies inside the other (a persistent URL never is local)."""
    if "://" in persistent and not persistent.startswith("file://"):
        return False
    one = os.path.realpath(local)
    other = os.path.realpath(persistent.removeprefix("file://"))
    return one == other or one.startswith(other.rstrip("/") + "/") or other.startswith(one.rstrip("/") + "/")


def job_of(root: str) -> str:
    """The default job of a local tier: its persistent root, a local path made absolute and resolved, so that
    `ckpt`, `./ckpt/` and `/abs/ckpt` name one job (another spelling would make its own tier another job's)."""
    if "://" in root and not root.startswith("file://"):
        return root.rstrip("/")
    return os.path.realpath(root.removeprefix("file://"))
