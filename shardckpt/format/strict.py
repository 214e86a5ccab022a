"""Strict reading of untrusted manifest documents: typed field access, names, shapes, versions, objects.

Shared by the global and local manifest codecs; every failure is a FormatError naming file and field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from shardckpt.errors import FormatError
from shardckpt.format import limits
from shardckpt.format.layout import validate_attempt
from shardckpt.format.values import check_utf8, unpack_value

FORMAT_NAME = "shardckpt"
FORMAT_VERSION = (1, 0)  # what a save without references writes: every 1.x reader reads it
NEWEST_VERSION = (1, 2)  # the newest minor this build reads and writes (SPEC 2.1; 1.1 references, 1.2 below)
# Feature names this reader understands when a writer lists them in "must_understand".
# Format 1.1: "references" (format/references.py); 1.2: "compression" (format/compressed.py) and "piece_index"
# (format/piece_index.py).
UNDERSTOOD_FEATURES: frozenset[str] = frozenset({"references", "compression", "piece_index"})
OBJECT_VALUE_LEVEL = 3
DOCUMENT_DEPTH = -OBJECT_VALUE_LEVEL  # the depth a manifest's root map sits at (see unpack_manifest)


@dataclass(frozen=True)
class ObjectEntry:
    """A plain (non-tensor) value; rank None means shared by all ranks."""

    name: str
    rank: int | None
    value: Any


class Fields:
    """Typed access to one decoded msgpack map, naming the file and field in every error."""

    def __init__(self, raw: object, where: str) -> None:
        if not isinstance(raw, dict):
            raise FormatError(f"{where}: expected a map, got {type(raw).__name__}")
        self.raw, self.where = raw, where

    def get(self, key: str, kind: type | tuple[type, ...], *, optional: bool = False) -> Any:
        if key not in self.raw:
            if optional:
                return None
            raise FormatError(f"{self.where}: missing field {key!r}")
        value = self.raw[key]
        if value is None and optional:
            return None
        # bool is an int in Python; the format never accepts one for the other.
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
            raise FormatError(f"{self.where}: field {key!r} must be {_kind_name(kind)}, got {type(value).__name__}")
        return value

    def integer(self, key: str, low: int, high: int, *, optional: bool = False) -> Any:
        value = self.get(key, int, optional=optional)
        if value is not None and not low <= value <= high:
            raise FormatError(f"{self.where}: field {key!r} = {value} is outside {low}..{high}")
        return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def check_header(fields: Fields, kind: str) -> tuple[int, int]:
    if fields.get("format", str) != FORMAT_NAME:
        raise FormatError(f"{fields.where}: not a shardckpt manifest (format field is not {FORMAT_NAME!r})")
    if fields.get("kind", str) != kind:
        raise FormatError(f"{fields.where}: expected a {kind} manifest, got kind {fields.raw.get('kind')!r}")
    version = check_version(fields.get("version", list), fields.where)
    # Absent means none; nil is not an array of strings (SPEC 2), unlike the fields that say "nil reads as empty".
    must = fields.get("must_understand", list) if "must_understand" in fields.raw else []
    if not all(isinstance(feature, str) for feature in must):
        raise FormatError(f"{fields.where}: must_understand must be a list of strings")
    unknown = [feature for feature in must if feature not in UNDERSTOOD_FEATURES]
    if unknown:
        raise FormatError(f"{fields.where}: requires features this reader does not understand: {unknown!r}")
    return version


def check_version(version: list[Any], where: str) -> tuple[int, int]:
    if len(version) != 2 or not all(type(part) is int and 0 <= part < 1 << 16 for part in version):
        raise FormatError(f"{where}: version must be [major, minor], got {version!r}")
    if version[0] != FORMAT_VERSION[0]:
        raise FormatError(
            f"{where}: format version {version[0]}.{version[1]} is not supported "
            f"(this reader reads major version {FORMAT_VERSION[0]}); upgrade shardckpt"
        )
    return version[0], version[1]


def check_name(name: object, where: str) -> str:
    if not isinstance(name, str) or not 1 <= len(name) <= limits.MAX_NAME_CHARS or "\x00" in name:
        raise FormatError(f"{where}: a name must be 1..{limits.MAX_NAME_CHARS} characters without NUL, got {name!r}")
    check_utf8(name, where)
    return name


def check_shape(shape: object, where: str) -> tuple[int, ...]:
    if not isinstance(shape, (list, tuple)) or len(shape) > limits.MAX_NDIM:
        raise FormatError(f"{where}: shape must be a list of at most {limits.MAX_NDIM} integers, got {shape!r}")
    dims = tuple(shape)
    if not all(type(dim) is int and 0 <= dim <= limits.MAX_EXTENT for dim in dims):
        raise FormatError(f"{where}: shape {list(dims)!r} has a dimension that is not an integer in 0..2^62")
    if math.prod(dims) > limits.MAX_EXTENT:
        raise FormatError(f"{where}: shape {list(dims)!r} has more than 2^62 elements")
    return dims


def decode_objects(raw: list[Any], where: str, world_size: int) -> tuple[ObjectEntry, ...]:
    entries = []
    seen: set[tuple[str, int | None]] = set()
    for index, item in enumerate(raw):
        fields = Fields(item, f"{where} objects[{index}]")
        name = check_name(fields.get("name", str), fields.where)
        rank = fields.integer("rank", 0, world_size - 1, optional=True)
        if (name, rank) in seen:
            raise FormatError(f"{where}: object {name!r} (rank {rank}) appears twice")
        seen.add((name, rank))
        entries.append(ObjectEntry(name, rank, fields.raw.get("value")))
    return tuple(entries)


def unpack_manifest(data: bytes, where: str, max_bytes: int, *, shallow: str | None = None) -> Fields:
    """The manifest's root map; `shallow`: a list field whose items the caller checks for depth (unpack_value)."""
    if len(data) > max_bytes:
        raise FormatError(f"{where}: manifest is {len(data)} bytes, over the {max_bytes} byte limit")
    # Object values sit three levels down (document -> "objects" -> entry -> "value") and may each nest
    # MAX_DEPTH levels, as check_plain lets a writer store: count the document's levels from -3.
    return Fields(unpack_value(data, where, DOCUMENT_DEPTH, shallow=shallow), where)


def created_field(fields: Fields) -> float:
    value = fields.get("created", (int, float), optional=True)
    if isinstance(value, bool):
        raise FormatError(f"{fields.where}: field 'created' must be a number of seconds, got a bool")
    seconds = float(value or 0.0)
    # Finite and within what a calendar date can show: tools print, sort and emit it as JSON.
    if not 0.0 <= seconds <= limits.MAX_CREATED_SECONDS:  # NaN fails every comparison, so it lands here too
        raise FormatError(
            f"{fields.where}: field 'created' = {value!r} is not a time in 0..{limits.MAX_CREATED_SECONDS:.0f} seconds"
        )
    return seconds


def attempt_field(fields: Fields) -> str:
    try:
        return validate_attempt(fields.get("attempt", str))
    except FormatError as exc:
        raise FormatError(f"{fields.where}: {exc}") from None


def block_size_field(fields: Fields) -> int:
    block: int = fields.integer("block_size", limits.MIN_BLOCK_SIZE, limits.MAX_BLOCK_SIZE)
    if block & (block - 1):
        raise FormatError(f"{fields.where}: block_size {block} is not a power of two")
    return block
