"""Garbage collection under a root: committed checkpoints beyond keep_last, and leftovers of failed attempts.

Never deletes the newest committed checkpoint, a file of a committed attempt, a name the layout does not give,
an uncommitted checkpoint or leftover modified within the grace period (it may belong to a save running now; a
committed checkpoint is finished, so the grace period does not apply to pruning), or anything behind a link or
outside ROOT. The listing, the order and the deletion itself are catalog's, shared with Checkpointer retention.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

from shardckpt import knobs
from shardckpt.catalog import DIRECTORIES, Entry, Listing, delete_objects, layout_objects, list_root, read_commit_marker
from shardckpt.catalog.chain import require_exists
from shardckpt.catalog.claims import BY_COLLECTOR, BY_COMMIT, claim, holder, release
from shardckpt.catalog.deletion import attempt_of, is_successor
from shardckpt.catalog.local_tier import TAGGED_LOCAL_NAME, LocalTierWarning, inventory
from shardckpt.crashpoints import check_crash_at, crash_point
from shardckpt.errors import NotFoundError, ShardckptError, ShardckptUsageError
from shardckpt.format import layout, limits
from shardckpt.format.manifest import decode_global_manifest
from shardckpt.storage import Storage, open_storage
from shardckpt.storage.base import Upload

DEFAULT_GRACE = knobs.GC_GRACE


@dataclass(frozen=True)
class Doomed:
    """One object to delete: `path` relative to its checkpoint directory, with its size in bytes (or, with
    `upload`, an unfinished upload of that object to abort: the bytes of its parts)."""

    path: str
    size: int
    upload: Upload | None = None


@dataclass
class Action:
    """What gc does to one checkpoint directory (`checkpoint`, a name directly under ROOT).

    kind: "prune" (a committed checkpoint beyond keep_last: COMMITTED first, then everything the layout names),
    "incomplete" (never committed, untouched for longer than the grace period: everything the layout names), or
    "leftovers" (files of failed attempts inside a committed checkpoint; the committed attempt is never touched),
    or "uploads" (an object store's unfinished multipart uploads of layout objects, no part added for the grace
    period: what a save killed while uploading leaves, stored and billed but never an object; aborted).
    """

    checkpoint: str
    kind: str
    reason: str
    objects: list[Doomed]
    directories: list[str] = field(default_factory=list)  # removed when empty, after the objects ("" = itself)
    deleted: int = 0
    error: str | None = None
    note: str | None = None  # why a planned action was not carried out, when that is not a failure

    @property
    def bytes(self) -> int:
        return sum(doomed.size for doomed in self.objects)


@dataclass(frozen=True)
class Skipped:
    """A directory (or part of one) gc leaves alone, and why."""

    checkpoint: str
    reason: str


@dataclass
class GcPlan:
    storage: Storage
    grace: float
    keep_last: int | None
    actions: list[Action] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # committed checkpoints that stay

    @property
    def objects(self) -> int:
        return sum(len(action.objects) for action in self.actions)

    @property
    def bytes(self) -> int:
        return sum(action.bytes for action in self.actions)

    @property
    def ok(self) -> bool:
        return all(action.error is None for action in self.actions)


def plan_gc(
    root_url: str | Storage,
    *,
    keep_last: int | None = None,
    grace: float = DEFAULT_GRACE,
    now: float | None = None,
    storage_options: dict[str, object] | None = None,
) -> GcPlan:
    """Decide what gc would delete under `root_url`, deleting nothing.

    keep_last: committed checkpoints to keep (None: prune none; at least 1: the newest is never deleted).
    grace: seconds; any object modified more recently (or whose age the backend cannot tell) is kept, and so is
    every other object of an uncommitted checkpoint that holds one.
    """
    if keep_last is not None and keep_last < 1:
        raise ShardckptUsageError(f"keep_last must be >= 1 (the newest checkpoint is never deleted), got {keep_last}")
    if not grace >= 0:
        raise ShardckptUsageError(f"grace must be a number of seconds >= 0, got {grace}")
    root = open_storage(root_url, storage_options)
    require_exists(root)
    now = time.time() if now is None else now
    plan = GcPlan(root, grace, keep_last)
    listing = list_root(root)
    pinned: set[str] = set()  # checkpoints that saves in progress reference (SPEC 14 rule 3)
    unknown: list[str] = []  # saves in progress whose references cannot be read
    for entry in listing.entries:
        name = entry.name
        if entry.not_owned is not None:
            plan.skipped.append(Skipped(name, entry.not_owned))
            continue
        checkpoint = root.child(name)
        if entry.error is not None:
            reason = f"unreadable {layout.COMMITTED} marker, left for a person to judge: {entry.error}"
            plan.skipped.append(Skipped(name, reason))
            continue
        objects = layout_objects(checkpoint)
        if entry.marker is None:
            if objects and not _plan_incomplete(plan, name, checkpoint, objects, now):
                try:
                    pinned |= _references_in_progress(checkpoint, objects)
                except ShardckptError as exc:
                    unknown.append(f"{name}: {exc}")
            elif not objects:
                _plan_skeleton(plan, name, checkpoint, now)
            continue
        # Files of attempts a later save superseded (SPEC 14.2) are leftovers too; the markers are not.
        stale = [(p, attempt) for p, attempt in objects if attempt != entry.marker.attempt and not is_successor(p)]
        if stale:
            _plan_leftovers(plan, name, checkpoint, stale, now)
    _plan_uploads(plan, root, listing, now)
    doomed = []
    parts = _by_job(listing) if keep_last is not None and not unknown else [listing]
    if keep_last is not None and unknown:
        reason = f"no committed checkpoint pruned: what a save in progress references is unreadable ({unknown[0]})"
        plan.skipped.append(Skipped(unknown[0].split(":", 1)[0], reason))
    elif keep_last is not None:
        tiered = _is_local_tier(listing)
        doomed = [
            entry
            for part in parts
            for entry in part.to_prune(keep_last, grace=grace, now=now, pinned=pinned)
            if not (tiered and _newer_is_young(part, entry, grace, now))
        ]
    pruned = {entry.name for entry in doomed}
    # Pruning covers the other actions on a pruned checkpoint; its unfinished uploads are not objects it deletes.
    plan.actions = [action for action in plan.actions if action.checkpoint not in pruned or action.kind == "uploads"]
    plan.skipped = [skipped for skipped in plan.skipped if skipped.checkpoint not in pruned]
    for entry in doomed:
        checkpoint = root.child(entry.name)
        marker_object = Doomed(layout.COMMITTED, _size(checkpoint, layout.COMMITTED))
        doomed_objects = [marker_object, *_sized(checkpoint, [path for path, _ in layout_objects(checkpoint)])]
        reason = f"committed, older than the newest {keep_last}" + (" of its job" if len(parts) > 1 else "")
        plan.actions.append(Action(entry.name, "prune", reason, doomed_objects, list(DIRECTORIES)))
    plan.kept = [entry.name for entry in listing.committed() if entry.owned and entry.name not in pruned]
    if keep_last is not None and not unknown:
        for part in parts:
            owned = [entry for entry in part.committed() if entry.owned]
            for entry in owned[: max(0, len(owned) - keep_last)]:
                if entry.name not in pruned:  # beyond keep_last yet kept: say why, or it looks like gc did nothing
                    why = _why_kept(part, entry, pinned, pruned, grace, now)
                    plan.skipped.append(Skipped(entry.name, f"committed, older than the newest {keep_last}, but {why}"))
    return plan


def _is_local_tier(listing: Listing) -> bool:
    """Whether the root is a node-local tier's: a committed checkpoint there has a local save's name (its job's tag)."""
    return any(TAGGED_LOCAL_NAME.fullmatch(entry.name) for entry in listing.committed())


def _newer_is_young(listing: Listing, entry: Entry, grace: float, now: float) -> bool:
    """On a node-local tier: whether the next newer local checkpoint of the job was committed here within the grace
    period. Each node commits its copy of a save on its own; until every node has, the newer one may be incomplete
    across the nodes (a kill then leaves it so), and this one is the newest that a restore can still take whole."""
    committed = listing.committed()
    newer = committed[committed.index(entry) + 1]
    return newer.marker is not None and now - newer.marker.created < grace


def _by_job(listing: Listing) -> list[Listing]:
    """The root's listing as retention counts it: on a node-local tier's root, one part per job that its local
    checkpoints' manifests name (keep_last is per job, as the Checkpointer's local retention: another job's newer
    steps never push this one's out); elsewhere the whole listing. A local name carries its job's tag, so other
    roots are told apart without reading a manifest."""
    if not _is_local_tier(listing):
        return [listing]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LocalTierWarning)  # a copy that does not read counts with no job
        jobs = {copy.name: copy.job for copy in inventory(listing.root)}
    committed = {entry.name for entry in listing.committed()}
    parts: dict[str | None, list[Entry]] = {}
    for entry in listing.entries:
        if entry.name in committed:
            parts.setdefault(jobs.get(entry.name), []).append(entry)
    rest = [entry for entry in listing.entries if entry.name not in committed]
    return [dataclasses.replace(listing, entries=tuple(rest + part)) for part in parts.values()]


