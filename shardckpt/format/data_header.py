"""The safetensors header of a data file (SPEC.md section 4): strict parsing and comparison with the local manifest.

Readers never need the header (the manifests locate every byte); a verifier checks it, so it is parsed as hostile.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from shardckpt.errors import FormatError
from shardckpt.format.dtypes import itemsize
from shardckpt.format.limits import MAX_HEADER_JSON_BYTES
from shardckpt.format.local_manifest import LocalManifest
from shardckpt.format.values import strict_json

__all__ = ["MAX_HEADER_JSON_BYTES", "header_problems", "parse_header"]

_VERSION = re.compile(r"1\.(0|[1-9][0-9]{0,4})")  # "1.<minor>" (SPEC 4): any 1.x writer's data file


def parse_header(raw: bytes, where: str) -> dict[str, Any]:
    """The JSON object of a data file's first `header_size` bytes; FormatError for anything else.

    `raw` must be exactly the u64le length N and the N bytes it announces: UTF-8 JSON, first byte `{`, an object
    whose keys do not repeat, without NaN or infinities, padded with spaces only.
    """
    if len(raw) < 8:
        raise FormatError(f"{where}: the safetensors header needs 8 length bytes, the file has {len(raw)}")
    length = int.from_bytes(raw[:8], "little")
    if length > MAX_HEADER_JSON_BYTES:
        raise FormatError(f"{where}: safetensors header length {length} is over {MAX_HEADER_JSON_BYTES}")
    if length + 8 != len(raw):
        raise FormatError(f"{where}: safetensors header length {length} does not match the manifest's {len(raw) - 8}")
    body = raw[8:]
    if body[:1] != b"{":
        raise FormatError(f"{where}: safetensors header does not start with '{{'")
    try:
        header = strict_json(body.decode("utf-8").rstrip(" "), where)
    except RecursionError:  # a hostile nesting depth; the format's header is three levels deep
        raise FormatError(f"{where}: safetensors header is nested too deeply") from None
    except ValueError as exc:  # invalid UTF-8 or JSON, a repeated key, NaN
        raise FormatError(f"{where}: safetensors header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise FormatError(f"{where}: safetensors header is not a JSON object")
    return header


def header_problems(raw: bytes, local: LocalManifest, where: str) -> list[tuple[str | None, str]]:
    """(tensor name or None, what is wrong) for each way the header `raw` disagrees with its local manifest."""
    try:
        header = parse_header(raw, where)
    except FormatError as exc:
        return [(None, str(exc).removeprefix(f"{where}: "))]
    problems: list[tuple[str | None, str]] = []
    pieces = local.pieces
    seen: dict[str, int] = {}
    expected_keys = {"__metadata__"}
    stored = _stored_sizes(local)
    stored_begin = 0
    for i, (t, offset, size) in enumerate(zip(pieces.tensor.tolist(), pieces.offset.tolist(), pieces.nbytes.tolist())):
        spec = local.tensors[t]
        number = seen.get(spec.name, 0)
        seen[spec.name] = number + 1
        key = spec.name if number == 0 else f"{spec.name}#{number}"
        expected_keys.add(key)
        first = int(pieces.position[i])
        shape = (
            pieces.length[first : first + spec.k].tolist() if spec.layout == "box" else [size // itemsize(spec.dtype)]
        )
        begin = offset - local.header_size
        expected = {"dtype": spec.dtype, "shape": shape, "data_offsets": [begin, begin + size]}
        if stored is not None:  # SPEC 4.1: a compressed piece is a U8 entry of its stored bytes
            expected = {"dtype": "U8", "shape": [stored[i]], "data_offsets": [stored_begin, stored_begin + stored[i]]}
            stored_begin += stored[i]
        found = header.get(key)
        if found != expected:
            problems.append((spec.name, f"safetensors header entry {key!r} is {_short(found)}, expected {expected!r}"))
    metadata = header.get("__metadata__")
    wanted = {"format": "shardckpt", "attempt": local.attempt, "rank": str(local.rank)}
    if not isinstance(metadata, dict) or any(metadata.get(k) != v for k, v in wanted.items()):
        problems.append((None, f"safetensors __metadata__ is {_short(metadata)}, expected at least {wanted!r}"))
    elif not isinstance(metadata.get("version"), str) or not _VERSION.fullmatch(metadata["version"]):
        # Informative (the manifests' versions govern), but a data file of another major is not this format's.
        problems.append(
            (None, f"safetensors __metadata__ version is {_short(metadata.get('version'))}, not '1.<minor>'")
        )
    if set(header) != expected_keys:
        extra = sorted(set(header) - expected_keys)[:5]
        missing = sorted(expected_keys - set(header))[:5]
        problems.append((None, f"safetensors header keys differ: extra {extra}, missing {missing}"))
    return problems


def _stored_sizes(local: LocalManifest) -> list[int] | None:
    """The stored size of every piece of a compressed file (its blocks' stored sizes summed), None if raw."""
    if local.compression is None:
        return None
    counts = -(-local.pieces.nbytes // local.block_size)
    ends = np.cumsum(counts)
    sums = np.concatenate([[0], np.cumsum(local.compression.stored.astype(np.int64))])
    return (sums[ends] - sums[ends - counts]).tolist() if counts.size else []


def _short(value: object, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
