"""What training loops call: save, load, latest, and save_deepspeed / load_deepspeed for DeepSpeed ZeRO-3 engines.

save and load are collective over a process group (or run in one process); see distributed/protocol.py.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from shardckpt import knobs
from shardckpt.catalog import list_root
from shardckpt.distributed import protocol
from shardckpt.errors import ShardckptUsageError
from shardckpt.format.manifest import GlobalManifest
from shardckpt.read.checkpoint import DEFAULT_MAX_IN_FLIGHT, Checkpoint, ReadStats
from shardckpt.storage import Storage


def save(
    state_dict: Mapping[str, Any],
    url: str | Storage,
    *,
    process_group: Any = None,
    coordinator: int = 0,
    storage_options: dict[str, Any] | None = None,
    step: int | None = None,
    metadata: dict[str, Any] | None = None,
    block_size: int = knobs.BLOCK_SIZE,
) -> GlobalManifest:
    """Save `state_dict` as a committed checkpoint at `url` (a new location); collective over the group.

    Every rank writes its own pieces: DTensor shards, its share of replicated tensors, FlatPartition slices.
    Plain values are shared (all ranks must agree); wrap a value in PerRank to keep one per rank. Returns when
    the checkpoint is durable and committed; on any failure every rank raises the same DistributedError.
    process_group: the group to save over; default: the default group if torch.distributed is initialized.
    """
    return protocol.save(
        state_dict,
        url,
        process_group=process_group,
        coordinator=coordinator,
        storage_options=storage_options,
        step=step,
        metadata=metadata,
        block_size=block_size,
    )


def load(
    state_dict: Mapping[str, Any],
    url: str | Storage,
    *,
    process_group: Any = None,
    coordinator: int = 0,
    storage_options: dict[str, Any] | None = None,
    strict: bool = True,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    verify_first: bool = False,
    optional: Sequence[str] = (),
    max_gap: int = knobs.MAX_GAP,
) -> ReadStats:
    """Fill the tensors of `state_dict` in place from the checkpoint at `url`, on any world size and sharding.

    Each rank reads only the boxes its tensors hold (DTensor shards are filled through their local tensor)
    and restores plain values (PerRank values: its own). strict: every entry must be in the checkpoint.

    After a failed load (a ShardckptError; DistributedError over a group) the caller's state holds:
    - nothing new, when the failure is in what every rank checks before it writes a byte: COMMITTED, the global
      and local manifests (checksums, sizes, decoding), coverage, a missing entry (strict), a destination of the
      wrong shape or dtype;
    - when data bytes fail (a block checksum, a short read, a missing or unreadable data file): plain values
      untouched, and each destination element either its old value or its value in the checkpoint, never any
      other (a block is copied only after its checksum matched), but which elements were written is unspecified:
      a tensor may be partly written. GPU destinations are filled from host staging only at the end: untouched.
    - verify_first=True: nothing new at all. Every rank fetches and verifies every byte it needs, the ranks agree
      that all succeeded, and only then are destinations and plain values written. Costs memory: the fetched
      bytes (about the size of the rank's destinations) are held until then, whatever max_in_flight says.
    Over a group without verify_first, a rank whose own reads succeeded has written all of its tensors and values
    even when another rank failed.
    optional: entry names (or prefixes before a '.') that strict lets the checkpoint lack; such entries keep
    their values (e.g. another engine's counters when a checkpoint crosses from FSDP2 to DeepSpeed).
    max_gap: bytes between two needed ranges of a file read through rather than split into two requests.
    """
    return protocol.load(
        state_dict,
        url,
        process_group=process_group,
        coordinator=coordinator,
        storage_options=storage_options,
        strict=strict,
        max_in_flight=max_in_flight,
        verify_first=verify_first,
        optional=optional,
        max_gap=max_gap,
    )


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