def _why_kept(listing: Listing, entry: Entry, pinned: set[str], pruned: set[str], grace: float, now: float) -> str:
    """Why SPEC 14 keeps a committed checkpoint that keep_last alone would prune (the rules of Listing.kept_names)."""
    if entry.name in pinned:
        return "a save in progress references it"
    broken = next((other for other in listing.entries if other.error is not None), None)
    if broken is not None:
        return f"no committed checkpoint is pruned while {broken.name}'s {layout.COMMITTED} is unreadable"
    committed = listing.committed()
    newer = committed[committed.index(entry) + 1]
    age = now - newer.marker.created if newer.marker is not None else math.inf
    if age < grace and _is_local_tier(listing):
        return (
            f"within the grace period: the next newer, {newer.name}, was committed here {max(age, 0):.0f} s ago (grace "
            f"{grace:g} s), maybe not yet on every node, so this one may be the newest a restore can take whole "
            "(--grace 0 when no save is running)"
        )
    if age < grace:
        return (
            f"within the grace period: the next newer, {newer.name}, was committed {max(age, 0):.0f} s ago (grace "
            f"{grace:g} s), so a save started since may use it as its parent (--grace 0 when no save is running)"
        )
    referrers = [
        other.name
        for other in committed
        if other.name not in pruned and other.marker is not None and entry.name in dict(other.marker.references)
    ]
    if referrers:
        return f"{', '.join(referrers)} (kept) reference(s) pieces stored in it: it goes with the last of them"
    return "a kept checkpoint depends on it"


