"""The node-local tier's commit: one global manifest for the whole job, built once from every rank's local
manifest, then written with all local manifests and COMMITTED into each node's directory, which holds its pieces.

A node's copy is an ordinary committed checkpoint whose data files are those of the node's own ranks plus the
replicas it keeps for peers: the manifest describes the whole job, the node holds part of it (SPEC 9's "missing
data file" is what reading an absent piece there reports). COMMITTED is each node's last write.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from shardckpt.errors import AlreadyExistsError, CoverageError, FormatError, IntegrityError, NotFoundError
from shardckpt.format import layout, limits
from shardckpt.format.local_manifest import decode_local_manifest
from shardckpt.format.manifest import (
    FileEntry,
    GlobalManifest,
    crc32c_of,
    encode_commit_marker,
    encode_global_manifest,
)
from shardckpt.format.strict import FORMAT_VERSION
from shardckpt.storage import Storage
from shardckpt.write.commit import marker_for
from shardckpt.write.merge import merge_objects, merge_tensors


def build_manifest(
    where: str, raws: Sequence[bytes], attempt: str, step: int | None, metadata: dict[str, Any]
) -> tuple[bytes, bytes]:
    """(coordinator) The encoded global manifest and COMMITTED of one local save from the ranks' local manifests
    (rank order), validated as commit() validates them (coverage, agreement); `where` names the save in errors."""
    locals_ = []
    for index, raw in enumerate(raws):
        local = decode_local_manifest(raw, f"{where}/{layout.local_manifest_path(index, attempt)}")
        if (local.attempt, local.world_size, local.rank) != (attempt, len(raws), index):
            raise CoverageError(
                f"{where}: rank {index}'s local manifest belongs to attempt {local.attempt}, rank {local.rank} of "
                f"{local.world_size}; expected attempt {attempt}, rank {index} of {len(raws)}"
            )
        if local.references is not None and local.references.files:
            raise FormatError(f"{where}: rank {index} stored pieces by reference, which a local save never does")
        locals_.append(local)
    block_sizes = {local.block_size for local in locals_}
    if len(block_sizes) != 1:
        raise CoverageError(f"{where}: the ranks disagree on block_size: {sorted(block_sizes)}")
    manifest = GlobalManifest(
        attempt=attempt,
        world_size=len(raws),
        block_size=block_sizes.pop(),
        files=tuple(
            FileEntry(
                m.rank, m.data, m.data_size, layout.local_manifest_path(m.rank, attempt), len(raw), crc32c_of(raw)
            )
            for m, raw in zip(locals_, raws)
        ),
        tensors=merge_tensors(locals_),
        objects=merge_objects(locals_),
        step=step,
        created=time.time(),
        metadata=dict(metadata),
        version=FORMAT_VERSION,
    )
    clash = {o.name for o in manifest.objects} & {t.name for t in manifest.tensors}
    if clash:
        raise FormatError(f"{where}: {min(clash)!r} is the name of a tensor and of an object of attempt {attempt}")
    encoded = encode_global_manifest(manifest)
    return encoded, encode_commit_marker(marker_for(manifest, encoded))


def commit_node(
    storage: Storage, raws: Sequence[bytes], attempt: str, manifest: bytes, marker: bytes, held: Sequence[int] = ()
) -> None:
    """(one rank per node) Write the local manifests this node's directory lacks, the global manifest, then
    COMMITTED, once the data files of the ranks in `held` (the node's own and those it keeps for peers) are there
    whole. A local manifest a rank of this node wrote already must hold the same bytes."""
    for rank, raw in enumerate(raws):
        write_same(storage, layout.local_manifest_path(rank, attempt), raw, limits.MAX_LOCAL_MANIFEST_BYTES)
    write_same(storage, layout.global_manifest_path(attempt), manifest, limits.MAX_GLOBAL_MANIFEST_BYTES)
    # The directory may have been wiped (or a file deleted) since the ranks wrote: writing the manifests above
    # recreated it, and a COMMITTED over missing files would report a save that succeeded but cannot be restored.
    for rank in held:
        path = layout.data_path(rank, attempt)
        expected = decode_local_manifest(raws[rank], storage.describe(layout.local_manifest_path(rank, attempt)))
        try:
            size = storage.size(path)
        except NotFoundError as exc:
            raise IntegrityError(
                f"{storage.describe(path)} vanished before this node committed: not committed"
            ) from exc
        if size != expected.data_size:
            raise IntegrityError(
                f"{storage.describe(path)} holds {size} bytes, {expected.data_size} were written: not committed"
            )
    try:
        storage.commit_marker(layout.COMMITTED, marker)
    except AlreadyExistsError:  # two "nodes" sharing one directory: the other committed this very save
        if storage.read_small(layout.COMMITTED, limits.MAX_COMMIT_MARKER_BYTES) != marker:
            raise


def write_same(storage: Storage, path: str, data: bytes, limit: int) -> None:
    """Create `path` with `data`; where it exists already (a rank of this node wrote it, or two simulated nodes share
    one directory) it must hold these very bytes: nothing is ever overwritten."""
    try:
        storage.write_new(path, data)
    except AlreadyExistsError:
        if storage.read_small(path, max(limit, len(data))) != data:
            raise IntegrityError(f"{storage.describe(path)} exists and holds other bytes than this save's") from None
