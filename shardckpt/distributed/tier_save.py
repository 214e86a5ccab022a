"""The node-local tier's save: every rank writes its pieces into its node's local root, sends its files to its
partner ranks on other nodes (planner.partners), and each node commits its directory once all of that is done.

(coordinator) draw the attempt -> (all) write own data file + local manifest under <local_root>/<name> -> (all)
share the local manifests -> (all) send own data file to the partners, write the replicas received -> (coordinator)
build the one global manifest and COMMITTED -> (one rank per node) write the local manifests, the global manifest,
then COMMITTED -> (all) learn the outcome. Replicas are the same files under the same names: every byte keeps the
CRCs its manifest records. A failure on any rank makes every rank raise the same DistributedError.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from shardckpt.catalog.local_tier import JOB_KEY
from shardckpt.distributed.collectives import Group
from shardckpt.distributed.protocol import _all_gather, _any_rank, _broadcast, _pack, _Solo, _unpack
from shardckpt.distributed.tier_restore import swap
from shardckpt.errors import DistributedError
from shardckpt.format import layout
from shardckpt.format.local_manifest import decode_local_manifest
from shardckpt.format.manifest import GlobalManifest, decode_global_manifest
from shardckpt.planner.partners import replica_partners
from shardckpt.statedict.flatten import flatten
from shardckpt.statedict.leaves import check_savable, save_items
from shardckpt.statedict.stateful import saved_states
from shardckpt.storage import Storage
from shardckpt.write.node_commit import build_manifest, commit_node, write_same
from shardckpt.write.writer import ShardWriter


def local_name(step: int, attempt: str) -> str:
    """A local checkpoint's name: by step, then attempt, so a step saved again after a restart never collides."""
    return f"step-{step:08d}-{attempt}"


def save_local(
    state: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
    root: Storage,
    *,
    group: Group | _Solo,
    nodes: Sequence[int],
    step: int,
    job: str,
    peers: int,
    block_size: int,
) -> tuple[str, GlobalManifest]:
    """Save `state` into the local tier (`root`: this rank's node's local root; `nodes[rank]`: each rank's node);
    collective. The checkpoint's name and its global manifest."""
    partners = replica_partners(nodes, peers)
    error: BaseException | None = None
    opening = _pack({"attempt": layout.new_attempt()}) if group.rank == 0 else None
    attempt = _unpack(_broadcast(group, opening, 0))["attempt"]
    name = local_name(step, attempt)
    where = root.child(name)
    encoded = b""
    try:
        # A callable state is built here, so that its failure on one rank reaches every rank like any other.
        leaves = flatten(saved_states(state() if callable(state) else state))
        check_savable(leaves, step)
        items = save_items(leaves, group.rank, group.size)
        writer = ShardWriter(
            where, rank=group.rank, world_size=group.size, attempt=attempt, block_size=block_size, step=step
        )
        for piece, tensor, placement in items.pieces:
            writer.add(piece, tensor, **placement)
        for piece, value, per_rank in items.objects:
            writer.add_object(piece, value, per_rank=per_rank)
        writer.close()
        assert writer.encoded_manifest is not None
        encoded = writer.encoded_manifest
    except Exception as exc:
        error = exc
    replies = [
        _unpack(reply)
        for reply in _all_gather(group, _pack({"manifest": encoded} if error is None else {"error": _describe(error)}))
    ]
    _raise_failures(replies, error)
    raws = [reply["manifest"] for reply in replies]
    try:
        if isinstance(group, Group) and any(partners):
            _replicate(group, where, raws, attempt, partners)
    except Exception as exc:
        error = exc
    if _any_rank(group, error is not None):
        replies = [_unpack(reply) for reply in _all_gather(group, _pack({"error": _describe(error)} if error else {}))]
        _raise_failures(replies, error)
    built = None
    if group.rank == 0:
        try:
            manifest_bytes, marker_bytes = build_manifest(where.url, raws, attempt, step, {JOB_KEY: job})
            built = _pack({"manifest": manifest_bytes, "marker": marker_bytes})
        except Exception as exc:
            error = exc
            built = _pack({"error": _describe(exc)})
    message = _unpack(_broadcast(group, built, 0))
    if "error" in message:
        raise DistributedError("local save", {0: message["error"]}) from error
    try:
        if group.rank == min(rank for rank, node in enumerate(nodes) if node == nodes[group.rank]):
            commit_node(where, raws, attempt, message["manifest"], message["marker"])
    except Exception as exc:
        error = exc
    replies = [_unpack(reply) for reply in _all_gather(group, _pack({"error": _describe(error)} if error else {}))]
    _raise_failures(replies, error)
    return name, decode_global_manifest(message["manifest"], where.describe(layout.global_manifest_path(attempt)))


def _replicate(
    group: Group, where: Storage, raws: Sequence[bytes], attempt: str, partners: list[tuple[int, ...]]
) -> None:
    """(all) One all_to_all: each rank's data file to each of its partners, which write it under its own name."""
    rank = group.rank
    sizes = [
        decode_local_manifest(raw, where.describe(layout.local_manifest_path(r, attempt))).data_size
        for r, raw in enumerate(raws)
    ]
    mine = layout.data_path(rank, attempt)
    data = np.empty(sizes[rank], dtype=np.uint8)
    if sizes[rank]:
        where.read_range_into(mine, 0, data.data)
    send_sizes = [sizes[rank] if target in partners[rank] else 0 for target in range(group.size)]
    sources = [source for source in range(group.size) if rank in partners[source]]
    receive_sizes = [sizes[source] if source in sources else 0 for source in range(group.size)]
    outgoing = [data for size in send_sizes if size]
    received, position = swap(group, outgoing, send_sizes, receive_sizes), 0
    for source in range(group.size):
        if receive_sizes[source]:
            data_file = received[position : position + sizes[source]].tobytes()
            write_same(where, layout.data_path(source, attempt), data_file, len(data_file))
            position += sizes[source]
        elif source in sources:  # an empty data file (a rank holding nothing) is still a file of the checkpoint
            write_same(where, layout.data_path(source, attempt), b"", 0)


def _describe(exc: BaseException | None) -> str:
    return f"{type(exc).__name__}: {exc}"


def _raise_failures(replies: Sequence[Mapping[str, Any]], error: BaseException | None) -> None:
    failures = {rank: reply["error"] for rank, reply in enumerate(replies) if "error" in reply}
    if failures:
        raise DistributedError("local save", failures) from error
