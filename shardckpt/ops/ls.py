"""What `shardckpt ls` shows: every checkpoint directly under a root with its status, step, ranks, size and time.

Built on catalog.list_root, so ls, du, gc, retention and latest() agree on what is a checkpoint and which is newest.
"""

from __future__ import annotations

from typing import Any

from shardckpt.catalog.chain import (
    DCP,
    DEEPSPEED,
    EMPTY,
    MAX_CHILDREN_LOOKED_AT,
    MISSING,
    does_not_exist,
    read_global_manifest,
    what_is,
)
from shardckpt.catalog.listing import ALIAS, BROKEN, COMMITTED, INCOMPLETE, Listing, list_root
from shardckpt.catalog.local_tier import LOCAL_NAME
from shardckpt.errors import ShardckptError
from shardckpt.format import layout
from shardckpt.ops.local_tier import describe_copy, is_local_copy
from shardckpt.storage import Storage


def list_checkpoints(root_url: str | Storage, *, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """{"root": url, "checkpoints": [row, ...]}, oldest first in the one newest order (committed ones by step,
    commit time and name; the others after them by name). Rows: name, url, status and what the status tells.
    With no checkpoint under the root, "note" says what the root is instead; NotFoundError when nothing is there."""
    listing = list_root(root_url, storage_options=storage_options)
    rows = []
    for entry in listing.entries:
        status = entry.status(listing.root)
        if status is None:
            continue  # not a checkpoint
        row: dict[str, Any] = {"name": entry.name, "url": entry.url, "status": status}
        if status == BROKEN:
            row["error"] = entry.error
        if status in (COMMITTED, ALIAS) and entry.marker is not None:
            marker = entry.marker
            row.update(step=marker.step, bytes=marker.total_bytes, created=marker.created, world_size=marker.world_size)
            if marker.references:  # an incremental checkpoint: where its pieces stored by reference are
                row["parents"] = [name for name, _ in marker.references]
                missing = [name for name, attempt in marker.references if not _holds(listing, name, attempt)]
                if missing:
                    row["missing_parents"] = missing
        if status == ALIAS:
            row["alias_of"] = entry.alias_of
        if status == INCOMPLETE:
            row["bytes"] = _data_bytes(listing.root.child(entry.name))
        rows.append(row)
    keys = {entry.name: entry.key for entry in listing.committed()}

    def order(row: dict[str, Any]) -> tuple[int, Any, str]:
        target = row.get("alias_of") or row["name"]
        return (0, keys[target], row["name"]) if target in keys else (1, (), row["name"])

    rows.sort(key=order)
    result: dict[str, Any] = {"root": listing.root.url, "checkpoints": rows}
    if _local_tier(listing, rows):
        result["local_tier"] = True
    if not rows:
        result["note"] = _why_empty(listing.root)
    else:
        foreign = _foreign_children(listing.root, {row["name"] for row in rows})
        if foreign:
            result["note"] = f"{listing.root.url} also holds {foreign}"
    return result


def _local_tier(listing: Listing, rows: list[dict[str, Any]]) -> bool:
    """Whether the root is a node's local tier (its newest committed checkpoint is a local copy); if so, each
    committed row gains "local": what ops.local_tier.describe_copy says. Roots of persistent checkpoints named
    step-N (no attempt suffix) cost no read."""
    committed = [row for row in rows if row["status"] == COMMITTED]
    if not committed or not LOCAL_NAME.fullmatch(committed[-1]["name"]):
        return False
    found = False
    for row in reversed(committed):
        entry = listing.entry(row["name"])
        assert entry is not None and entry.marker is not None
        checkpoint = listing.root.child(row["name"])
        try:
            manifest = read_global_manifest(checkpoint, entry.marker)
        except ShardckptError as exc:
            if found:
                row["local"] = {"error": str(exc)}
            continue
        if not is_local_copy(manifest):
            if not found:
                return False  # the newest readable one is a persistent checkpoint: not a local tier
            continue
        found = True
        row["local"] = describe_copy(checkpoint, manifest)
    return found


def _holds(listing: Listing, name: str, attempt: str) -> bool:
    """Whether the root holds checkpoint `name` committed by `attempt` (what a reference to it needs)."""
    entry = listing.entry(name)
    return entry is not None and entry.marker is not None and entry.marker.attempt == attempt


IMPORTS = {DCP: ("PyTorch DCP", "import-dcp"), DEEPSPEED: ("DeepSpeed", "import-deepspeed")}


def _foreign_children(root: Storage, skip: set[str]) -> str | None:
    """The children of `root` that are other frameworks' checkpoints (DCP, DeepSpeed), said with the command
    that converts one; None when there are none. Looks at the first MAX_CHILDREN_LOOKED_AT names only."""
    found: dict[str, list[str]] = {}
    for name in root.list()[:MAX_CHILDREN_LOOKED_AT]:
        if name in skip:
            continue
        try:
            kind = what_is(root.child(name)).kind
        except ShardckptError:
            continue  # unreadable or gone: ls shows what it can
        if kind in IMPORTS:
            found.setdefault(kind, []).append(name)
    said = []
    for kind, names in found.items():
        framework, command = IMPORTS[kind]
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        example = root.child(names[-1]).url
        said.append(
            f"{len(names)} {framework} checkpoint(s) ({shown}), not shardckpt ones: convert one with "
            f"`shardckpt {command} {example} NEW_URL`"
        )
    return "; ".join(said) or None


def _why_empty(root: Storage) -> str:
    """What a root without checkpoints is, and what to do instead (NotFoundError when it does not exist)."""
    place = what_is(root)
    url = root.url
    if place.kind == MISSING:
        raise does_not_exist(url)
    if place.kind == EMPTY:
        return f"no checkpoints: {url} is empty"
    if place.kind == DCP:
        return f"no checkpoints: {url} is a PyTorch DCP checkpoint (convert it with `shardckpt import-dcp`)"
    if place.kind == DEEPSPEED:
        return f"no checkpoints: {url} is a DeepSpeed save directory (convert it with `shardckpt import-deepspeed`)"
    if place.kind in (COMMITTED, INCOMPLETE, BROKEN):
        return f"no checkpoints under {url}: it is a checkpoint itself ({place.kind}; see `shardckpt inspect {url}`)"
    foreign = _foreign_children(root, set())
    if foreign:
        return f"no shardckpt checkpoints under {url}: it holds {foreign}"
    return f"no checkpoints under {url}"


def _data_bytes(checkpoint: Storage) -> int:
    total = 0
    for data in checkpoint.list(layout.DATA_DIR):
        try:
            total += checkpoint.size(f"{layout.DATA_DIR}/{data}")
        except ShardckptError:
            continue  # deleted while we looked
    return total
