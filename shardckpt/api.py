"""What training loops call: save, load, latest, and save_deepspeed / load_deepspeed for DeepSpeed ZeRO-3 engines.

save and load are collective over a process group (or run in one process); see distributed/protocol.py.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from shardckpt.catalog import Listing, list_root
from shardckpt.distributed.protocol import load, save
from shardckpt.errors import ShardckptUsageError
from shardckpt.format.manifest import GlobalManifest
from shardckpt.read.checkpoint import Checkpoint, ReadStats
from shardckpt.storage import Storage


class NoCheckpointWarning(UserWarning):
    """latest() found no committed checkpoint under a root: a job that resumes from it starts from scratch. Said out
    loud because a mistyped root looks exactly like a new one (filter this warning where a fresh root is expected)."""


def latest(root_url: str | Storage, *, storage_options: dict[str, Any] | None = None) -> str | None:
    """URL of the newest committed checkpoint directly under `root_url`, or None (with a NoCheckpointWarning that
    names the root and says whether it does not exist, is empty, or holds no committed checkpoint).

    Newest by shardckpt.catalog.order_key (step, then commit time, then name), the order retention and gc keep by.
    A link to a checkpoint of the same root is that checkpoint: the URL returned is the checkpoint's own, never
    the link's. A checkpoint whose COMMITTED cannot be read is skipped with a warning.
    """
    listing = list_root(root_url, storage_options=storage_options)
    for entry in listing.entries:
        if entry.error is not None and entry.alias_of is None:
            warnings.warn(f"skipping {entry.url}: {entry.error}", stacklevel=2)
    newest = listing.newest()
    if newest is None:
        warnings.warn(_nothing_under(listing), NoCheckpointWarning, stacklevel=2)
        return None
    return newest.url


def _nothing_under(listing: Listing) -> str:
    root = listing.root
    if listing.entries:
        why = f"it holds {len(listing.entries)} name(s), none a committed checkpoint (`shardckpt ls {root.url}`)"
    elif root.exists(""):
        why = "it is empty"
    else:
        why = "it does not exist (check the path or URL for a typo)"
    return f"no committed checkpoint under {root.url}: {why}; a job resuming from it starts from scratch"


def save_deepspeed(
    engine: Any,
    url: str,
    *,
    client_state: Mapping[str, Any] | None = None,
    step: int | None = None,
    **save_options: Any,
) -> GlobalManifest:
    """Save a ZeRO-3 engine (and `client_state`, e.g. data position, PerRank RNG) as a committed checkpoint.

    Collective over the default group; each rank writes only its partition. step: default engine.global_steps.
    """
    from shardckpt.statedict.deepspeed import DeepSpeedZero3

    state = DeepSpeedZero3(engine).state_dict()
    if client_state:
        clash = sorted(set(client_state) & set(state))
        if clash:
            raise ShardckptUsageError(f"client_state keys {clash} clash with the engine's own entries")
        state.update(client_state)
    return save(state, url, step=engine.global_steps if step is None else step, **save_options)


def load_deepspeed(
    engine: Any,
    url: str,
    *,
    client_state: dict[str, Any] | None = None,
    load_optimizer_states: bool = True,
    **load_options: Any,
) -> ReadStats:
    """Load a checkpoint (from any world size, or from the FSDP2 loop) into a ZeRO-3 engine, in place.

    Each rank reads only the bytes of its own partitions. client_state: entries to fill in place as well.
    load_optimizer_states=False: weights (and counters) only, as for a fine-tuning start.
    On a failed load (a ShardckptError) the engine's fp32 master partitions may be partly written (see
    shardckpt.load) and its parameters are not updated: load again or rebuild the engine.
    """
    from shardckpt.statedict.deepspeed import OPTIONAL_ON_LOAD, DeepSpeedZero3

    adapter = DeepSpeedZero3(engine)
    state = adapter.load_state(optimizer=load_optimizer_states)
    if client_state:
        state.update(client_state)
    stats = load(state, url, optional=OPTIONAL_ON_LOAD, **load_options)
    adapter.finish_load(state)
    if client_state:
        client_state.update({key: state[key] for key in client_state})
    return stats


__all__ = ["Checkpoint", "latest", "load", "load_deepspeed", "save", "save_deepspeed"]
