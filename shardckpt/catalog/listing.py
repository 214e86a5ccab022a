"""The checkpoints directly under a root and which one is the newest: one listing, one ordering, for every caller.

A link to a checkpoint of the same root is an alias of it, never a second checkpoint. Only plain directories of the
root (with plain data/ and ranks/) are ever entered for deletion: never a link, wherever it points.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from shardckpt.catalog.chain import BROKEN, COMMITTED, INCOMPLETE, classify, read_commit_marker
from shardckpt.errors import ShardckptError, ShardckptUsageError
from shardckpt.format import layout, limits
from shardckpt.format.manifest import CommitMarker, decode_global_manifest
from shardckpt.storage import LocalStorage, Storage, open_storage

OrderKey = tuple[bool, int, float, str]
ALIAS = "alias"
__all__ = [
    "ALIAS",
    "BROKEN",
    "COMMITTED",
    "INCOMPLETE",
    "Entry",
    "Listing",
    "classify",
    "list_root",
    "local_path",
    "not_owned_reason",
    "order_key",
]


def order_key(marker: CommitMarker, name: str) -> OrderKey:
    """Sort key of a committed checkpoint named `name`: the greatest is the newest.

    A known step beats an unknown one, then the higher step, then the later commit time; the name breaks the last
    ties, so that latest(), retention, gc and ls all call the same checkpoint the newest.
    """
    return (marker.step is not None, marker.step or 0, marker.created, name)


@dataclass(frozen=True)
class Entry:
    """One name directly under the root, as far as checkpoints go."""

    name: str
    url: str
    marker: CommitMarker | None = None  # None: not committed, or COMMITTED unreadable (then `error` says why)
    error: str | None = None
    alias_of: str | None = None  # a link to the checkpoint of this root with that name: the same checkpoint
    not_owned: str | None = None  # why deletion never enters it (a link, data/ or ranks/ a link); None: a plain dir

    @property
    def owned(self) -> bool:
        return self.not_owned is None

    def status(self, root: Storage) -> str | None:
        """committed, broken, incomplete, alias (a link to a checkpoint of this root) or None (not a checkpoint);
        lists the directory only when its marker leaves the question open."""
        if self.alias_of is not None:
            return ALIAS
        if self.marker is not None or self.error is not None:
            return classify((), self.marker is not None, self.error is not None)
        return classify(root.child(self.name).list(), False, False)

    @property
    def key(self) -> OrderKey:
        if self.marker is None:
            raise ShardckptUsageError(f"{self.url} is not committed: it has no place in the order of checkpoints")
        return order_key(self.marker, self.name)


@dataclass(frozen=True)
class Listing:
    root: Storage
    entries: tuple[Entry, ...]

    def entry(self, name: str) -> Entry | None:
        return next((entry for entry in self.entries if entry.name == name), None)

    def canonical(self, name: str) -> str:
        """The listed checkpoint that ROOT/name is, however a reference or a caller spelled it: the name itself, the
        checkpoint an alias links to, or on local disk the listed name of the same directory (another case on a
        case-insensitive file system); the name itself when none is."""
        entry = self.entry(name)
        if entry is not None:
            return entry.alias_of or name
        base = local_path(self.root)
        if base is None or name in ("", ".", "..") or "/" in name or "\\" in name:
            return name
        try:
            wanted = os.stat(os.path.join(base, name))
        except OSError:
            return name
        for other in self.entries:
            if other.alias_of is None and other.owned:
                try:
                    if os.path.samestat(os.stat(os.path.join(base, other.name)), wanted):
                        return other.name
                except OSError:
                    continue
        return name

    def committed(self) -> list[Entry]:
        """Every committed checkpoint under the root once (aliases left out), oldest first."""
        found = [entry for entry in self.entries if entry.marker is not None and entry.alias_of is None]
        return sorted(found, key=lambda entry: entry.key)

    def newest(self) -> Entry | None:
        committed = self.committed()
        return committed[-1] if committed else None

    def to_prune(
        self,
        keep_last: int,
        *,
        keep: Collection[str] = (),
        grace: float = 0.0,
        now: float | None = None,
        pinned: Collection[str] = (),
    ) -> list[Entry]:
        """Committed checkpoints retention deletes to keep the newest `keep_last`, in the order to delete them.

        Only plain directories of the root count and go (a checkpoint behind a link is not this root's to delete);
        names in `keep` (the checkpoint just saved) stay whatever their place in the order. keep_last >= 1, so
        the newest committed checkpoint is never among them. Format 1.1 (SPEC 14): on a root whose checkpoints
        reference others (or with `pinned` names, which saves in progress reference), what kept checkpoints
        reference stays (kept_names), nothing goes while a COMMITTED is unreadable, and a referencing checkpoint
        goes before those it references (a crash between two deletions leaves every committed one whole).
        """
        if keep_last < 1:
            raise ShardckptUsageError(
                f"keep_last must be >= 1 (the newest checkpoint is never deleted), got {keep_last}"
            )
        owned = [entry for entry in self.committed() if entry.owned]
        keep = {self.canonical(name) for name in keep}
        candidates = [entry for entry in owned[: max(0, len(owned) - keep_last)] if entry.name not in keep]
        if not self.uses_references() and not pinned:
            return candidates  # format 1.0 roots: the policy alone decides
        if any(entry.error is not None for entry in self.entries):
            return []  # an unreadable COMMITTED may reference any of them: delete no committed checkpoint
        policy = {entry.name for entry in self.committed()} - {entry.name for entry in candidates} | set(pinned)
        kept = self.kept_names(policy, grace, now)
        return _referencing_first([entry for entry in candidates if entry.name not in kept], self.canonical)

    def uses_references(self) -> bool:
        """Whether a checkpoint of the root references others: its COMMITTED says so, or, where COMMITTED cannot be
        read, a global manifest in its directory does (or cannot be decoded to tell): the unreadable marker may be
        the only one of the root that would have said so (SPEC 14)."""
        return any(entry.marker is not None and entry.marker.references for entry in self.entries) or any(
            entry.error is not None and entry.owned and _may_reference(self.root.child(entry.name))
            for entry in self.entries
        )

    def kept_names(self, policy: Collection[str], grace: float = 0.0, now: float | None = None) -> set[str]:
        """SPEC 14's set K: the least set holding `policy`'s names, every committed checkpoint whose next newer one
        was created less than `grace` seconds before `now` (or that has none: a save in progress may have chosen it
        as its parent), and every checkpoint a COMMITTED of the set references."""
        committed = self.committed()
        now = time.time() if now is None else now
        kept = {self.canonical(name) for name in policy}  # a name spelled through an alias keeps its checkpoint
        for older, newer in zip(committed, [*committed[1:], None]):
            if newer is None or (newer.marker is not None and now - newer.marker.created < grace):
                kept.add(older.name)
        by_name = {entry.name: entry for entry in self.entries}
        # The attempt is the identity a spelling cannot fake: a reference through an alias that has moved on since
        # (or any other name that now lists another attempt) keeps the checkpoint that attempt committed.
        by_attempt = {entry.marker.attempt: entry.name for entry in committed if entry.marker is not None}
        todo = list(kept)
        while todo:
            entry = by_name.get(todo.pop())
            marker = entry.marker if entry is not None else None
            for spelled, attempt in marker.references if marker is not None else ():
                name = self.canonical(spelled)  # a reference spelled through an alias keeps the real checkpoint
                found = by_name.get(name)
                if found is None or found.marker is None or found.marker.attempt != attempt:
                    name = by_attempt.get(attempt, name)
                if name not in kept:
                    kept.add(name)
                    todo.append(name)
        return kept


def _may_reference(checkpoint: Storage) -> bool:
    """Whether a checkpoint whose COMMITTED cannot be read may reference others: one of its global manifests lists
    references, or cannot be read or decoded to tell."""
    try:
        names = [name for name in checkpoint.list() if name.startswith("manifest-") and name.endswith(".msgpack")]
        for name in names:
            raw = checkpoint.read_small(name, limits.MAX_GLOBAL_MANIFEST_BYTES)
            if decode_global_manifest(raw, checkpoint.describe(name)).references:
                return True
    except ShardckptError:
        return True
    return False


def _referencing_first(doomed: list[Entry], canonical: Callable[[str], str]) -> list[Entry]:
    """`doomed` ordered so that a checkpoint comes before every doomed checkpoint it references (oldest first
    otherwise): references point at checkpoints committed earlier, so there is no cycle to break."""
    left, ordered = list(doomed), []
    while left:
        referenced = {
            canonical(name) for entry in left if entry.marker is not None for name, _ in entry.marker.references
        }
        free = [entry for entry in left if entry.name not in referenced] or left[:1]  # a cycle: hostile markers
        ordered += free
        left = [entry for entry in left if entry not in free]
    return ordered


def list_root(root_url: str | Storage, *, storage_options: dict[str, Any] | None = None) -> Listing:
    """Every name directly under `root_url`, with its COMMITTED marker (read once per checkpoint) and ownership."""
    root = open_storage(root_url, storage_options)
    names = root.list()
    base = local_path(root)
    entries: list[Entry] = []
    for name in names:
        alias_of, not_owned = _links(base, name, names)
        if alias_of is not None:
            entries.append(Entry(name, root.child(name).url, alias_of=alias_of, not_owned=not_owned))
            continue
        child = root.child(name)
        try:
            marker, error = read_commit_marker(child), None
        except ShardckptError as exc:
            marker, error = None, str(exc)
        entries.append(Entry(name, child.url, marker, error, None, not_owned))
    by_name = {entry.name: entry for entry in entries}
    # An alias has its checkpoint's marker (read once, through the real name).
    resolved = [
        Entry(e.name, e.url, by_name[e.alias_of].marker, by_name[e.alias_of].error, e.alias_of, e.not_owned)
        if e.alias_of is not None
        else e
        for e in entries
    ]
    return Listing(root, tuple(resolved))


def not_owned_reason(root: Storage, name: str) -> str | None:
    """Why deletion must not enter ROOT/name (a link, or data/ or ranks/ a link; not a plain name); None if it may."""
    return _links(local_path(root), name, None)[1]


def local_path(storage: Storage) -> str | None:
    """The local directory behind `storage` (through wrappers such as FaultyStorage), None for other backends."""
    while not isinstance(storage, LocalStorage) and isinstance(getattr(storage, "inner", None), Storage):
        storage = storage.inner  # type: ignore[attr-defined]
    return storage.root if isinstance(storage, LocalStorage) else None


def _links(base: str | None, name: str, names: Collection[str] | None) -> tuple[str | None, str | None]:
    """(alias_of, not_owned reason) of ROOT/name; `names` (the root's listing) lets a link be an alias."""
    if name in ("", ".", "..") or "/" in name or "\\" in name:
        return None, f"{name!r} is not a plain name inside ROOT"
    if base is None:
        return None, None  # object stores have no links: every key listed under the prefix is inside it
    real_root = os.path.realpath(base)
    path = os.path.join(base, name)
    if os.path.islink(path):
        target = os.path.realpath(path)
        if target == os.path.join(real_root, name) or not os.path.exists(target):
            return None, f"a link that does not resolve (dangling, or a loop): {target}"
        if names is not None and os.path.dirname(target) == real_root and os.path.basename(target) in names:
            alias = os.path.basename(target)
            return alias, f"a link to {alias} (an alias of it): never deleted through"
        where = "elsewhere inside ROOT" if os.path.commonpath([real_root, target]) == real_root else "outside ROOT"
        return None, f"a link to {target} ({where}): never deleted through"
    if os.path.realpath(path) != os.path.join(real_root, name):
        return None, f"resolves to {os.path.realpath(path)}, not a plain directory of ROOT"
    for directory in (layout.DATA_DIR, layout.RANKS_DIR):
        inner = os.path.join(path, directory)
        if os.path.islink(inner) or os.path.realpath(inner) != os.path.join(real_root, name, directory):
            return None, f"its {directory}/ is a link to {os.path.realpath(inner)}: never deleted through"
    return None, None
