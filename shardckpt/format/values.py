"""Plain values stored beside tensors (step, RNG state, scheduler, data position, user metadata) in msgpack.

Tuples survive the round trip as msgpack extension type 1; everything else is msgpack's own types.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Collection, Mapping
from typing import Any

import msgpack

from shardckpt.errors import FormatError
from shardckpt.format.limits import MAX_DEPTH, MAX_VALUE_ITEMS

TUPLE_EXT = 1
ROOT_ITEMS = "[]"  # unpack_value's shallow for a root array whose items the caller checks (piece index blocks)
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1
_EXT_FORMATS = frozenset({0xC7, 0xC8, 0xC9, 0xD4, 0xD5, 0xD6, 0xD7, 0xD8})  # msgpack ext 8/16/32, fixext 1..16
_ARRAY_FORMATS = frozenset({*range(0x90, 0xA0), 0xDC, 0xDD})  # msgpack fixarray, array 16/32


def _default(value: object) -> Any:
    if isinstance(value, tuple):
        return msgpack.ExtType(TUPLE_EXT, pack_value(list(value)))
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, list):
        return list(value)
    raise FormatError(f"cannot store a value of type {type(value).__name__} (plain values only)")


def check_utf8(text: str, where: str) -> None:
    """A str is stored as UTF-8: refuse one that has no UTF-8 form (a lone surrogate) before anything is written."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise FormatError(f"{where}: {text!r} is not valid UTF-8 text (lone surrogate at index {exc.start})") from None


def check_plain(value: object, where: str, depth: int = 0) -> None:
    """Reject what msgpack cannot hold faithfully, before anything is written.

    Work is bounded by MAX_VALUE_ITEMS: a value that shares one list in many places (x = [y, y], nested) is stored
    once per use, so its size is that of the expanded tree, which can be 2^depth items for a few hundred bytes.
    """
    _check_plain(value, where, depth, [MAX_VALUE_ITEMS])


def _check_plain(value: object, where: str, depth: int, budget: list[int]) -> None:
    budget[0] -= 1
    if budget[0] < 0:
        raise FormatError(
            f"{where}: value holds more than {MAX_VALUE_ITEMS} items once shared parts are counted per use "
            "(plain values are stored as trees)"
        )
    if depth > MAX_DEPTH:
        raise FormatError(f"{where}: value nested deeper than {MAX_DEPTH}")
    if isinstance(value, str):
        check_utf8(value, where)
        return
    if value is None or isinstance(value, (bool, float, bytes, bytearray, memoryview)):
        return
    if isinstance(value, int):
        if not _INT_MIN <= value <= _INT_MAX:
            raise FormatError(f"{where}: integer {value} does not fit in 64 bits")
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_plain(item, f"{where}[{index}]", depth + 1, budget)
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise FormatError(f"{where}: map keys must be str or int, got {type(key).__name__}")
            if isinstance(key, int) and not _INT_MIN <= key <= _INT_MAX:
                raise FormatError(f"{where}: map key {key} does not fit in 64 bits")
            if isinstance(key, str):
                check_utf8(key, f"{where}: map key")
            _check_plain(item, f"{where}[{key!r}]", depth + 1, budget)
        return
    raise FormatError(f"{where}: cannot store a value of type {type(value).__name__} (plain values only)")


def pack_value(value: object) -> bytes:
    try:
        packed: bytes = msgpack.packb(value, default=_default, strict_types=True, use_bin_type=True)
    except UnicodeEncodeError as exc:  # a str nobody checked (e.g. user metadata): still a typed error
        raise FormatError(f"cannot store {exc.object[exc.start : exc.end]!r}: text must be valid UTF-8") from None
    return packed


def unpack_value(data: bytes, where: str, depth: int = 0, *, shallow: str | None = None) -> Any:
    """Decode msgpack with tuple extensions, bounded nesting, and any failure turned into FormatError.

    shallow: a key of the root map whose value, when a list, is checked for nesting without its items; the caller
    checks each item itself (check_depth at depth + 2), or proves its depth by checking its exact shape.
    """
    return _unpack(data, where, depth, shallow, proving=True)


