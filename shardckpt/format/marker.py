"""The COMMITTED marker of format v1: the type and its strict JSON codec (SPEC 9).

It names the global manifest with its size and CRC32C (and, format 1.2, its head's), so every later link is checked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from shardckpt.errors import FormatError
from shardckpt.format import limits
from shardckpt.format.compressed import check_feature as check_compression
from shardckpt.format.layout import parse_global_manifest_path
from shardckpt.format.piece_index import FEATURE as INDEX_FEATURE
from shardckpt.format.piece_index import listed as index_listed
from shardckpt.format.references import (
    FEATURE,
    decode_committed_references,
    encode_committed_references,
)
from shardckpt.format.strict import (
    FORMAT_NAME,
    FORMAT_VERSION,
    Fields,
    attempt_field,
    check_header,
    created_field,
)
from shardckpt.format.values import strict_json


@dataclass(frozen=True)
class CommitMarker:
    attempt: str
    manifest: str
    manifest_size: int
    manifest_crc32c: int
    world_size: int
    total_bytes: int
    step: int | None = None
    created: float = 0.0
    version: tuple[int, int] = FORMAT_VERSION
    references: tuple[tuple[str, str], ...] = ()  # format 1.1: (checkpoint, attempt) of every referenced one
    head: tuple[int, int] | None = None  # format 1.2: (size, CRC32C) of the manifest's head (SPEC 11.1)


def encode_commit_marker(marker: CommitMarker) -> bytes:
    document = {
        "format": FORMAT_NAME,
        "kind": "committed",
        "version": list(marker.version),
        "attempt": marker.attempt,
        "manifest": marker.manifest,
        "manifest_size": marker.manifest_size,
        "manifest_crc32c": marker.manifest_crc32c,
        "world_size": marker.world_size,
        "total_bytes": marker.total_bytes,
        "step": marker.step,
        "created": marker.created,
    }
    features = [FEATURE] if marker.references else []
    if marker.references:
        document["references"] = encode_committed_references(marker.references)
    if marker.head is not None:
        features.append(INDEX_FEATURE)
        document["piece_index"] = {"head_size": marker.head[0], "head_crc32c": marker.head[1]}
    if features:
        document["must_understand"] = features
    return (json.dumps(document, indent=1) + "\n").encode()


def decode_commit_marker(data: bytes, where: str = "COMMITTED") -> CommitMarker:
    if len(data) > limits.MAX_COMMIT_MARKER_BYTES:
        raise FormatError(f"{where}: {len(data)} bytes, over the {limits.MAX_COMMIT_MARKER_BYTES} byte limit")
    try:
        raw = strict_json(data.decode("utf-8"), where)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as exc:
        raise FormatError(f"{where}: not a valid JSON commit marker ({exc})") from None
    fields = Fields(raw, where)
    version = check_header(fields, "committed")
    # COMMITTED describes no data file, so it never uses compression (SPEC 4.1): listing it is refused (SPEC 2).
    check_compression(fields, version, False)
    attempt = attempt_field(fields)
    manifest = fields.get("manifest", str)
    try:
        manifest_attempt = parse_global_manifest_path(manifest)
    except FormatError as exc:
        raise FormatError(f"{where}: {exc}") from None
    if manifest_attempt != attempt:
        raise FormatError(f"{where}: manifest {manifest!r} does not belong to attempt {attempt}")
    manifest_size = fields.integer("manifest_size", 1, limits.MAX_GLOBAL_MANIFEST_BYTES)
    return CommitMarker(
        attempt=attempt,
        manifest=manifest,
        manifest_size=manifest_size,
        manifest_crc32c=fields.integer("manifest_crc32c", 0, (1 << 32) - 1),
        world_size=fields.integer("world_size", 1, limits.MAX_WORLD_SIZE),
        total_bytes=fields.integer("total_bytes", 0, limits.MAX_EXTENT),
        step=fields.integer("step", -(1 << 63), (1 << 63) - 1, optional=True),
        created=created_field(fields),
        version=version,
        references=decode_committed_references(fields, version),
        head=_head(fields, version, manifest_size),
    )


def _head(fields: Fields, version: tuple[int, int], manifest_size: int) -> tuple[int, int] | None:
    """SPEC 11.1: (size, CRC32C) of the manifest's head, present if and only if must_understand lists the feature."""
    if not index_listed(fields, version):
        return None
    head = Fields(fields.raw["piece_index"], f"{fields.where} piece_index")
    if set(head.raw) != {"head_size", "head_crc32c"}:
        raise FormatError(f"{head.where}: must hold exactly the fields head_size and head_crc32c")
    # The blocks follow the head, and a piece index has at least one tensor or none: the head may be all of it.
    return head.integer("head_size", 1, manifest_size), head.integer("head_crc32c", 0, (1 << 32) - 1)
