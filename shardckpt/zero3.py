"""One call to save or load a DeepSpeed ZeRO-3 engine: shardckpt.save / load over its DeepSpeedZero3 state.

Checkpoints interchange with the FSDP2 loop's and load on any world size; see integrations/deepspeed.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardckpt import api
from shardckpt.errors import ShardckptUsageError
from shardckpt.format.manifest import GlobalManifest
from shardckpt.statedict.deepspeed import OPTIONAL_ON_LOAD, DeepSpeedZero3
from shardckpt.read.checkpoint import ReadStats


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
    state = DeepSpeedZero3(engine).state_dict()
    if client_state:
        clash = sorted(set(client_state) & set(state))
        if clash:
            raise ShardckptUsageError(f"client_state keys {clash} clash with the engine's own entries")
        state.update(client_state)
    return api.save(state, url, step=engine.global_steps if step is None else step, **save_options)


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
    adapter = DeepSpeedZero3(engine)
    state = adapter.load_state(optimizer=load_optimizer_states)
    if client_state:
        state.update(client_state)
    stats = api.load(state, url, optional=OPTIONAL_ON_LOAD, **load_options)
    adapter.finish_load(state)
    if client_state:
        client_state.update({key: state[key] for key in client_state})
    return stats