def _unpack(data: bytes, where: str, depth: int, shallow: str | None, *, proving: bool) -> Any:
    """unpack_value; proving: try the decoding without a Python call per map first (tuple payloads inside never
    do, so a fault deep inside nested tuples costs each level two decodings, not two per level above it)."""
    if depth > MAX_DEPTH:
        raise FormatError(f"{where}: value nested deeper than {MAX_DEPTH}")
    # A tuple's payload array stands for the tuple itself: at `depth` when the tuple is this document's root,
    # at least one level below otherwise.
    payload_depth = depth if data[:1] and data[0] in _EXT_FORMATS else depth + 1

    def ext_hook(code: int, payload: bytes) -> Any:
        if code != TUPLE_EXT:
            raise FormatError(f"{where}: unknown msgpack extension type {code}")
        if not payload[:1] or payload[0] not in _ARRAY_FORMATS:
            raise FormatError(f"{where}: tuple extension must hold an array")
        items = _unpack(payload, where, payload_depth, None, proving=False)
        if not isinstance(items, list):
            raise FormatError(f"{where}: tuple extension must hold an array")
        return tuple(items)

    # A repeated key leaves a map shorter than its encoding, so a value that packs back to exactly these bytes has
    # none: proven in C for what our writers produce. Anything else (a fault included, so that its message is the
    # one the map-by-map decoding gives) is decoded again with each map checked.
    proven = False
    if proving:
        try:
            value = msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=ext_hook, use_list=True)
            proven = _packs_to(value, data)
        except Exception:
            proven = False
    if not proven:
        try:
            value = msgpack.unpackb(
                data,
                raw=False,
                strict_map_key=False,
                ext_hook=ext_hook,
                use_list=True,
                object_pairs_hook=functools.partial(unique_map, where=where),  # called per map: no Python frame
            )
        except FormatError:
            raise
        except Exception as exc:  # msgpack raises a zoo of types for bad input; all mean the same to a reader
            raise FormatError(f"{where}: not valid msgpack ({type(exc).__name__}: {exc})") from None
    if shallow == ROOT_ITEMS and type(value) is list:
        _check_depth([], where, depth)
    elif shallow is not None and type(value) is dict and type(value.get(shallow)) is list:
        _check_depth({key: [] if key == shallow else item for key, item in value.items()}, where, depth)
    else:
        _check_depth(value, where, depth)
    return value


def _packs_to(value: object, data: bytes) -> bool:
    """Whether packing `value` as pack_value does gives exactly `data` (False when it cannot be packed)."""
    try:
        return pack_value(value) == data
    except Exception:  # a value msgpack may decode but not encode as we do (a timestamp, a huge int): not proven
        return False


def unique_map(pairs: list[tuple[Any, Any]], where: str) -> dict[Any, Any]:
    """A map from key/value pairs, refusing a repeated key (a last-one-wins map hides what a writer meant)."""
    result = dict(pairs)
    if len(result) != len(pairs):
        keys = [key for key, _ in pairs]
        repeated = next(key for index, key in enumerate(keys) if key in keys[:index])
        raise FormatError(f"{where}: map key {repeated!r} appears twice")
    return result


def strict_json(text: str, where: str) -> Any:
    """JSON as the format writes it (COMMITTED, safetensors headers): NaN and Infinity refused, a repeated key
    refused (FormatError). Malformed text raises json.JSONDecodeError; hostile nesting RecursionError."""
    return json.loads(text, parse_constant=_reject_constant, object_pairs_hook=lambda pairs: unique_map(pairs, where))


def _reject_constant(name: str) -> None:
    raise FormatError(f"{name} is not allowed in JSON here")


def check_depth(value: object, where: str, depth: int) -> None:
    """FormatError when `value`, sitting at `depth`, nests deeper than MAX_DEPTH or holds what msgpack values may
    not (a timestamp, a map key other than str or int)."""
    _check_depth(value, where, depth)


def _check_depth(value: object, where: str, depth: int) -> None:
    # Iterative, so a hostile nesting cannot exhaust Python's recursion limit. Only containers go on the stack;
    # leaves (almost every node of a manifest) are checked where they are met.
    if depth > MAX_DEPTH:
        raise FormatError(f"{where}: value nested deeper than {MAX_DEPTH}")
    if isinstance(value, msgpack.Timestamp):
        raise FormatError(f"{where}: msgpack timestamps are not part of the format")
    stack: list[tuple[object, int]] = [(value, depth)]
    while stack:
        item, level = stack.pop()
        children: Collection[object]
        if isinstance(item, (list, tuple)):
            children = item
        elif isinstance(item, dict):
            for key in item:
                if type(key) is not str and type(key) is not int:  # bool is an int subclass: refused too
                    raise FormatError(f"{where}: map keys must be str or int, got {type(key).__name__}")
            children = item.values()
        else:
            continue
        if level + 1 > MAX_DEPTH and len(children) > 0:
            raise FormatError(f"{where}: value nested deeper than {MAX_DEPTH}")
        for child in children:
            kind = type(child)
            if kind is list or kind is tuple or kind is dict:
                stack.append((child, level + 1))
            elif kind is msgpack.Timestamp:
                raise FormatError(f"{where}: msgpack timestamps are not part of the format")
