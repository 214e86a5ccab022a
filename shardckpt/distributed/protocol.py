"""The save and load protocols over a process group (or one process): who writes, who commits, who learns what.

save: (coordinator) refuse an existing checkpoint, draw the attempt -> (all) write own pieces -> (coordinator)
gather local manifests, validate, commit -> (all) learn the outcome. load: (coordinator) read COMMITTED and the
manifest once -> (all) receive them, plan and read only their own boxes -> (all) agree that every rank succeeded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch.distributed as dist

from shardckpt import knobs
from shardckpt.catalog.chain import Opening, read_opening, verify_global_manifest
from shardckpt.crashpoints import check_crash_at
from shardckpt.distributed.collectives import Group, any_ranks
from shardckpt.distributed.group_calls import Solo as _Solo
from shardckpt.distributed.group_calls import agree_on_coordinator as _agree_on_coordinator
from shardckpt.distributed.group_calls import all_gather as _all_gather
from shardckpt.distributed.group_calls import broadcast as _broadcast
from shardckpt.distributed.group_calls import collective as _collective
from shardckpt.distributed.group_calls import describe as _describe
from shardckpt.distributed.group_calls import gather as _gather
from shardckpt.distributed.group_calls import pack as _pack
from shardckpt.distributed.group_calls import unpack as _unpack
from shardckpt.distributed.group_calls import vote as _any_rank
from shardckpt.distributed.host_memory import PeerFailed
from shardckpt.distributed.shared_reads import Exchange, fetch_shared, plan_exchange
from shardckpt.errors import AlreadyExistsError, DistributedError, ShardckptUsageError
from shardckpt.format import layout
from shardckpt.format.bulk import gc_paused
from shardckpt.format.codec import check_codec
from shardckpt.format.manifest import (
    GlobalManifest,
    decode_commit_marker,
    decode_global_manifest,
    encode_global_manifest,
)
from shardckpt.format.values import check_plain, pack_value
from shardckpt.read.checkpoint import Checkpoint, PendingRead, ReadStats, check_read_limits, open_checkpoint
from shardckpt.statedict.flatten import Leaf, flatten
from shardckpt.statedict.leaves import (
    PerRank,
    check_savable,
    destination_shapes,
    load_items,
    per_rank_value,
    save_items,
)
from shardckpt.statedict.optimizer import optimizer_hint
from shardckpt.statedict.replicas import Digest, replica_digest, replica_disagreements
from shardckpt.statedict.stateful import loadable_states, saved_states
from shardckpt.statedict.step import NoStepWarning, inferred_step, no_step_message
from shardckpt.storage import Storage, open_storage
from shardckpt.write.commit import already_committed, commit
from shardckpt.write.encode_ahead import given_pace
from shardckpt.write.parent import open_parent, parent_of, piece_boxes
from shardckpt.write.writer import ShardWriter

F = TypeVar("F", bound=Callable[..., Any])


def _collector_paused_on_the_calling_thread(function: F) -> F:
    """Run a save or load with the cycle collector paused (100,000 tensors: 7.1 -> 4.8 s per load measured), but
    only on the main thread: an async save's background thread must not stop collection for the training thread."""

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return function(*args, **kwargs)
        with gc_paused():
            return function(*args, **kwargs)

    return run  # type: ignore[return-value]


def resolve_group(process_group: Any) -> Group | _Solo:
    """The caller's group, else the default group when torch.distributed is initialized, else one process.

    ShardckptUsageError when the environment says this process is one rank of many (torchrun's WORLD_SIZE > 1)
    but there is no group: each rank would save a one-rank checkpoint to the same URL, or load whole tensors.
    """
    if process_group is None and dist.is_available() and dist.is_initialized():
        process_group = dist.group.WORLD
    if process_group is None:
        world = _launcher_world_size()
        if world > 1:
            raise ShardckptUsageError(
                f"this process is rank {os.environ.get('RANK', '?')} of {world} (WORLD_SIZE={world}, as torchrun "
                "sets it) but torch.distributed is not initialized: call torch.distributed.init_process_group() "
                "before shardckpt.save/load/Checkpointer, or pass process_group="
            )
        return _Solo()
    group = Group.of(process_group)
    return _Solo() if group.size == 1 else group


