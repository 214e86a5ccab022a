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
    resolved, _ = _resolve(state, "", [], 0, (), [])
    return resolved  # type: ignore[no-any-return]


def loadable_states(state: Mapping[str, Any]) -> tuple[Mapping[str, Any], Callable[[], None]]:
    """For a load: `state` with every Stateful replaced by a fresh state_dict() to fill, and what to call after a
    successful load: it hands each filled dict to its object's load_state_dict() (innermost first) and puts plain
    values restored beside them back into the caller's own dicts and lists."""
    finish: list[Callable[[], None]] = []
    root: list[Any] = []
    resolved, _ = _resolve(state, "", finish, 0, (), root)
    root.append(resolved)

    def after() -> None:
        for step in finish:
            step()

    return resolved, after


def _resolve(
    value: Any, name: str, finish: list[Callable[[], None]], depth: int, path: tuple[Any, ...], root: list[Any]
) -> tuple[Any, Any]:
    """(the value with its Statefuls resolved, what it came from: the Stateful object, True for a container that
    changed, None for a value left as it is). path: where the value sits under the resolved root (root[0], once
    resolved), which is where a finisher finds it after the load."""
    if depth > _MAX_DEPTH:
        raise ShardckptUsageError(f"entry {name or 'the root'!r}: Stateful objects nested more than {_MAX_DEPTH} deep")
    if is_stateful(value):
        inner = value.state_dict()
        if not isinstance(inner, Mapping):
            raise ShardckptUsageError(
                f"entry {name!r}: {type(value).__name__}.state_dict() returned a {type(inner).__name__}, not a dict"
            )
        resolved, _ = _resolve(inner, name, finish, depth + 1, path, root)
        return resolved, value
    if isinstance(value, Mapping):
        keys = list(value.keys())
        parts = [
            _resolve(value[key], f"{name}.{key}" if name else str(key), finish, depth + 1, (*path, key), root)
            for key in keys
        ]
    elif isinstance(value, (list, tuple)):
        keys = list(range(len(value)))
        parts = [
            _resolve(item, f"{name}.{index}", finish, depth + 1, (*path, index), root)
            for index, item in enumerate(value)
        ]
    else:
        return value, None
    if all(origin is None for _, origin in parts):
        return value, None
    copy: Any = dict(zip(keys, (part for part, _ in parts), strict=True)) if isinstance(value, Mapping) else None
    if copy is None:
        copy = [part for part, _ in parts]
    finish.append(_finisher(value, path, root, keys, [origin for _, origin in parts]))
    return (tuple(copy) if isinstance(value, tuple) else copy), True


def _finisher(
    original: Any, path: tuple[Any, ...], root: list[Any], keys: list[Any], origins: list[Any]
) -> Callable[[], None]:
    """After a load: each Stateful gets what was loaded in its place, and plain values a load assigned reach the
    caller's dict or list. Both are read where the load left them, under the resolved root: a load replaces a
    plain state, or a whole container of plain values (stored as one value), by what it read."""
    writable = isinstance(original, (dict, list))

    def run() -> None:
        copy = root[0]
        for depth, key in enumerate(path):
            copy = _item(copy, key, path[:depth])
        for key, origin in zip(keys, origins, strict=True):
            if origin is None and writable:
                original[key] = _item(copy, key, path)
            elif origin is not None and origin is not True:
                origin.load_state_dict(_item(copy, key, path))

    return run


def _item(container: Any, key: Any, path: tuple[Any, ...]) -> Any:
    """container[key], or a usage error naming the entry when the value the load put there has no such item."""
    try:
        return container[key]
    except (KeyError, IndexError, TypeError):
        name = ".".join(str(part) for part in (*path, key))
        raise ShardckptUsageError(
            f"entry {name!r}: the checkpoint's value of {'.'.join(map(str, path)) or 'the state'!r} "
            f"({type(container).__name__}) holds no {key!r}, so it cannot be restored"
        ) from None
