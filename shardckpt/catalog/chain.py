"""The chain of trust of one checkpoint, torch-free: COMMITTED -> global manifest -> local manifests -> blocks.

A checkpoint exists for readers exactly when its marker does (SPEC section 9); every later link is checked
against the one before it (sizes and CRC32C), so a reader trusts nothing it has not checked.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardckpt.errors import FormatError, IntegrityError, NotCommittedError, NotFoundError, StorageError
from shardckpt.format import layout, limits
from shardckpt.format.manifest import (
    CommitMarker,
    GlobalManifest,
    crc32c_of,
    decode_commit_marker,
    decode_global_manifest,
)
from shardckpt.storage import Storage


def read_marker_bytes(storage: Storage) -> bytes | None:
    """The raw COMMITTED marker, or None when the checkpoint is not committed."""
    try:
        return storage.read_small(layout.COMMITTED, limits.MAX_COMMIT_MARKER_BYTES)
    except NotFoundError:
        return None


def read_commit_marker(storage: Storage) -> CommitMarker | None:
    """The decoded COMMITTED marker, None when absent; FormatError (or StorageError) when unreadable."""
    raw = read_marker_bytes(storage)
    return None if raw is None else decode_commit_marker(raw, storage.describe(layout.COMMITTED))


def read_global_manifest(storage: Storage, marker: CommitMarker) -> GlobalManifest:
    """The manifest COMMITTED points at, after checking its size and CRC32C against the marker."""
    raw = storage.read_small(marker.manifest, limits.MAX_GLOBAL_MANIFEST_BYTES)
    return verify_global_manifest(raw, marker, storage.describe(marker.manifest))


def verify_global_manifest(raw: bytes, marker: CommitMarker, where: str) -> GlobalManifest:
    """Check manifest bytes (read here or received from a peer) against COMMITTED, then decode them."""
    if len(raw) != marker.manifest_size or crc32c_of(raw) != marker.manifest_crc32c:
        raise IntegrityError(
            f"{where}: {len(raw)} bytes with CRC32C {crc32c_of(raw):#010x}, but COMMITTED promises "
            f"{marker.manifest_size} bytes with CRC32C {marker.manifest_crc32c:#010x}"
        )
    manifest = decode_global_manifest(raw, where)
    if (manifest.attempt, manifest.world_size, manifest.step) != (marker.attempt, marker.world_size, marker.step):
        raise FormatError(
            f"{where}: attempt {manifest.attempt}, {manifest.world_size} ranks, step {manifest.step} disagree with "
            f"COMMITTED (attempt {marker.attempt}, {marker.world_size} ranks, step {marker.step})"
        )
    return manifest


@dataclass(frozen=True)
class Opening:
    """What opening a checkpoint reads, raw (to hand to other ranks) and checked: COMMITTED and the manifest."""

    marker_raw: bytes
    marker: CommitMarker
    manifest_raw: bytes
    manifest: GlobalManifest


def read_opening(storage: Storage) -> Opening:
    """Read COMMITTED and the global manifest it points at, each once, and check them; NotCommittedError if none."""
    try:
        marker_raw = read_marker_bytes(storage)
        marker = None if marker_raw is None else decode_commit_marker(marker_raw, storage.describe(layout.COMMITTED))
    except StorageError as exc:
        raise StorageError(f"cannot read {storage.describe(layout.COMMITTED)}: {exc}") from exc
    if marker_raw is None or marker is None:
        raise NotCommittedError(
            f"{storage.url} is not committed (no {layout.COMMITTED} marker): the save is incomplete, failed, "
            "or still running"
        )
    manifest_raw = storage.read_small(marker.manifest, limits.MAX_GLOBAL_MANIFEST_BYTES)
    manifest = verify_global_manifest(manifest_raw, marker, storage.describe(marker.manifest))
    return Opening(marker_raw, marker, manifest_raw, manifest)