def _launcher_world_size() -> int:
    """WORLD_SIZE as a launcher (torchrun, mpirun wrappers, SLURM scripts) exported it; 1 when unset or unreadable."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


@_collector_paused_on_the_calling_thread
def save(
    state_dict: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
    url: str | Storage,
    *,
    process_group: Any = None,
    coordinator: int = 0,
    storage_options: dict[str, Any] | None = None,
    step: int | None = None,
    metadata: dict[str, Any] | None = None,
    block_size: int | None = None,
    parent: str | None = None,
    piece_hashes: bool | None = None,
    compression: str | None = None,
    compression_pace: str | None = None,
) -> GlobalManifest:
    """Save `state_dict` as a committed checkpoint at `url` (a new location); collective over the group.

    Every rank writes its own pieces: DTensor shards, its share of replicated tensors, FlatPartition slices.
    Plain values are shared (all ranks must agree); wrap a value in PerRank to keep one per rank. Returns when
    the checkpoint is durable and committed; on any failure every rank raises the same DistributedError.
    process_group: the group to save over; default: the default group if torch.distributed is initialized.
    coordinator: the rank that commits; the same on every rank (else every rank raises ShardckptUsageError).
    step, metadata and block_size: the same on every rank too (compared before any byte is written: ranks that
    differ all raise ShardckptUsageError naming each value and its ranks).
    block_size: bytes per CRC32C block (the granularity of verified reads), a power of two in 4 KiB..64 MiB; None
    (default): SHARDCKPT_BLOCK_SIZE, else 64 KiB.
    metadata: plain values recorded in the global manifest (Checkpoint.manifest.metadata).
    state_dict may be a callable returning the state: it is built inside the protocol, so a failure to build it
    on one rank reaches every rank.
    step: recorded in COMMITTED, it orders latest(), ls, retention and gc; without it, the state's top-level 'step',
    'global_step' or 'iteration' (an int or a 0-d integer tensor; or one such entry in exactly one top-level dict,
    as {"trainer": {"step": N}}), else the number in the URL's last segment
    (step-N, step_N, global_stepN, iter_N, checkpoint-N); with neither, the checkpoint ranks below every checkpoint
    of its root that has a step, whatever its commit time (a NoStepWarning says so).
    parent: the URL of a committed checkpoint in the same root as `url` (an incremental save, format 1.1): every
    piece whose bytes hash equal to the parent's piece of the same tensor and box is stored by reference to the
    file that holds it, the others are written; any world size. Before committing, the coordinator checks that
    every referenced checkpoint is still committed (else the save fails and commits nothing).
    piece_hashes: record each piece's hash (format 1.1), so that a later save can use this one as its parent;
    default: when `parent` is given or SHARDCKPT_PIECE_HASHES=1. A parent saved without them is referenced in
    nothing (the save writes every piece again and warns): save the first checkpoint of a series with
    piece_hashes=True, or use Checkpointer(incremental=True), which hashes every save. Not on by default because
    BLAKE3 over every piece made a full save take 23-59% longer on 2 busy cores (`make bench`'s piece-hash probe;
    +4% on idle cores, where the hash threads run beside the write).
    compression: "zstd" stores every checksum block losslessly compressed (format 1.2, SPEC 4.1: bytes grouped by
    significance, then zstd; a block that does not shrink is stored raw); the level is SHARDCKPT_COMPRESSION_LEVEL.
    None (default): raw. Every reader of this build reads either; older readers refuse a compressed checkpoint.
    compression_pace: "codec" (default; "storage" with SHARDCKPT_COMPRESSION_STORAGE_PACE=1) tries every block;
    "storage" never lets the disk wait for the codec: a block no encoder has finished when the writer reaches it is
    stored raw (local disk; the ratio then depends on the cores left over). Reads are the same either way. Only with
    compression="zstd": given without it, a ShardckptUsageError (the knob is ignored there).
    """
    group = resolve_group(process_group)
    # The manifest records one step, one metadata and one block size, the coordinator's: every rank must pass the
    # same (compression, its pace, piece_hashes and the URL's spelling may differ; each rank writes its own files).
    solo = isinstance(group, _Solo)
    # None is SHARDCKPT_BLOCK_SIZE, read here and not at import, so that a load never fails over it. A refused value
    # is compared as "not valid" (ranks whose environments differ all raise) and raised in the first step below,
    # which carries it to every rank.
    bad_knob: ShardckptUsageError | None = None
    try:
        block_size = knobs.BLOCK_SIZE if block_size is None else block_size
    except ShardckptUsageError as exc:
        bad_knob = exc
    compared = block_size if bad_knob is None else bad_knob
    same = None if solo else {"step": step, "metadata": _metadata_digest(metadata), "block_size": compared}
    coordinator = _agree_on_coordinator(group, coordinator, "save", same)
    # Whatever fails on one rank (its storage, its state dict, the coordinator's existence check) is carried
    # through the protocol's own collectives, so every rank raises the same DistributedError, never waits.
    local_error: BaseException | None = None
    storage: Storage | None = None
    root: Storage | None = None
    parent_name = ""
    leaves: list[Leaf] = []
    digest: Digest = []
    try:
        check_crash_at()  # before any rank writes a byte, as the arguments below
        if bad_knob is not None:
            raise bad_knob
        check_codec(compression)  # before any rank writes a byte
        given_pace(compression_pace, compression)
        storage = open_storage(url, storage_options)
        if parent is not None:
            root, parent_name = parent_of(storage.url, parent, storage_options)
        if metadata is not None:
            check_plain(metadata, "metadata")  # before any rank writes a byte, not at commit
        # A callable state is built here, so that its failure on one rank reaches every rank like any other.
        built = saved_states(state_dict() if callable(state_dict) else state_dict)
        if step is None and isinstance(built, Mapping):
            step = inferred_step(built, storage.url)
            if step is None and group.rank == coordinator:
                warnings.warn(no_step_message(storage.url), NoStepWarning, stacklevel=3)
        leaves = flatten(built)
        check_savable(leaves, step)  # every entry checked before any rank writes a byte
        digest = [] if solo else replica_digest(leaves)
    except Exception as exc:
        if solo:
            raise
        local_error = exc
    opening = None
    if group.rank == coordinator:
        try:
            if local_error is not None:
                raise local_error
            assert storage is not None
            refused = storage.exists(layout.COMMITTED)
            opening = _pack(
                {"refused": already_committed(storage.url)} if refused else {"attempt": layout.new_attempt()}
            )
        except Exception as exc:
            if solo:
                raise
            opening = _pack({"failures": {coordinator: _describe(exc)}})
    message = _unpack(_broadcast(group, opening, coordinator))
    if "failures" in message:
        raise DistributedError("save", {int(r): cause for r, cause in message["failures"].items()}) from local_error
    if "refused" in message:
        raise AlreadyExistsError(message["refused"])
    attempt = message["attempt"]
    try:
        if local_error is not None:
            raise local_error
        assert storage is not None
        items = save_items(leaves, group.rank, group.size)
        # Every rank reads the parent's manifests it needs itself (its own boxes): nothing to ship between ranks.
        parent_pieces = (
            None
            if root is None
            else open_parent(root, parent_name, {name for name, _, _ in items.pieces}, piece_boxes(items.pieces))
        )
        writer = ShardWriter(
            storage,
            rank=group.rank,
            world_size=group.size,
            attempt=attempt,
            block_size=block_size,
            step=step,
            parent=parent_pieces,
            piece_hashes=piece_hashes,
            compression=compression,
            compression_pace=compression_pace,
        )
        for name, tensor, placement in items.pieces:
            writer.add(name, tensor, **placement)
        for name, value, per_rank in items.objects:
            writer.add_object(name, value, per_rank=per_rank)
        writer.close()
        assert writer.encoded_manifest is not None
        payload = _pack({"manifest": writer.encoded_manifest, "replicas": digest})
    except Exception as exc:
        if solo:
            raise
        local_error = exc
        payload = _pack({"error": _describe(exc)})
    gathered = _gather(group, payload, coordinator)
    outcome = None
    committed: GlobalManifest | None = None
    if group.rank == coordinator:
        assert gathered is not None and storage is not None
        try:
            reply = _commit_gathered(storage, gathered, coordinator, attempt, step, metadata, root)
            committed = reply.get("manifest")
            if committed is not None:
                # The coordinator keeps what commit built; the others decode it (a solo save has no others).
                reply = {"manifest": b"" if solo else encode_global_manifest(committed)}
            outcome = _pack(reply)
        except Exception as exc:
            if solo:
                raise
            outcome = _pack({"failures": {coordinator: _describe(exc)}})
    result = _unpack(_broadcast(group, outcome, coordinator))
    if "failures" in result:
        raise DistributedError("save", {int(r): cause for r, cause in result["failures"].items()}) from local_error
    if committed is not None:
        return committed
    where = storage.describe(layout.global_manifest_path(attempt)) if storage is not None else str(url)
    return decode_global_manifest(result["manifest"], where)


def _metadata_digest(metadata: object) -> object:
    """What the ranks compare of `metadata=`: its encoding, or itself when it has none (each rank's own check of the
    value then says why, before any byte is written)."""
    if metadata is None:
        return None
    try:
        return pack_value(_key_ordered(metadata))
    except Exception:
        return metadata


def _key_ordered(value: object) -> object:
    """`value` with every dict's items in one order, so that equal metadata built in another order on another rank
    encodes alike (the coordinator's is what is committed, as given)."""
    if type(value) is dict:
        items = [(key, _key_ordered(item)) for key, item in value.items()]
        with contextlib.suppress(TypeError):  # keys of one type that do not order: compared as given
            items = sorted(items, key=lambda pair: (type(pair[0]).__name__, pair[0]))
        return dict(items)
    if type(value) is list:
        return [_key_ordered(item) for item in value]
    if type(value) is tuple:
        return tuple(_key_ordered(item) for item in value)
    return value


def _commit_gathered(
    storage: Storage,
    gathered: list[bytes],
    coordinator: int,
    attempt: str,
    step: int | None,
    metadata: dict[str, Any] | None,
    root: Storage | None = None,
) -> dict[str, Any]:
    """(coordinator) The outcome of a save from every rank's reply: the ranks' failures, or the committed manifest.

    Nothing is committed unless every rank wrote its part and all hold the same values saved once for all ranks.
    """
    replies = [_unpack(reply) for reply in gathered]
    failures = {rank: reply["error"] for rank, reply in enumerate(replies) if "error" in reply}
    if not failures:
        failures = replica_disagreements([reply["replicas"] for reply in replies], coordinator)
    if failures:
        return {"failures": failures}
    manifest = commit(
        storage,
        world_size=len(replies),
        attempt=attempt,
        step=step,
        metadata=metadata,
        local_manifests=[reply["manifest"] for reply in replies],
        root=root,
    )
    return {"manifest": manifest}


@_collector_paused_on_the_calling_thread
def load(
    state_dict: Mapping[str, Any],
    url: str | Storage,
    *,
    process_group: Any = None,
    coordinator: int = 0,
    storage_options: dict[str, Any] | None = None,
    strict: bool = True,
    max_in_flight: int | None = None,
    verify_first: bool = False,
    optional: Sequence[str] = (),
    max_gap: int | None = None,
    cast: bool = False,
    share_reads: bool | None = None,
) -> ReadStats:
    """Fill the tensors of `state_dict` in place from the checkpoint at `url`, on any world size and sharding.

    Each rank reads only the boxes its tensors hold (DTensor shards are filled through their local tensor)
    and restores plain values (PerRank values: its own). strict: every entry must be in the checkpoint.
    coordinator: the rank that reads COMMITTED and the global manifest for all; the same on every rank (else every
    rank raises ShardckptUsageError).

    After a failed load (a ShardckptError; DistributedError over a group) the caller's state holds:
    - nothing new, when the failure is in what every rank checks before it writes a byte: COMMITTED, the global
      and local manifests (checksums, sizes, decoding), coverage, a missing entry (strict), a destination of the
      wrong shape or dtype;
    - when data bytes fail (a block checksum, a short read, a missing or unreadable data file): plain values
      untouched, and each destination element either its old value or its value in the checkpoint, never any
      other (a block is copied only after its checksum matched), but which elements were written is unspecified:
      a tensor may be partly written. GPU destinations are filled from host staging only at the end: untouched.
    - verify_first=True: nothing new at all. Every rank fetches and verifies every byte it needs, the ranks agree
      that all succeeded, and only then are destinations and plain values written. Costs memory: the fetched
      bytes (about the size of the rank's destinations) are held until then, whatever max_in_flight says.
    Over a group without verify_first, a rank whose own reads succeeded has written all of its tensors and values
    even when another rank failed.
    optional: entry names (or prefixes before a '.') that strict lets the checkpoint lack; such entries keep
    their values (e.g. another engine's counters when a checkpoint crosses from FSDP2 to DeepSpeed).
    max_gap: bytes between two needed ranges of a file read through rather than split into two requests.
    cast: fill floating-point destinations of another dtype (fp32 stored, a bf16 model) by converting, rounding to
    nearest even (values beyond the destination's range become inf); without it a dtype mismatch is refused.
    Destinations of the stored dtype stay bit-exact. Costs host memory: each converted box is read into staging
    of the stored dtype first.
    share_reads: each stored byte that several ranks need (replicas: HSDP, DDP, replicated norms, plain tensors
    every rank loads) is fetched by one of them and handed to the others (through shared memory between ranks of
    one host, through the group between hosts), so the job reads every byte once; each rank still verifies every
    block it uses, and copies each read request out as soon as it is whole (memory: max_in_flight for the exchange,
    plus requests still arriving). None (the default): share when the group spans several nodes (SHARDCKPT_NODE,
    else torchrun's GROUP_RANK, names each rank's node), where it saves the storage link. True: also on one node.
    Either way only when the ranks on their own would read over 1.05x the bytes (SHARDCKPT_SHARE_MIN_SAVING=0.05);
    False: never. A compressed checkpoint (save(..., compression=...)) is read unshared: its stored blocks are
    checked by the rank that decodes them.
    """
    # A Stateful's state_dict() failing on one rank goes through the load's collectives like any other failure
    # of that rank, so that the other ranks raise with it instead of waiting for the group's timeout.
    failed: BaseException | None = None
    load_statefuls: Callable[[], None] | None = None
    try:
        # The knobs' values when not given, read here (not at import, where a malformed one failed saves too).
        max_in_flight = knobs.MAX_IN_FLIGHT if max_in_flight is None else max_in_flight
        max_gap = knobs.MAX_GAP if max_gap is None else max_gap
        check_read_limits(max_in_flight, max_gap)  # before any storage is touched, on every rank alike
        state_dict, load_statefuls = loadable_states(state_dict)
    except Exception as exc:
        failed = exc
    stats = _load(
        state_dict,
        url,
        process_group,
        coordinator,
        storage_options,
        strict,
        max_in_flight,
        verify_first,
        optional,
        max_gap,
        cast,
        share_reads,
        failed,
    )
    assert load_statefuls is not None  # _load raised otherwise
    load_statefuls()
    return stats


def _load(
    state_dict: Mapping[str, Any],
    url: str | Storage,
    process_group: Any,
    coordinator: int,
    storage_options: dict[str, Any] | None,
    strict: bool,
    max_in_flight: int | None,
    verify_first: bool,
    optional: Sequence[str],
    max_gap: int | None,
    cast: bool,
    share_reads: bool | None,
    failed: BaseException | None = None,
) -> ReadStats:
    group = resolve_group(process_group)
    if isinstance(group, _Solo):
        if failed is not None:
            raise failed
        checkpoint = open_checkpoint(
            open_storage(url, storage_options), max_in_flight=max_in_flight, max_gap=max_gap, head_only=True
        )
        pending, assign = prepare_fill(checkpoint, state_dict, group.rank, strict, optional, cast)
        if verify_first:
            pending.fetch()
        stats = pending.apply()
        assign()
        return stats
    coordinator = _agree_on_coordinator(group, coordinator, "load")
    local_error: BaseException | None = failed
    storage: Storage | None = None
    try:
        if local_error is None:
            storage = open_storage(url, storage_options)
    except Exception as exc:
        local_error = exc
    opening = None
    own: Opening | None = None
    if group.rank == coordinator:
        try:  # any failure here, typed or not, must reach the ranks waiting on the broadcast
            if local_error is not None:
                raise local_error
            assert storage is not None
            own = read_opening(storage, head_only=True)  # a piece index's blocks: each rank reads its own
            opening = _pack({"marker": own.marker_raw, "manifest": own.manifest_raw})
        except Exception as exc:
            opening = _pack({"error": _describe(exc)})
    message = _unpack(_broadcast(group, opening, coordinator))
    if "error" in message:
        raise DistributedError("load", {coordinator: message["error"]}) from local_error
    stats = ReadStats(0, 0, 0, 0.0)
    prepared: tuple[PendingRead, Callable[[], None]] | None = None
    try:
        if local_error is not None:
            raise local_error
        assert storage is not None
        if own is not None:  # the coordinator checked and decoded these very bytes already
            marker, manifest = own.marker, own.manifest
        else:  # read once by the coordinator; every rank checks the bytes against the marker before trusting them
            marker = decode_commit_marker(message["marker"], storage.describe(layout.COMMITTED))
            where = storage.describe(marker.manifest)
            manifest = verify_global_manifest(message["manifest"], marker, where, head_only=True)
        checkpoint = Checkpoint(storage, marker, manifest, max_in_flight=max_in_flight, max_gap=max_gap)
        prepared = pending, assign = prepare_fill(checkpoint, state_dict, group.rank, strict, optional, cast)
    except Exception as exc:
        local_error = exc
    share: Exchange | None = None
    # A shared read hands ranks raw byte ranges of the files; a compressed file's ranges are stored blocks, which
    # only the reader that decodes them can check (SPEC 4.1), so such a load reads unshared. Every rank that got
    # this far holds the same manifest, so all agree. Pieces referenced in a compressed file count (SPEC 6.2).
    compressed = prepared is not None and prepared[0].checkpoint.manifest.compressed
    # Every rank takes part in a shared read or none does: a rank that failed its checks stops them all here, and
    # a plan in which no two ranks need the same byte (FSDP on the mesh that saved) reads on its own, streaming.
    # The ranks must agree on share_reads: one that skipped the exchange would leave the others waiting in it.
    modes = [share_reads is True, share_reads is False, share_reads is None]
    someone_failed, *given = _collective(lambda: any_ranks(group, [local_error is not None, *modes]), group)
    if sum(given) > 1 and local_error is None:
        local_error = ShardckptUsageError(
            "share_reads differs between the ranks of this load (True, False and None are three choices): pass "
            "the same value on every rank"
        )
        someone_failed = True
    if share_reads is not False and not someone_failed and not compressed:
        assert prepared is not None
        try:
            only_across_nodes = share_reads is None
            share = _collective(
                lambda: plan_exchange(
                    group, prepared[0].plan, only_across_nodes=only_across_nodes, budget=max_in_flight
                ),
                group,
            )
        except Exception as exc:
            local_error = exc
    try:
        if local_error is not None:
            raise local_error
        assert prepared is not None
        pending, assign = prepared
        if share is not None:
            exchange = share
            plan = share.share
            if verify_first:  # every rank keeps and verifies all its bytes; destinations are written after the vote
                pending.use(
                    _collective(
                        lambda: fetch_shared(
                            group, checkpoint, pending.plan, plan, budget=max_in_flight, exchange=exchange
                        ),
                        group,
                    )
                )
            else:
                stats = pending.apply(
                    fetch=lambda finish: _collective(
                        lambda: fetch_shared(
                            group,
                            checkpoint,
                            pending.plan,
                            plan,
                            budget=max_in_flight,
                            finish=finish,
                            exchange=exchange,
                        ),
                        group,
                    )
                )
                stats = dataclasses.replace(stats, fetched_bytes=plan.read_bytes(group.rank))  # from storage
                assign()
        elif verify_first:
            pending.fetch()  # every rank verifies all its bytes; the destinations are written after the vote
        else:
            stats = pending.apply()
            assign()
        status = _pack({"ok": True})
    except PeerFailed:
        status = _pack({"peer": True})
    except Exception as exc:
        local_error = exc
        status = _pack({"error": _describe(exc)})
    # One small collective when every rank succeeded; the ranks' messages are gathered only after a failure.
    if _any_rank(group, local_error is not None):
        replies = [_unpack(reply) for reply in _all_gather(group, status)]
        failures = {rank: reply["error"] for rank, reply in enumerate(replies) if "error" in reply}
        raise DistributedError("load", failures) from local_error
    if verify_first:
        assert prepared is not None
        stats = prepared[0].apply()
        prepared[1]()
    return stats


def prepare_fill(
    checkpoint: Checkpoint,
    state_dict: Mapping[str, Any],
    rank: int,
    strict: bool,
    optional: Sequence[str] = (),
    cast: bool = False,
) -> tuple[PendingRead, Callable[[], None]]:
    """Check and plan this rank's part of a load (writing nothing); returns the read and what sets plain values.

    strict: every entry of the state dict must be in the checkpoint, except those named by `optional` (an entry
    name, or a prefix before a '.'), which are left as they are when the checkpoint lacks them.
    """
    leaves = flatten(state_dict)
    items = load_items(leaves)
    shapes = destination_shapes(leaves)
    # A piece index: the entries of these tensors only (an empty destination has no item, still a shape to check).
    checkpoint.need({name for name, _, _ in items} | {name for name, _, _ in shapes})
    stored = checkpoint.manifest.tensor_index()
    saved_world = checkpoint.manifest.world_size
    shared, own = checkpoint.objects, checkpoint.rank_objects(rank)
    missing = sorted({name for name, _, _ in items if name not in stored})
    # Per-rank values come from this rank's own; a rank the saving job did not have follows its PerRank's choice.
    sources = {}
    split: dict[str, Any] = {}  # containers DCP saved as parts, one per rank that held some (SPEC 7 "Names")
    for leaf in leaves:
        if leaf.is_plain and leaf.name not in shared:
            found = _from_parts(leaf.name, leaf.value, shared, missing)
            if found is None:
                missing.append(leaf.name)
            else:
                split[leaf.name] = found
        if not isinstance(leaf.value, PerRank):
            continue
        if rank < saved_world:
            sources[leaf.name] = (own, rank)
            if leaf.name not in own:
                missing.append(leaf.name)
        elif leaf.value.missing == "error":
            raise ShardckptUsageError(
                f"{checkpoint.url}: per-rank entry {leaf.name!r} was saved by {saved_world} ranks, none of them rank "
                f"{rank}; PerRank(missing='keep') keeps this rank's own value, missing='wrap' gives it rank "
                f"{rank % saved_world}'s"
            )
        elif leaf.value.missing == "wrap":
            sources[leaf.name] = (checkpoint.rank_objects(rank % saved_world), rank % saved_world)
            if leaf.name not in sources[leaf.name][0]:
                missing.append(leaf.name)
    missing = [name for name in missing if not _is_optional(name, optional)]
    if missing and strict:
        raise ShardckptUsageError(
            f"{checkpoint.url} lacks {len(missing)} entries of the state dict: {missing[:10]}"
            + (" ..." if len(missing) > 10 else "")
            + optimizer_hint(state_dict)
        )
    for name, shape, kind in shapes:
        if name in stored and shape != tuple(stored[name].shape):
            raise ShardckptUsageError(
                f"tensor {name!r}: the state dict's {kind} has global shape {list(shape)}, the checkpoint holds "
                f"shape {list(stored[name].shape)}; a load fills whole tensors (read a part with "
                f"shardckpt.open({checkpoint.url!r}).read({name!r}, offsets=..., shape=...))"
            )
    present = [item for item in items if item[0] in stored]
    for name, box, _ in present:
        if not box.within(stored[name].shape):  # a destination's own boxes lie outside its global shape
            raise ShardckptUsageError(
                f"tensor {name!r}: the state dict wants box {box}, outside the tensor's shape "
                f"{list(stored[name].shape)} in the checkpoint"
            )
    pending = checkpoint.prepare(present, cast=cast)
    where = checkpoint.url
    mine = {
        name: per_rank_value(source[name], f"{where}: per-rank object {name!r} of rank {source_rank}")
        for name, (source, source_rank) in sources.items()
        if name in source
    }

    def assign() -> None:
        for leaf in leaves:
            if isinstance(leaf.value, PerRank) and leaf.name in mine:
                leaf.value.value = mine[leaf.name]
            elif leaf.is_plain and leaf.name in shared:
                leaf.assign(shared[leaf.name])
            elif leaf.is_plain and leaf.name in split:
                leaf.assign(split[leaf.name])

    return pending, assign


def _from_parts(name: str, destination: Any, shared: Mapping[str, Any], missing: list[str]) -> Any:
    """The value of plain entry `name` rebuilt from the objects it was stored as, one per part, or None.

    A container whose parts different ranks held (torchtitan's {"dataloader": {"dp_rank_<r>": ...}} through dcp.save)
    is stored as its parts `name.<key>` (SPEC 7 "Names"): the destination's keys are filled from them, as DCP fills
    them; a key with no stored part is missing. None when no object is stored under `name.`.
    """
    prefix = f"{name}."
    if not isinstance(destination, Mapping) or not any(key.startswith(prefix) for key in shared):
        return None
    value = {}
    for key, part in destination.items():
        inner = f"{prefix}{key}"
        if inner in shared:
            value[key] = shared[inner]
            continue
        found = _from_parts(inner, part, shared, missing)
        if found is None:
            missing.append(inner)  # strict=False: the destination keeps its own
        value[key] = part if found is None else found
    return value


def _is_optional(name: str, optional: Sequence[str]) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in optional)
