"""The chain of trust of one checkpoint, torch-free: COMMITTED -> global manifest -> local manifests -> blocks.

A checkpoint exists for readers exactly when its marker does (SPEC section 9); every later link is checked
against the one before it (sizes and CRC32C), so a reader trusts nothing it has not checked. Where there is no
marker, `what_is` says what is there instead (nothing, a root of checkpoints, a DCP checkpoint, a failed save).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from shardckpt.errors import (
    FormatError,
    IntegrityError,
    NotCommittedError,
    NotFoundError,
    ShardckptError,
    StorageError,
)
from shardckpt.format import layout, limits
from shardckpt.format.manifest import (
    CommitMarker,
    GlobalManifest,
    crc32c_of,
    decode_commit_marker,
    decode_global_manifest,
    decode_index_blocks,
    manifest_head_size,
)
from shardckpt.format.references import check_committed_references
from shardckpt.storage import Storage


def read_markers(storage: Storage) -> list[tuple[str, bytes]]:
    """(name, raw bytes) of every marker of the checkpoint, oldest first; [] when it is not committed.

    COMMITTED makes the checkpoint exist; a save that superseded it (SPEC 14.2) committed COMMITTED-2, the next
    COMMITTED-3, ...: the last of the unbroken run COMMITTED, COMMITTED-2, ... is the one that counts.
    """
    try:
        markers = [(layout.COMMITTED, storage.read_small(layout.COMMITTED, limits.MAX_COMMIT_MARKER_BYTES))]
    except NotFoundError:
        return []
    for generation in range(2, limits.MAX_MARKER_GENERATION + 1):
        successor = layout.marker_name(generation)
        try:
            markers.append((successor, storage.read_small(successor, limits.MAX_COMMIT_MARKER_BYTES)))
        except NotFoundError:
            break
    return markers


def read_marker(storage: Storage) -> tuple[str, bytes] | None:
    """(name, raw bytes) of the marker that commits the checkpoint now (read_markers' last), None when it is not
    committed."""
    markers = read_markers(storage)
    return markers[-1] if markers else None


def read_marker_bytes(storage: Storage) -> bytes | None:
    """The raw bytes of the marker that commits the checkpoint (read_marker), or None when it is not committed."""
    found = read_marker(storage)
    return None if found is None else found[1]


def read_commit_marker(storage: Storage) -> CommitMarker | None:
    """The decoded marker that commits the checkpoint, None when absent; FormatError (or StorageError) when
    unreadable."""
    found = read_marker(storage)
    return None if found is None else decode_commit_marker(found[1], storage.describe(found[0]))


def read_global_manifest(storage: Storage, marker: CommitMarker) -> GlobalManifest:
    """The manifest COMMITTED points at, after checking its size and CRC32C against the marker."""
    raw = storage.read_small(marker.manifest, limits.MAX_GLOBAL_MANIFEST_BYTES)
    return verify_global_manifest(raw, marker, storage.describe(marker.manifest))


def verify_global_manifest(raw: bytes, marker: CommitMarker, where: str, *, head_only: bool = False) -> GlobalManifest:
    """Check manifest bytes (read here or received from a peer) against COMMITTED, then decode them.

    head_only: `raw` is the head of a manifest with a piece index (SPEC 11.1), checked against the marker's head
    size and CRC32C; the result is partial (read_index_entries adds tensors). A marker without a head: all of it."""
    head_only = head_only and marker.head is not None
    size, crc = marker.head if head_only and marker.head is not None else (marker.manifest_size, marker.manifest_crc32c)
    what = "the head of " if head_only else ""
    if len(raw) != size or crc32c_of(raw) != crc:
        raise IntegrityError(
            f"{where}: {what}{len(raw)} bytes with CRC32C {crc32c_of(raw):#010x}, but COMMITTED promises "
            f"{size} bytes with CRC32C {crc:#010x}"
        )
    manifest = decode_global_manifest(raw, where, head_only=head_only)
    if (manifest.piece_index is None) != (marker.head is None):
        raise FormatError(f"{where}: COMMITTED and the manifest disagree on whether it has a piece index")
    if head_only and marker.head is not None and manifest.piece_index is not None:
        # What a whole read finds after the head (SPEC 11.1), known here without reading it: a load that reads some
        # blocks refuses what open() and verify refuse, instead of loading from a manifest they call broken.
        after = marker.manifest_size - marker.head[0]
        if after != manifest.piece_index.region_size:
            raise FormatError(
                f"{where}: {after} bytes follow the head, its piece index has {manifest.piece_index.region_size}"
            )
    if marker.head is not None and not head_only:
        head = manifest_head_size(raw, where)
        if (head, crc32c_of(raw[:head])) != marker.head:
            raise IntegrityError(f"{where}: its head is not the {marker.head[0]} bytes COMMITTED describes")
    if (manifest.attempt, manifest.world_size, manifest.step) != (marker.attempt, marker.world_size, marker.step):
        raise FormatError(
            f"{where}: attempt {manifest.attempt}, {manifest.world_size} ranks, step {manifest.step} disagree with "
            f"COMMITTED (attempt {marker.attempt}, {marker.world_size} ranks, step {marker.step})"
        )
    check_committed_references(marker.references, manifest.references, where)
    return manifest


@dataclass(frozen=True)
class Opening:
    """What opening a checkpoint reads, raw (to hand to other ranks) and checked: COMMITTED and the manifest."""

    marker_raw: bytes
    marker: CommitMarker
    manifest_raw: bytes
    manifest: GlobalManifest


def read_index_entries(
    storage: Storage, marker: CommitMarker, manifest: GlobalManifest, names: Collection[str]
) -> GlobalManifest:
    """A partial manifest (decoded from its head) with the entries of `names` it has added, read from the blocks
    of its piece index that hold them, one range read per run of consecutive blocks (SPEC 11.1); others as given."""
    index = manifest.piece_index
    if index is None or not manifest.partial:
        return manifest
    have = manifest.tensor_index()
    blocks = index.blocks_for(name for name in names if name not in have)
    if not blocks or marker.head is None:
        return manifest
    runs = index.runs(blocks)
    start = marker.head[0]
    data = storage.read_ranges([(marker.manifest, start + at, start + at + size) for _, _, at, size in runs])
    found: dict[int, bytes] = {}
    offsets = index.offsets()
    for (begin, end, at, size), run in zip(runs, data):
        if len(run) != size:  # storage refuses short reads; a backend that did not would leave a block short here
            raise IntegrityError(f"{storage.describe(marker.manifest)}: read {len(run)} of {size} bytes of the index")
        for number in range(begin, end):
            found[number] = run[offsets[number] - at : offsets[number] - at + index.size[number]]
    return decode_index_blocks(manifest, found, storage.describe(marker.manifest))


def read_opening(storage: Storage, *, head_only: bool = False) -> Opening:
    """Read COMMITTED and the global manifest it points at, each once, and check them; NotCommittedError if none.

    head_only: of a manifest with a piece index read only the head (a partial manifest: read_index_entries)."""
    try:
        found = read_marker(storage)
        marker_raw = None if found is None else found[1]
        marker = None if found is None else decode_commit_marker(found[1], storage.describe(found[0]))
    except StorageError as exc:
        raise StorageError(f"cannot read {storage.describe(layout.COMMITTED)}: {exc}") from exc
    if marker_raw is None or marker is None:
        raise not_a_checkpoint(storage)
    if head_only and marker.head is not None:
        # One stat: an object that grew or shrank is not the one COMMITTED sealed, even where the blocks read are.
        size = storage.size(marker.manifest)
        if size != marker.manifest_size:
            raise IntegrityError(
                f"{storage.describe(marker.manifest)}: {size} bytes, but COMMITTED promises {marker.manifest_size}"
            )
        manifest_raw = storage.read_range(marker.manifest, 0, marker.head[0])
    else:
        manifest_raw = storage.read_small(marker.manifest, limits.MAX_GLOBAL_MANIFEST_BYTES)
    where = storage.describe(marker.manifest)
    manifest = verify_global_manifest(manifest_raw, marker, where, head_only=head_only)
    return Opening(marker_raw, marker, manifest_raw, manifest)


# What a URL without a readable COMMITTED holds: the answers of `what_is`.
COMMITTED, INCOMPLETE, BROKEN = "committed", "incomplete", "broken"
MISSING, EMPTY, ROOT, DCP, DEEPSPEED, OTHER = "missing", "empty", "root", "dcp", "deepspeed", "other"
MAX_CHILDREN_LOOKED_AT = 200  # a root with more names is still recognised by its first ones (an error path)


def classify(names: Collection[str], committed: bool, broken: bool) -> str | None:
    """What a directory holding `names` is, for ls and du alike: committed, broken (COMMITTED unreadable),
    incomplete (layout files but no COMMITTED: a failed or running save), or None (not a checkpoint)."""
    if broken:
        return BROKEN
    if committed:
        return COMMITTED
    if layout.COMMITTED in names or layout.DATA_DIR in names or layout.RANKS_DIR in names:
        return INCOMPLETE
    return None


@dataclass(frozen=True)
class Place:
    """What is at a URL: `kind` (one of the names above) and, for a root, the checkpoints directly under it."""

    kind: str
    checkpoints: tuple[str, ...] = ()  # a root's children that are checkpoints (committed or not), sorted


def what_is(storage: Storage) -> Place:
    """Classify the URL behind `storage`: a checkpoint (committed, incomplete, broken) or, when it is none,
    missing, empty, a root of checkpoints, a PyTorch DCP or DeepSpeed checkpoint, or other files.

    Lists the URL (and, to recognise a root, up to MAX_CHILDREN_LOOKED_AT of its children); NotFoundError when
    the backend says the place itself (e.g. the bucket) does not exist."""
    try:
        committed, broken = read_marker_bytes(storage) is not None, False
    except ShardckptError:
        committed, broken = False, True
    if committed:
        try:
            read_commit_marker(storage)
        except ShardckptError:
            committed, broken = False, True
    names = storage.list()
    kind = classify(names, committed, broken)
    if kind is not None:
        return Place(kind)
    if not names:
        return Place(EMPTY if storage.exists("") else MISSING)
    if ".metadata" in names and any(name.endswith(".distcp") for name in names):
        return Place(DCP)
    found = tuple(name for name in names[:MAX_CHILDREN_LOOKED_AT] if classify(storage.child(name).list(), False, False))
    if found:  # checkpoints first: a root of ours may hold a `latest` link or step directories named global_step*
        return Place(ROOT, found)
    # DeepSpeed writes `latest` as a file naming the tag; a `latest` that lists entries is a directory or a link to one
    if ("latest" in names and not storage.child("latest").list()) or any(n.startswith("global_step") for n in names):
        return Place(DEEPSPEED)
    return Place(OTHER)


def does_not_exist(url: str) -> NotFoundError:
    """The one error for a URL with nothing there (a mistyped checkpoint or root), whichever command met it."""
    return NotFoundError(f"{url} does not exist (check the path or URL for a typo)")


def require_exists(storage: Storage) -> None:
    """NotFoundError (does_not_exist) unless something is at `storage`'s URL: every command treats a root or checkpoint
    that does not exist alike, as an error, rather than as one holding no checkpoint or failing a check."""
    if not storage.list() and not storage.exists(""):
        raise does_not_exist(storage.url)


def not_a_checkpoint(storage: Storage) -> ShardckptError:
    """The error for opening `storage` as a checkpoint when it has no COMMITTED marker, saying what is there
    instead and what to do: NotFoundError when nothing is there, NotCommittedError otherwise."""
    url = storage.url
    place = what_is(storage)
    if place.kind == MISSING:
        return does_not_exist(url)
    if place.kind == ROOT:
        shown = ", ".join(place.checkpoints[-3:])
        return NotCommittedError(
            f"{url} is not a checkpoint but a root of {len(place.checkpoints)} checkpoint(s) (e.g. {shown}): "
            f"open one of them (shardckpt.latest({url!r}) names the newest committed one; `shardckpt ls {url}` "
            "lists them)"
        )
    if place.kind == DCP:
        return NotCommittedError(
            f"{url} is a PyTorch DCP checkpoint (.metadata and .distcp files), not a shardckpt one: convert it "
            f"with `shardckpt import-dcp {url} NEW_URL`"
        )
    if place.kind == DEEPSPEED:
        return NotCommittedError(
            f"{url} looks like a DeepSpeed checkpoint directory (latest, global_step*), not a shardckpt one: "
            f"convert it with `shardckpt import-deepspeed {url} NEW_URL`"
        )
    if place.kind == EMPTY:
        return NotCommittedError(f"{url} exists but is empty: no checkpoint was saved here (yet)")
    if place.kind == OTHER:
        return NotCommittedError(f"{url} is not a checkpoint: it holds no {layout.COMMITTED}, data/ or ranks/")
    if place.kind == BROKEN:
        return NotCommittedError(f"{url}: its {layout.COMMITTED} marker is unreadable (run `shardckpt verify {url}`)")
    return NotCommittedError(
        f"{url} is not committed (no {layout.COMMITTED} marker): the save is incomplete, failed, or still running"
    )
