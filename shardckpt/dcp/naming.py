"""One naming for both APIs (SPEC 7 "Names"): DCP's flattened names of plain values <-> shardckpt's objects.

DCP flattens every mapping (and lists holding one); shardckpt stores a container without tensors as one object.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

from shardckpt.errors import FormatError, ShardckptUsageError

Path = tuple[str | int, ...]


def _terminal(value: Any) -> bool:
    """DCP's rule (torch/distributed/checkpoint/_traverse.py) for a value without tensors: a mapping is always
    walked, a list only when it holds a mapping or a walked list, anything else (tuples too) is one entry."""
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    return all(not isinstance(item, (Mapping, list)) or _terminal(item) for item in value)


def dcp_entries(name: str, value: Any, leaf: Callable[[Any], bool] | None = None) -> list[tuple[str, Path]]:
    """The names DCP gives the parts of the plain value stored as object `name`, each with its path in the value.

    An empty mapping has no entry (DCP drops it too); a value DCP does not walk is the one entry `name`; `leaf`
    marks stored parts that stand for one value DCP does not walk either (a tensor stored as a tagged map).
    """
    found: list[tuple[str, Path]] = []

    def walk(path: Path, part: Any) -> None:
        if leaf is not None and leaf(part):
            found.append((".".join(map(str, (name, *path))), path))
        elif isinstance(part, Mapping):
            for key, item in part.items():
                walk((*path, str(key)), item)
        elif _terminal(part):
            found.append((".".join(map(str, (name, *path))), path))
        else:
            for index, item in enumerate(part):
                walk((*path, index), item)

    walk((), value)
    return found


def value_at(value: Any, path: Path, where: str) -> Any:
    """The part of a stored plain value at a path from `dcp_entries` (map keys compared as DCP writes them)."""
    for step in path:
        if isinstance(value, Mapping):
            matches = [key for key in value if str(key) == step]
            if len(matches) != 1:
                raise FormatError(f"{where}: no single map key {step!r} in the stored value")
            value = value[matches[0]]
        elif isinstance(value, list) and isinstance(step, int) and 0 <= step < len(value):
            value = value[step]
        else:
            raise FormatError(f"{where}: the stored value has no part {step!r}")
    return value


def object_names(paths: Mapping[str, Path], tensors: Collection[str], objects: Iterable[str]) -> dict[str, Path]:
    """For each DCP entry in `objects`, the path of the shardckpt object holding it (SPEC 7 "Names").

    paths: DCP's flatten mapping (entry -> path in the nested state dict); tensors: every tensor entry. An
    object is the shortest prefix of the entry's path under which the state holds no tensor, as shardckpt.save's
    own flattening names it. Without a mapping (flatten_state_dict=False), each entry is its own object.
    """
    under_tensors: set[Path] = set()
    for name in tensors:
        path = tuple(paths.get(name, (name,)))
        under_tensors.update(path[:length] for length in range(1, len(path) + 1))
    owners: dict[str, Path] = {}
    for name in objects:
        path = tuple(paths.get(name, (name,)))
        owners[name] = next((path[:n] for n in range(1, len(path) + 1) if path[:n] not in under_tensors), path)
    return owners


def split_objects(
    owners: Mapping[str, Path], held: Sequence[Collection[str]], paths: Mapping[str, Path]
) -> dict[str, Path]:
    """`owners` (entry -> object path, from `object_names`) refined so that each rank holding part of an object
    holds all of it (SPEC 7 "Names"): held[r] are rank r's plain entries, paths DCP's flatten mapping.

    DCP lets ranks hold different entries of one container (torchtitan keys its data loader's state by rank:
    rank 0 has `dataloader.dp_rank_0`, rank 1 `dataloader.dp_rank_1`), which no rank could store as one object;
    such a container is stored as its parts, one level down at a time, until every part is held whole.
    """
    owners = dict(owners)
    holdings = [set(entries) for entries in held]
    while True:
        members: dict[Path, set[str]] = {}
        for name, owner in owners.items():
            members.setdefault(owner, set()).add(name)
        split = False
        for owner, names in members.items():
            if len({frozenset(names & entries) for entries in holdings} - {frozenset()}) > 1:
                for name in names:
                    path = tuple(paths.get(name, (name,)))
                    owners[name] = path[: len(owner) + 1]
                split = True
        if not split:
            return owners


def assemble(name: str, parts: Sequence[tuple[Path, Any]]) -> Any:
    """The plain value of object `name` from its DCP entries (paths relative to the object), as DCP flattened it.

    Steps that are ints were list positions, strs map keys; a position DCP left out held an empty mapping.
    """
    if len(parts) == 1 and parts[0][0] == ():
        return parts[0][1]
    root: dict[Any, Any] = {}
    for path, value in parts:
        if not path:
            raise ShardckptUsageError(f"DCP entry {name!r} is both a value and a container of other entries")
        node = root
        for step in path[:-1]:
            child = node.setdefault(step, {})
            if not isinstance(child, dict):
                raise ShardckptUsageError(f"DCP entries under {name!r} use {step!r} as a value and as a container")
            node = child
        if path[-1] in node:
            raise ShardckptUsageError(f"DCP entries under {name!r} name part {path!r} twice")
        node[path[-1]] = value
    return _lists(root)


def _lists(node: Any) -> Any:
    """Turn the mappings whose keys are all ints (list positions) back into lists."""
    if not isinstance(node, dict):
        return node
    items = {key: _lists(value) for key, value in node.items()}
    if items and all(isinstance(key, int) for key in items):
        return [items.get(index, {}) for index in range(max(items) + 1)]
    return items
