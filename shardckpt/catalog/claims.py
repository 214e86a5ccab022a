"""Claims on an attempt (SPEC 14): the commit and a collector each create `claim-<attempt>` create-only before they act
on an uncommitted attempt, so a save paused past gc's grace period and the gc that collects it never both win.

A commit that holds the claim checks its own files are all still there, then creates COMMITTED; a collector that
holds it deletes the attempt's files, the claim last. Whoever finds the other's claim stands back.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardckpt.errors import AlreadyExistsError, NotFoundError, ShardckptError
from shardckpt.format import layout
from shardckpt.storage import Storage

BY_COMMIT = b'{"format":"shardckpt-claim","by":"commit"}\n'
BY_COLLECTOR = b'{"format":"shardckpt-claim","by":"collector"}\n'
MAX_CLAIM_BYTES = 4096
CREATED, HELD = "created", "held"
_TRIES = 3  # a claim released between our create and our read is created again; a few times at most


def holder(checkpoint: Storage, attempt: str) -> bytes | None:
    """The claim on `attempt` in `checkpoint` (BY_COMMIT, BY_COLLECTOR or other bytes), None when there is none."""
    try:
        return checkpoint.read_small(layout.claim_path(attempt), MAX_CLAIM_BYTES)
    except NotFoundError:
        return None


def claim(checkpoint: Storage, attempt: str, by: bytes) -> str:
    """Create the claim on `attempt` for `by` with the backend's create-if-absent primitive: CREATED (this call
    created it), HELD (found created by the same kind of claimant: a retried commit, a collector resuming) or ""
    when another holds it (or bytes nobody wrote: never acted on)."""
    for _ in range(_TRIES):
        try:
            checkpoint.commit_marker(layout.claim_path(attempt), by)
            return CREATED
        except AlreadyExistsError:
            found = holder(checkpoint, attempt)
        if found is not None:
            return HELD if found == by else ""
    return ""


def release(checkpoint: Storage, attempt: str, by: bytes) -> None:
    """Delete `by`'s claim on `attempt` (what its holder does when it stands back); another's claim stays. Best
    effort: a claim left behind only keeps collectors away from the attempt's files (a person removes them)."""
    try:
        if holder(checkpoint, attempt) == by:
            checkpoint.delete(layout.claim_path(attempt))
    except ShardckptError:
        pass


def missing_files(checkpoint: Storage, attempt: str, world_size: int) -> Sequence[str]:
    """The files of `attempt` (global manifest, every rank's local manifest and data file) that are not listed: a
    commit holding its claim checks that nothing was collected before it claimed. Three listings, not 2W+1 reads."""
    expected = [layout.global_manifest_path(attempt)]
    expected += [layout.local_manifest_path(rank, attempt) for rank in range(world_size)]
    expected += [layout.data_path(rank, attempt) for rank in range(world_size)]
    listed = set(checkpoint.list())
    for directory in (layout.RANKS_DIR, layout.DATA_DIR):
        listed |= {f"{directory}/{name}" for name in checkpoint.list(directory)}
    return [path for path in expected if path not in listed]
