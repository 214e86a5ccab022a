"""Retention: keep the newest N committed checkpoints under a root (and the one just saved), delete older ones.

Which ones go is catalog.Listing.to_prune and how they go is catalog.delete_objects, the rules gc follows too: the
newest is never deleted, nor anything behind a link, outside the root, or not named by the layout.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from shardckpt.catalog import Entry, checkpoint_objects, delete_objects, list_root
from shardckpt.catalog.listing import OrderKey
from shardckpt.crashpoints import check_crash_at, crash_point
from shardckpt.format import layout
from shardckpt.storage import Storage


def committed_checkpoints(root: Storage) -> list[tuple[OrderKey, str]]:
    """(sort key, name) of every committed checkpoint directly under `root` once (aliases left out), oldest first."""
    return [(entry.key, entry.name) for entry in list_root(root).committed()]


def delete_checkpoint(root: Storage, name: str) -> None:
    """Delete the committed checkpoint ROOT/name: COMMITTED first, then every file the layout names, then its
    directories when empty (SPEC section 14)."""
    check_crash_at()  # a misspelt point would be refused only once COMMITTED is gone

    def after(path: str) -> None:
        if path == layout.COMMITTED:
            crash_point("during_retention")

    delete_objects(root, name, checkpoint_objects(root.child(name)), after_each=after)


@dataclass(frozen=True)
class Retained:
    """What retention did: the names it deleted, and the newest committed checkpoint under the root."""

    deleted: list[str]
    newest: Entry | None


def retain(root: Storage, keep_last: int, *, keep: Collection[str] = ()) -> Retained:
    """Delete all but the newest `keep_last` committed checkpoints under `root`, never one named in `keep`."""
    listing = list_root(root)
    doomed = listing.to_prune(keep_last, keep=keep)
    for entry in doomed:
        delete_checkpoint(root, entry.name)
    return Retained([entry.name for entry in doomed], listing.newest())


def prune(root: Storage, keep_last: int, *, keep: Collection[str] = ()) -> list[str]:
    """Delete all but the newest `keep_last` committed checkpoints under `root` (and those in `keep`); the names
    deleted."""
    return retain(root, keep_last, keep=keep).deleted