def collect(plan: GcPlan, progress: Callable[[Action, Doomed], None] | None = None) -> GcPlan:
    """Carry out `plan` (from plan_gc): delete its objects in order; returns the plan with what was done.

    An action that fails records its error and the others go on. A crash at any point leaves every committed
    checkpoint that is not being pruned intact, and a pruned one without COMMITTED (a reader sees it as gone).
    """
    check_crash_at()  # else a misspelt point is refused in each action, each after deleting one object
    for action in plan.actions:
        try:
            if action.kind == "incomplete" and not _claim_incomplete(plan.storage.child(action.checkpoint), action):
                continue
            by_path = {doomed.path: doomed for doomed in action.objects}

            def deleted(path: str, action: Action = action, by_path: dict[str, Doomed] = by_path) -> None:
                action.deleted += 1
                crash_point("during_gc")
                if progress is not None:
                    progress(action, by_path[path])

            if action.kind == "uploads":
                for doomed in action.objects:
                    assert doomed.upload is not None
                    plan.storage.abort_upload(doomed.upload)
                    deleted(doomed.path)
                continue
            paths = [doomed.path for doomed in action.objects]
            delete_objects(plan.storage, action.checkpoint, paths, directories=action.directories, after_each=deleted)
        except ShardckptError as exc:
            action.error = str(exc)
    return plan


