"""The commit: gather every rank's local manifest, prove exact coverage, write the global manifest, then COMMITTED.

(coordinator only) 1. read or receive the W local manifests of one attempt and check each against its data file;
2. validate: same dtype/shape/layout on every rank, pieces cover every tensor exactly once;
3. write manifest-<attempt>.msgpack (create-only); 4. (1.1) re-check that every referenced checkpoint is still
committed by the referenced attempt; 5. create COMMITTED atomically — always the last write.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shardckpt import knobs
from shardckpt.catalog.chain import read_commit_marker, read_global_manifest, read_marker, read_markers
from shardckpt.catalog.claims import BY_COMMIT, CREATED, claim, missing_files, release
from shardckpt.crashpoints import check_crash_at, crash_point
from shardckpt.errors import (
    AlreadyExistsError,
    CommitConflictError,
    CoverageError,
    FormatError,
    IntegrityError,
    NotFoundError,
)
from shardckpt.format import layout, limits
from shardckpt.format.bulk import gc_paused
from shardckpt.format.compressed import FIRST_VERSION as COMPRESSED_VERSION
from shardckpt.format.local_manifest import LocalManifest, decode_local_manifest
from shardckpt.format.manifest import (
    CommitMarker,
    FileEntry,
    GlobalManifest,
    crc32c_of,
    decode_commit_marker,
    decode_global_manifest,
    encode_commit_marker,
    encode_global_manifest,
    manifest_head_size,
)
from shardckpt.format.piece_index import FIRST_VERSION as INDEX_VERSION
from shardckpt.format.references import FIRST_VERSION, GlobalReference, committed_references
from shardckpt.format.strict import FORMAT_VERSION
from shardckpt.storage import Storage, open_storage
from shardckpt.write.merge import merge_objects, merge_tensors
from shardckpt.write.parent import check_referenced_files, recheck_referenced, split_url


@gc_paused()
def commit(
    url: str | Storage,
    *,
    world_size: int | None = None,
    attempt: str | None = None,
    step: int | None = None,
    metadata: dict[str, Any] | None = None,
    local_manifests: Sequence[bytes] | None = None,
    storage_options: dict[str, Any] | None = None,
    root: Storage | None = None,
    supersede: bool = False,
    piece_index: bool | None = None,
) -> GlobalManifest:
    """Validate the local manifests of one attempt and commit the checkpoint at `url` atomically.

    root: the storage of the directory that holds `url`, where the checkpoints that pieces are stored by reference
    in live (default: the parent directory of `url`). Such a commit first checks that every referenced data file
    has its size and, just before COMMITTED, that every referenced checkpoint is still committed by the referenced
    attempt (NotCommittedError otherwise: nothing is committed).

    `local_manifests`: the encoded local manifests, rank-ordered, when the caller gathered them (distributed
    saves); otherwise they are read from storage. Re-committing the attempt that already committed (or whose
    global manifest a failed commit already wrote) reuses what it recorded: a `step` or `metadata` given here
    must equal the recorded one (None keeps it), else CommitConflictError, as for any other attempt.

    supersede: where another attempt is committed already, commit this one as its successor (SPEC 14.2: the next
    COMMITTED-<g>, created only if absent) instead of raising CommitConflictError; the superseded attempt's files
    stay until a collector finds them older than its grace period.

    piece_index: write the manifest with a piece index (format 1.2, SPEC 11.1: a loading rank reads the metadata of
    its own tensors only); None: when the checkpoint has knobs.PIECE_INDEX_MIN_TENSORS tensors or more.
    """
    check_crash_at()  # a misspelt point is refused before the checks, not after the global manifest is written
    storage = open_storage(url, storage_options)
    committed = _existing_commit(storage, attempt, step, metadata, supersede)
    if committed is not None:
        return committed
    if local_manifests is None:
        attempt = attempt or _find_attempt(storage, world_size)
        local_manifests = _read_local_manifests(storage, attempt, world_size)
    locals_ = _decode_all(storage, local_manifests, attempt, world_size)
    attempt, world_size = locals_[0].attempt, locals_[0].world_size
    _check_data_files(storage, locals_)
    references = tuple(
        GlobalReference(m.rank, file) for m in locals_ if m.references is not None for file in m.references.files
    )
    if references:
        root = root if root is not None else open_storage(split_url(storage.url)[0], storage_options)
        check_referenced_files(root, [entry.file for entry in references], storage.url)
    tensors = merge_tensors(locals_)
    if piece_index is None:
        piece_index = len(tensors) >= knobs.PIECE_INDEX_MIN_TENSORS
    version = max(
        FIRST_VERSION if references else FORMAT_VERSION,
        COMPRESSED_VERSION if _compressed(locals_, references) else FORMAT_VERSION,
    )
    manifest = GlobalManifest(
        attempt=attempt,
        world_size=world_size,
        block_size=_agree(locals_, "block_size"),
        files=tuple(
            FileEntry(
                m.rank,
                m.data,
                m.data_size,
                layout.local_manifest_path(m.rank, attempt),
                len(raw),
                crc32c_of(raw),
                None if m.compression is None else m.compression.logical_size,
            )
            for m, raw in zip(locals_, local_manifests)
        ),
        tensors=tensors,
        objects=merge_objects(locals_),
        step=step if step is not None else _agree(locals_, "step"),
        created=time.time(),
        metadata=dict(metadata or {}),
        version=INDEX_VERSION if piece_index else version,
        references=references,
        index_block=max(1, knobs.PIECE_INDEX_BLOCK) if piece_index else 0,
    )
    clash = {o.name for o in manifest.objects} & {t.name for t in manifest.tensors}
    if clash:  # a reader refuses the manifest (SPEC 7): commit nothing rather than a checkpoint nobody opens
        raise FormatError(
            f"{storage.url}: {min(clash)!r} is the name of a tensor and of an object of attempt {attempt}"
        )
    crash_point("before_global_manifest")
    manifest, encoded = _write_manifest(storage, manifest, step, metadata)
    crash_point("before_commit")
    # A collector takes a save paused for longer than its grace period for an abandoned one (SPEC 14): claim the
    # attempt, then check that nothing of it was collected before the claim; from then on no collector touches it.
    claimed = claim(storage, attempt, BY_COMMIT)
    if not claimed:
        raise CommitConflictError(
            f"{storage.url}: a collector claimed attempt {attempt} as an abandoned save (the save was held up for "
            "longer than gc's grace period) and deletes its files: nothing was committed; save again"
        )
    try:
        missing = missing_files(storage, attempt, world_size)
        if missing:
            raise CommitConflictError(
                f"{storage.url}: {len(missing)} file(s) of attempt {attempt} are gone (e.g. {missing[0]}): a collector "
                "took the save, held up for longer than its grace period, for an abandoned one; nothing was "
                "committed; save again"
            )
        committed = _create_marker(storage, manifest, encoded, attempt, step, metadata, root, supersede)
    except BaseException:
        if claimed == CREATED:  # a claim found held may be a concurrent committer's: its own to release
            release(storage, attempt, BY_COMMIT)
        raise
    if claimed == CREATED:
        # Committed: no collector takes a committed attempt, so the claim has done its job. Released, it cannot
        # outlive COMMITTED (retention deletes COMMITTED first) and make the attempt's files look mid-commit.
        release(storage, attempt, BY_COMMIT)
    return committed


def _create_marker(
    storage: Storage,
    manifest: GlobalManifest,
    encoded: bytes,
    attempt: str,
    step: int | None,
    metadata: dict[str, Any] | None,
    root: Storage | None,
    supersede: bool,
) -> GlobalManifest:
    """(holding the commit's claim) Re-check the referenced checkpoints, then create COMMITTED (or, superseding,
    the next successor marker): the last write."""
    if manifest.references:
        # A collector may have deleted a referenced checkpoint since the save chose it (SPEC 9 phase 3, 14).
        assert root is not None
        recheck_referenced(root, committed_references(manifest.references), storage.url)
    marker_bytes = encode_commit_marker(marker_for(manifest, encoded))
    name = _next_marker(storage) if supersede else layout.COMMITTED
    try:
        storage.commit_marker(name, marker_bytes)
    except AlreadyExistsError:
        # A concurrent committer won the race: success only if it committed this very manifest.
        winner = _existing_commit(storage, attempt, step, metadata, False)
        if winner is None:
            raise
        return winner
    # Never report success for a marker that does not read back.
    if storage.read_small(name, limits.MAX_COMMIT_MARKER_BYTES) != marker_bytes:
        raise IntegrityError(f"{storage.describe(name)} does not hold the marker bytes just written")
    # The manifest just validated and written (its bytes read back equal): decoding them again would only cost.
    return manifest


def marker_for(manifest: GlobalManifest, encoded: bytes) -> CommitMarker:
    """The COMMITTED that commits `manifest`, whose encoded bytes are `encoded` (SPEC 9, appendix C)."""
    return CommitMarker(
        attempt=manifest.attempt,
        manifest=layout.global_manifest_path(manifest.attempt),
        manifest_size=len(encoded),
        manifest_crc32c=crc32c_of(encoded),
        world_size=manifest.world_size,
        total_bytes=manifest.total_bytes,
        step=manifest.step,
        created=manifest.created,
        version=manifest.version,
        references=committed_references(manifest.references),
        head=_head(manifest, encoded),
    )


def _head(manifest: GlobalManifest, encoded: bytes) -> tuple[int, int] | None:
    """(size, CRC32C) of the head of a manifest with a piece index, what a loading rank reads first (SPEC 11.1)."""
    if manifest.piece_index is None and not manifest.index_block:
        return None
    size = manifest_head_size(encoded)
    return size, crc32c_of(encoded[:size])


def _next_marker(storage: Storage) -> str:
    """The name of the marker that supersedes the newest one (COMMITTED when there is none yet)."""
    found = read_marker(storage)
    if found is None:
        return layout.COMMITTED
    generation = layout.marker_generation(found[0])
    assert generation is not None  # read_marker only reads marker names
    if generation >= limits.MAX_MARKER_GENERATION:
        raise AlreadyExistsError(
            f"{storage.url} was superseded {generation - 1} times, the most SPEC 14.2 allows: save to a new URL"
        )
    return layout.marker_name(generation + 1)


def _existing_commit(
    storage: Storage, attempt: str | None, step: int | None, metadata: dict[str, Any] | None, supersede: bool
) -> GlobalManifest | None:
    marker = read_commit_marker(storage)
    if marker is None:
        return None
    if supersede and attempt is not None and marker.attempt != attempt:
        # Another attempt's checkpoint: this one commits as its successor, unless it was committed before and
        # superseded since (a retried commit must not bring it back over the newer save).
        for name, raw in read_markers(storage)[:-1]:
            if decode_commit_marker(raw, storage.describe(name)).attempt == attempt:
                raise CommitConflictError(
                    f"{storage.describe(name)}: attempt {attempt} was committed and has since been superseded by "
                    f"attempt {marker.attempt}; it is not committed again"
                )
        return None
    if attempt is None or marker.attempt == attempt:
        # Committing what is already committed is a no-op (a retried commit after a lost reply).
        committed = read_global_manifest(storage, marker)
        _refuse_changes(storage.describe(layout.COMMITTED), committed, step, metadata)
        return committed
    raise CommitConflictError(
        f"{storage.url} is already committed by attempt {marker.attempt} (step {marker.step}); " + SAVE_ELSEWHERE
    )


SAVE_ELSEWHERE = (
    "a committed checkpoint never changes: save to a new URL (one per step, e.g. ROOT/step-00000100), or let "
    "shardckpt.Checkpointer(ROOT, every_steps=N) name, save and prune them (its maybe_save(step, state) each step; "
    "shardckpt.latest(ROOT) finds the newest)"
)


def already_committed(url: str) -> str:
    """The refusal of a save into a committed checkpoint (shardckpt.save, the DCP writer), with the way out."""
    return f"{url} already holds a committed checkpoint; {SAVE_ELSEWHERE}"


def _find_attempt(storage: Storage, world_size: int | None) -> str:
    """The one attempt whose local manifests are all present, when the caller did not name it."""
    ranks: dict[str, set[int]] = defaultdict(set)
    for name in storage.list(layout.RANKS_DIR):
        try:
            rank, attempt = layout.parse_local_manifest_path(f"{layout.RANKS_DIR}/{name}")
        except FormatError:
            continue  # not ours (an editor's swap file, a temp file): never a reason to fail a commit
        ranks[attempt].add(rank)
    if not ranks:
        raise CoverageError(f"{storage.url}: no local manifest found under {layout.RANKS_DIR}/; nothing to commit")
    complete = [a for a, found in ranks.items() if found == set(range(world_size or _world_size_of(storage, a)))]
    if len(complete) == 1:
        return complete[0]
    summary = "; ".join(f"attempt {a}: ranks {sorted(r)}" for a, r in sorted(ranks.items()))
    if not complete:
        raise CoverageError(f"{storage.url}: no attempt has the local manifests of every rank ({summary})")
    raise CoverageError(f"{storage.url}: several complete attempts, pass attempt= to choose ({summary})")


def _world_size_of(storage: Storage, attempt: str) -> int:
    """The world size rank 0 of `attempt` recorded (0 when rank 0 left no readable manifest)."""
    path = layout.local_manifest_path(0, attempt)
    try:
        raw = storage.read_small(path, limits.MAX_LOCAL_MANIFEST_BYTES)
        return decode_local_manifest(raw, storage.describe(path)).world_size
    except (NotFoundError, FormatError):
        return 0


def _read_local_manifests(storage: Storage, attempt: str, world_size: int | None) -> list[bytes]:
    if world_size is None:
        first = decode_local_manifest(
            storage.read_small(layout.local_manifest_path(0, attempt), limits.MAX_LOCAL_MANIFEST_BYTES),
            storage.describe(layout.local_manifest_path(0, attempt)),
        )
        world_size = first.world_size
    paths = [layout.local_manifest_path(rank, attempt) for rank in range(world_size)]

    def read(path: str) -> bytes:
        try:
            return storage.read_small(path, limits.MAX_LOCAL_MANIFEST_BYTES)
        except NotFoundError:
            raise CoverageError(
                f"{storage.describe(path)} is missing: that rank did not finish its part of attempt {attempt}"
            ) from None

    with ThreadPoolExecutor(max_workers=min(16, len(paths))) as pool:
        return list(pool.map(read, paths))


def _decode_all(
    storage: Storage, raws: Sequence[bytes], attempt: str | None, world_size: int | None
) -> list[LocalManifest]:
    if not raws:
        raise CoverageError(f"{storage.url}: no local manifests to commit")
    manifests = []
    for index, raw in enumerate(raws):
        where = storage.describe(layout.local_manifest_path(index, attempt or "0"))
        manifest = decode_local_manifest(raw, where)
        expected = (attempt or manifest.attempt, world_size or len(raws), index)
        if (manifest.attempt, manifest.world_size, manifest.rank) != expected:
            raise CoverageError(
                f"{where}: belongs to attempt {manifest.attempt}, rank {manifest.rank} of {manifest.world_size}; "
                f"expected attempt {expected[0]}, rank {index} of {expected[1]}"
            )
        attempt = manifest.attempt
        manifests.append(manifest)
    if len(manifests) != manifests[0].world_size:
        raise CoverageError(f"{storage.url}: {len(manifests)} local manifests for world size {manifests[0].world_size}")
    return manifests


def _check_data_files(storage: Storage, manifests: list[LocalManifest]) -> None:
    def size(manifest: LocalManifest) -> None:
        try:
            actual = storage.size(manifest.data)
        except NotFoundError:
            raise IntegrityError(
                f"{storage.describe(manifest.data)} is missing (rank {manifest.rank}): its local manifest names "
                f"it, but it is not in this checkpoint. A rank that saved to another URL than the coordinator's "
                f"(every rank must save to the same checkpoint), or a file removed while the save ran"
            ) from None
        if actual != manifest.data_size:
            raise IntegrityError(
                f"{storage.describe(manifest.data)} is {actual} bytes but its local manifest says "
                f"{manifest.data_size} (truncated or still being written)"
            )

    with ThreadPoolExecutor(max_workers=min(16, len(manifests))) as pool:
        list(pool.map(size, manifests))


def _agree(manifests: list[LocalManifest], field: str) -> Any:
    values = {getattr(m, field) for m in manifests}
    if len(values) != 1:
        raise CoverageError(f"ranks disagree on {field}: {sorted(values, key=repr)}")
    return values.pop()


def _refuse_changes(where: str, recorded: GlobalManifest, step: int | None, metadata: dict[str, Any] | None) -> None:
    """CommitConflictError when a retried commit names another step or metadata than its attempt recorded.

    Neither can change once written (nothing is overwritten), and COMMITTED must agree with the manifest.
    """
    if step is not None and step != recorded.step:
        raise CommitConflictError(
            f"{where}: attempt {recorded.attempt} already recorded step {recorded.step}; this commit asks for step "
            f"{step}, which a committed or half-committed attempt cannot change: save again to a new URL"
        )
    if metadata is not None and dict(metadata) != recorded.metadata:
        raise CommitConflictError(
            f"{where}: attempt {recorded.attempt} already recorded metadata {recorded.metadata!r}; this commit asks "
            f"for {dict(metadata)!r}, which a committed or half-committed attempt cannot change: save again to a "
            "new URL"
        )


def _write_manifest(
    storage: Storage, manifest: GlobalManifest, step: int | None, metadata: dict[str, Any] | None
) -> tuple[GlobalManifest, bytes]:
    """The global manifest written now, or the one an earlier commit of this attempt left (and its bytes)."""
    path = layout.global_manifest_path(manifest.attempt)
    encoded = encode_global_manifest(manifest)
    try:
        storage.write_new(path, encoded)
        if storage.read_small(path, limits.MAX_GLOBAL_MANIFEST_BYTES) != encoded:
            raise IntegrityError(f"{storage.describe(path)} does not hold the bytes just written")
    except AlreadyExistsError:
        # A coordinator of this attempt died between manifest and COMMITTED, or is writing it right now: reuse its
        # manifest if it describes the same files (nothing is ever overwritten).
        previous, existing = _existing_manifest(storage, path)
        if previous.files != manifest.files:
            raise CommitConflictError(f"{storage.describe(path)} exists and describes other files") from None
        _refuse_changes(storage.describe(path), previous, step, metadata)
        return previous, existing
    return manifest, encoded


# A manifest that does not decode may be one a concurrent committer of the same attempt is still writing: look
# again until its bytes have not changed for MANIFEST_SETTLE seconds (then it is what a dead writer left).
MANIFEST_SETTLE = knobs.MANIFEST_SETTLE
MANIFEST_WAIT = knobs.MANIFEST_WAIT


def _existing_manifest(storage: Storage, path: str) -> tuple[GlobalManifest, bytes]:
    """The global manifest already at `path`, decoded, once it has stopped changing; FormatError if it never does."""
    deadline = time.monotonic() + MANIFEST_WAIT
    last, settled = b"", time.monotonic()
    while True:
        existing = storage.read_small(path, limits.MAX_GLOBAL_MANIFEST_BYTES)
        try:
            return decode_global_manifest(existing, storage.describe(path)), existing
        except FormatError:
            now = time.monotonic()
            if existing != last:
                last, settled = existing, now
            if now - settled >= MANIFEST_SETTLE or now >= deadline:
                raise
            time.sleep(0.01)


def _compressed(locals_: Sequence[LocalManifest], references: Sequence[GlobalReference]) -> bool:
    """Whether the checkpoint describes a compressed data file: its own, or one it references (SPEC 4.1, 6.2)."""
    return any(m.compression is not None for m in locals_) or any(e.file.logical_size is not None for e in references)
