"""DCP-style Stateful entries: objects with state_dict() and load_state_dict() (an app state, a model, a dataloader).

Save stores what state_dict() returns under the entry's name; load fills a fresh state_dict() in place, then hands it
to load_state_dict(), as torch.distributed.checkpoint does, at any depth of dicts and lists.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from shardckpt.errors import ShardckptUsageError

_MAX_DEPTH = 64  # a state_dict() returning itself (or a cycle of Statefuls) is refused, not recursed into forever


def is_stateful(value: Any) -> bool:
    """An object the protocol of torch.distributed.checkpoint.stateful.Stateful describes (duck-typed, as DCP)."""
    if isinstance(value, (Mapping, list, tuple, str, bytes, torch.Tensor, type)):
        return False
    if getattr(value, "shardckpt_leaf", False):  # PerRank, FlatPartition: leaves of their own
        return False
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def saved_states(state: Mapping[str, Any]) -> Mapping[str, Any]:
    """`state` with every Stateful replaced by its state_dict() (copies of the containers on the way; the caller's
    own are not changed); `state` itself when it holds none."""
    resolved, _ = _resolve(state, "", [], 0)
    return resolved  # type: ignore[no-any-return]


def loadable_states(state: Mapping[str, Any]) -> tuple[Mapping[str, Any], Callable[[], None]]:
    """For a load: `state` with every Stateful replaced by a fresh state_dict() to fill, and what to call after a
    successful load: it hands each filled dict to its object's load_state_dict() (innermost first) and puts plain
    values restored beside them back into the caller's own dicts and lists."""
    finish: list[Callable[[], None]] = []
    resolved, _ = _resolve(state, "", finish, 0)

    def after() -> None:
        for step in finish:
            step()

    return resolved, after


def _resolve(value: Any, name: str, finish: list[Callable[[], None]], depth: int) -> tuple[Any, Any]:
    """(the value with its Statefuls resolved, what it came from: the Stateful object, True for a container that
    changed, None for a value left as it is)."""
    if depth > _MAX_DEPTH:
        raise ShardckptUsageError(f"entry {name or 'the root'!r}: Stateful objects nested more than {_MAX_DEPTH} deep")
    if is_stateful(value):
        inner = value.state_dict()
        if not isinstance(inner, Mapping):
            raise ShardckptUsageError(
                f"entry {name!r}: {type(value).__name__}.state_dict() returned a {type(inner).__name__}, not a dict"
            )
        resolved, _ = _resolve(inner, name, finish, depth + 1)
        return resolved, value
    if isinstance(value, Mapping):
        keys = list(value.keys())
        parts = [_resolve(value[key], f"{name}.{key}" if name else str(key), finish, depth + 1) for key in keys]
    elif isinstance(value, (list, tuple)):
        keys = list(range(len(value)))
        parts = [_resolve(item, f"{name}.{index}", finish, depth + 1) for index, item in enumerate(value)]
    else:
        return value, None
    if all(origin is None for _, origin in parts):
        return value, None
    copy: Any = dict(zip(keys, (part for part, _ in parts), strict=True)) if isinstance(value, Mapping) else None
    if copy is None:
        copy = [part for part, _ in parts]
    finish.append(_finisher(value, copy, keys, [origin for _, origin in parts]))
    return (tuple(copy) if isinstance(value, tuple) else copy), True


def _finisher(original: Any, copy: Any, keys: list[Any], origins: list[Any]) -> Callable[[], None]:
    """After a load: each Stateful gets what was loaded in its place (a plain state may have been replaced whole,
    so it is read from the copy then); plain values a load assigned into the copy reach the caller's dict or list."""
    writable = isinstance(original, (dict, list))

    def run() -> None:
        for key, origin in zip(keys, origins, strict=True):
            if origin is None and writable:
                original[key] = copy[key]
            elif origin is not None and origin is not True:
                origin.load_state_dict(copy[key])

    return run