def gc(
    root_url: str | Storage,
    *,
    keep_last: int | None = None,
    grace: float = DEFAULT_GRACE,
    dry_run: bool = False,
    now: float | None = None,
    storage_options: dict[str, object] | None = None,
    progress: Callable[[Action, Doomed], None] | None = None,
) -> GcPlan:
    """Plan and (unless dry_run) carry out garbage collection under `root_url`; see plan_gc and collect."""
    plan = plan_gc(root_url, keep_last=keep_last, grace=grace, now=now, storage_options=storage_options)
    return plan if dry_run else collect(plan, progress)


def _claim_incomplete(checkpoint: Storage, action: Action) -> bool:
    """Claim every attempt of an uncommitted checkpoint before deleting a byte of it (SPEC 14): an attempt whose
    commit claimed it first stays whole (a save held up past the grace period commits it complete); the planned
    objects hold the collector's claims (deleted last). False when nothing is left to delete."""
    if not action.objects:
        return True  # empty directories a collection left: nothing of an attempt to claim
    attempts = sorted({attempt_of(doomed.path) for doomed in action.objects} - {""})
    held = [attempt for attempt in attempts if claim(checkpoint, attempt, BY_COLLECTOR)]
    if read_commit_marker(checkpoint) is not None:
        for attempt in held:
            release(checkpoint, attempt, BY_COLLECTOR)
        action.note = "committed while gc ran: left alone"
        return False
    taken = [attempt for attempt in attempts if attempt not in held]
    if taken:
        action.note = f"attempt(s) {', '.join(taken)} claimed by their commit first: left whole"
    action.objects = [doomed for doomed in action.objects if attempt_of(doomed.path) not in taken]
    if taken:
        action.directories = []  # the commit's files stay: so do their directories
    return bool(action.objects)


# --------------------------------------------------------------------------------------------- planning


def _plan_incomplete(plan: GcPlan, name: str, checkpoint: Storage, objects: list[tuple[str, str]], now: float) -> bool:
    """Plan deleting an uncommitted checkpoint untouched for the grace period; False when it may be a running save."""
    # An object whose name carries no attempt (a leftover of a killed save, a stray file) is no claim.
    committing = sorted(
        a for path, a in objects if a and path == layout.claim_path(a) and holder(checkpoint, a) == BY_COMMIT
    )
    if committing:
        reason = (
            f"attempt(s) {', '.join(committing)} claimed by their commit: committing now, or a commit that crashed "
            "while committing (remove it by hand once no save of it runs)"
        )
        plan.skipped.append(Skipped(name, reason))
        return False
    # An attempt a collector claimed can never commit (SPEC 14): what an interrupted gc left of it goes at once.
    collected = {
        a for path, a in objects if a and path == layout.claim_path(a) and holder(checkpoint, a) == BY_COLLECTOR
    }
    ages = [_age(checkpoint, path, now) for path, attempt in objects if attempt not in collected]
    youngest = math.nan if any(math.isnan(age) for age in ages) else min(ages, default=math.inf)
    if not youngest >= plan.grace:
        when = "of unknown age" if math.isnan(youngest) else f"modified {youngest:.0f} s ago"
        reason = f"not committed, but an object is {when}: a save may be running (grace {plan.grace:g} s)"
        plan.skipped.append(Skipped(name, reason))
        return False
    reason = (
        f"never committed; nothing in it changed for {youngest:.0f} s (a failed save)"
        if math.isfinite(youngest)
        else "never committed; a collection of it was interrupted"
    )
    objects_sized = _sized(checkpoint, [path for path, _ in objects])
    listed = {path for path, _ in objects}
    attempts = sorted({attempt for _, attempt in objects} - {""})
    # The collector's claims, created before the first deletion and deleted last (planned, so a dry run shows them).
    objects_sized += [
        Doomed(layout.claim_path(a), len(BY_COLLECTOR)) for a in attempts if layout.claim_path(a) not in listed
    ]
    plan.actions.append(Action(name, "incomplete", reason, objects_sized, list(DIRECTORIES)))
    return True


