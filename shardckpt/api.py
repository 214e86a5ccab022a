"""What training loops call: save, load, latest, and save_deepspeed / load_deepspeed for DeepSpeed ZeRO-3 engines.

save and load are collective over a process group (or run in one process); see distributed/protocol.py.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from shardckpt.catalog import list_root
from shardckpt.distributed.protocol import load, save
from shardckpt.errors import ShardckptUsageError
from shardckpt.format.manifest import GlobalManifest
from shardckpt.read.checkpoint import Checkpoint, ReadStats
from shardckpt.storage import Storage


def latest(root_url: str | Storage, *, storage_options: dict[str, Any] | None = None) -> str | None:
    """URL of the newest committed checkpoint directly under `root_url`, or None.

    Newest by shardckpt.catalog.order_key (step, then commit time, then name), the order retention and gc keep by.
    A link to a checkpoint of the same root is that checkpoint: the URL returned is the checkpoint's own, never
    the link's. A checkpoint whose COMMITTED cannot be read is skipped with a warning.
    """
    listing = list_root(root_url, storage_options=storage_options)
    for entry in listing.entries:
        if entry.error is not None and entry.alias_of is None:
            warnings.warn(f"skipping {entry.url}: {entry.error}", stacklevel=2)
    newest = listing.newest()
    return None if newest is None else newest.url


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
