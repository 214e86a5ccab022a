"""Garbage collection under a root: committed checkpoints beyond keep_last, and leftovers of failed attempts.

Never deletes the newest committed checkpoint, a file of a committed attempt, a name the layout does not give,
anything modified within the grace period (it may belong to a save running now), or anything outside ROOT.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shardckpt.crashpoints import crash_point
from shardckpt.errors import FormatError, NotFoundError, ShardckptError, ShardckptUsageError
from shardckpt.format import layout
from shardckpt.restorer import read_commit_marker
from shardckpt.storage import LocalStorage, Storage, open_storage

DEFAULT_GRACE = 3600.0
TEMP_PREFIX = f"{layout.COMMITTED}.tmp-"  # the local commit's temporary marker (a crash can leave one behind)
# Deletion order inside a checkpoint: global manifests first, so a crash mid-way never leaves a manifest whose
# local manifests or data are gone while the manifest itself still looks committable; data last.
_ORDER = {"manifest": 0, "ranks": 1, "data": 2, "temp": 3}


@dataclass(frozen=True)
class Doomed:
    """One object to delete: `path` relative to its checkpoint directory, with its size in bytes."""

    path: str
    size: int


@dataclass
class Action:
    """What gc does to one checkpoint directory (`checkpoint`, a name directly under ROOT).

    kind: "prune" (a committed checkpoint beyond keep_last: COMMITTED first, then everything the layout names),
    "incomplete" (never committed, untouched for longer than the grace period: everything the layout names), or
    "leftovers" (files of failed attempts inside a committed checkpoint; the committed attempt is never touched).
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
    now = time.time() if now is None else now
    plan = GcPlan(root, grace, keep_last)
    committed: list[tuple[tuple[bool, int, float], str]] = []
    for name in root.list():
        if name in (".", "..") or "/" in name or "\\" in name or _escapes(root, name):
            plan.skipped.append(Skipped(name, "not a plain directory inside ROOT (a link elsewhere?)"))
            continue
        checkpoint = root.child(name)
        try:
            marker = read_commit_marker(checkpoint)
        except ShardckptError as exc:
            reason = f"unreadable {layout.COMMITTED} marker, left for a person to judge: {exc}"
            plan.skipped.append(Skipped(name, reason))
            continue
        objects = _layout_objects(checkpoint)
        if marker is None:
            if objects:
                _plan_incomplete(plan, name, checkpoint, objects, now)
            else:
                _plan_skeleton(plan, name, checkpoint, now)
            continue
        committed.append(((marker.step is not None, marker.step or 0, marker.created), name))
        stale = [(path, attempt) for path, attempt in objects if attempt != marker.attempt]
        if stale:
            _plan_leftovers(plan, name, checkpoint, stale, now)
    committed.sort()
    doomed = committed[: max(0, len(committed) - keep_last)] if keep_last is not None else []
    pruned = {name for _, name in doomed}
    plan.actions = [action for action in plan.actions if action.checkpoint not in pruned]  # pruning covers them
    plan.skipped = [skipped for skipped in plan.skipped if skipped.checkpoint not in pruned]
    for _, name in doomed:
        checkpoint = root.child(name)
        marker_object = Doomed(layout.COMMITTED, _size(checkpoint, layout.COMMITTED))
        doomed_objects = [marker_object, *_sized(checkpoint, [path for path, _ in _layout_objects(checkpoint)])]
        reason = f"committed, older than the newest {keep_last}"
        plan.actions.append(Action(name, "prune", reason, doomed_objects, [layout.RANKS_DIR, layout.DATA_DIR, ""]))
    plan.kept = [name for _, name in committed if name not in pruned]
    return plan


def collect(plan: GcPlan, progress: Callable[[Action, Doomed], None] | None = None) -> GcPlan:
    """Carry out `plan` (from plan_gc): delete its objects in order; returns the plan with what was done.

    An action that fails records its error and the others go on. A crash at any point leaves every committed
    checkpoint that is not being pruned intact, and a pruned one without COMMITTED (a reader sees it as gone).
    """
    for action in plan.actions:
        checkpoint = plan.storage.child(action.checkpoint)
        try:
            if action.kind == "incomplete" and read_commit_marker(checkpoint) is not None:
                action.note = "committed while gc ran: left alone"
                continue
            for doomed in action.objects:
                checkpoint.delete(doomed.path)
                action.deleted += 1
                crash_point("during_gc")
                if progress is not None:
                    progress(action, doomed)
            for directory in action.directories:
                if not checkpoint.list(directory):
                    checkpoint.delete(directory)
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


# --------------------------------------------------------------------------------------------- planning


def _plan_incomplete(plan: GcPlan, name: str, checkpoint: Storage, objects: list[tuple[str, str]], now: float) -> None:
    ages = [_age(checkpoint, path, now) for path, _ in objects]
    youngest = math.nan if any(math.isnan(age) for age in ages) else min(ages)
    if not youngest >= plan.grace:
        when = "of unknown age" if math.isnan(youngest) else f"modified {youngest:.0f} s ago"
        reason = f"not committed, but an object is {when}: a save may be running (grace {plan.grace:g} s)"
        plan.skipped.append(Skipped(name, reason))
        return
    reason = f"never committed; nothing in it changed for {youngest:.0f} s (a failed save)"
    directories = [layout.RANKS_DIR, layout.DATA_DIR, ""]
    plan.actions.append(Action(name, "incomplete", reason, _sized(checkpoint, [p for p, _ in objects]), directories))


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
        reason = f"files of failed attempts {', '.join(attempts) or '(temporary markers)'}"
        plan.actions.append(Action(name, "leftovers", reason, _sized(checkpoint, old)))


def _layout_objects(checkpoint: Storage) -> list[tuple[str, str]]:
    """(path, attempt) of every object in a checkpoint directory that the layout names, COMMITTED excepted.

    Temporary commit markers have attempt "" (they belong to no attempt). Anything else is not ours: never listed.
    """
    found: list[tuple[str, str]] = []
    for name in checkpoint.list():
        if name.startswith(TEMP_PREFIX):
            found.append((name, ""))
            continue
        try:
            found.append((name, layout.parse_global_manifest_path(name)))
        except FormatError:
            continue
    parsers = ((layout.RANKS_DIR, layout.parse_local_manifest_path), (layout.DATA_DIR, layout.parse_data_path))
    for directory, parse in parsers:
        for name in checkpoint.list(directory):
            path = f"{directory}/{name}"
            try:
                found.append((path, parse(path)[1]))
            except FormatError:
                continue
    return sorted(found, key=lambda item: (_ORDER[_kind(item[0])], item[0]))


def _kind(path: str) -> str:
    if path.startswith(TEMP_PREFIX):
        return "temp"
    return path.split("/", 1)[0] if "/" in path else "manifest"


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


def _escapes(root: Storage, name: str) -> bool:
    """True when ROOT/name, or its data/ or ranks/ directory, resolves outside ROOT (local links)."""
    base = _local_root(root)
    if base is None:
        return False  # object stores have no links: every key listed under the prefix is inside it
    real_root = os.path.realpath(base)
    for relative in (name, os.path.join(name, layout.DATA_DIR), os.path.join(name, layout.RANKS_DIR)):
        target = os.path.realpath(os.path.join(base, relative))
        if os.path.commonpath([real_root, target]) != real_root or target == real_root:
            return True
    return False


def _local_root(storage: Storage) -> str | None:
    while not isinstance(storage, LocalStorage) and isinstance(getattr(storage, "inner", None), Storage):
        storage = storage.inner  # type: ignore[attr-defined]
    return storage.root if isinstance(storage, LocalStorage) else None