def _plan_uploads(plan: GcPlan, root: Storage, listing: Listing, now: float) -> None:
    """Abort the unfinished uploads of layout objects under ROOT that no part reached for the grace period (a save
    that still uploads adds parts; one paused longer fails on its next part, typed, and never commits)."""
    not_owned = {entry.name for entry in listing.entries if entry.not_owned is not None}
    by_checkpoint: dict[str, list[Doomed]] = {}
    young: dict[str, int] = {}
    try:
        uploads = root.unfinished_uploads()
    except ShardckptError as exc:  # a store without ListMultipartUploads: the rest of gc still runs
        plan.skipped.append(Skipped("(unfinished uploads)", f"not listed: {exc}"))
        return
    for upload in uploads:
        name, _, path = upload.path.partition("/")
        try:
            attempt_of(path)  # a name the layout gives, in a directory directly under ROOT: else not ours
        except ShardckptError:
            continue
        if not name or name in not_owned:
            continue
        age = math.nan if upload.modified is None else now - upload.modified
        if not age >= plan.grace:
            young[name] = young.get(name, 0) + 1
            continue
        by_checkpoint.setdefault(name, []).append(Doomed(path, upload.size, upload))
    for name, count in sorted(young.items()):
        plan.skipped.append(Skipped(name, f"{count} unfinished upload(s) with a part within the grace period"))
    for name, doomed in sorted(by_checkpoint.items()):
        reason = "unfinished uploads of a killed save: never objects, but stored and billed"
        plan.actions.append(Action(name, "uploads", reason, doomed))


def _references_in_progress(checkpoint: Storage, objects: list[tuple[str, str]]) -> set[str]:
    """The checkpoints named by the references of the global manifests a save in progress has written (before its
    COMMITTED: SPEC 14 rule 3 keeps them); FormatError for a manifest that cannot be decoded."""
    names: set[str] = set()
    for path, _ in objects:
        if "/" in path or not path.startswith("manifest-"):
            continue
        raw = checkpoint.read_small(path, limits.MAX_GLOBAL_MANIFEST_BYTES)
        manifest = decode_global_manifest(raw, checkpoint.describe(path))
        names |= {entry.file.target.checkpoint for entry in manifest.references}
    return names


def _plan_skeleton(plan: GcPlan, name: str, checkpoint: Storage, now: float) -> None:
    """A directory holding nothing but empty data/ and ranks/ (what a crash in the middle of gc leaves)."""
    entries = checkpoint.list()
    layout_dirs = [d for d in (layout.RANKS_DIR, layout.DATA_DIR) if d in entries]
    if not layout_dirs or set(entries) - set(layout_dirs) or any(checkpoint.list(d) for d in layout_dirs):
        return  # not ours, or not empty
    ages = [_age(checkpoint, d, now) for d in layout_dirs]
    if any(math.isnan(age) for age in ages) or min(ages) < plan.grace:
        plan.skipped.append(Skipped(name, f"empty checkpoint directories, modified within the grace {plan.grace:g} s"))
        return
    reason = "empty directories of a checkpoint whose files are gone"
    plan.actions.append(Action(name, "incomplete", reason, [], [*layout_dirs, ""]))


def _plan_leftovers(plan: GcPlan, name: str, checkpoint: Storage, stale: list[tuple[str, str]], now: float) -> None:
    old = [path for path, _ in stale if _age(checkpoint, path, now) >= plan.grace]
    if len(old) < len(stale):
        plan.skipped.append(Skipped(name, f"{len(stale) - len(old)} leftover object(s) younger than the grace period"))
    if old:
        attempts = sorted({attempt for path, attempt in stale if path in old and attempt})
        reason = f"files of failed or superseded attempts {', '.join(attempts) or '(temporary markers)'}"
        plan.actions.append(Action(name, "leftovers", reason, _sized(checkpoint, old)))


def _age(storage: Storage, path: str, now: float) -> float:
    """Seconds since `path` was modified: NaN when the backend cannot tell, infinity when it is gone already."""
    try:
        stamp = storage.modified(path)
    except NotFoundError:
        return math.inf
    return math.nan if stamp is None else now - stamp


def _size(storage: Storage, path: str) -> int:
    try:
        return storage.size(path)
    except NotFoundError:
        return 0


def _sized(storage: Storage, paths: list[str]) -> list[Doomed]:
    return [Doomed(path, _size(storage, path)) for path in paths]
