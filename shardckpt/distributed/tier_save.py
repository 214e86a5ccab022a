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

from shardckpt import knobs
from shardckpt.catalog.local_tier import HOMES_KEY, JOB_KEY, NODES_KEY, PEERS_KEY, home, job_tag
from shardckpt.distributed import group_calls as calls
from shardckpt.distributed.collectives import Group
from shardckpt.distributed.tier_replicate import Outgoing, identity_of, replicate
from shardckpt.errors import DistributedError
from shardckpt.format import layout
from shardckpt.format.local_manifest import decode_local_manifest
from shardckpt.format.manifest import GlobalManifest, decode_global_manifest
from shardckpt.planner.partners import replica_partners
from shardckpt.statedict.flatten import flatten
from shardckpt.statedict.leaves import check_savable, save_items
from shardckpt.statedict.stateful import saved_states
from shardckpt.storage import Storage
from shardckpt.write.node_commit import build_manifest, commit_node
from shardckpt.write.writer import ShardWriter


def local_name(step: int, job: str, attempt: str) -> str:
    """A local checkpoint's name: by step, then its job's tag (what makes a crashed save's files the job's before any
    manifest is written), then attempt, so a step saved again after a restart never collides."""
    return f"step-{step:08d}-{job_tag(job)}-{attempt}"


def save_local(
    state: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
    root: Storage,
    *,
    group: Group | calls.Solo,
    nodes: Sequence[int],
    step: int,
    job: str,
    peers: int,
    block_size: int | None,
    started: list[str] | None = None,
) -> tuple[str, GlobalManifest]:
    """Save `state` into the local tier (`root`: this rank's node's local root; `nodes[rank]`: each rank's node);
    collective. The checkpoint's name and its global manifest; `started` gets the name as soon as it is drawn (what
    a failed save leaves to clean)."""
    partners = replica_partners(nodes, peers)
    error: BaseException | None = None
    opening = calls.pack({"attempt": layout.new_attempt()}) if group.rank == 0 else None
    attempt = calls.unpack(calls.broadcast(group, opening, 0))["attempt"]
    name = local_name(step, job, attempt)
    if started is not None:
        started.append(name)
    where = root.child(name)
    encoded, identity = b"", None
    reply = b""
    placed: tuple[tuple[int, Any], ...] = ()
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
        encoded, placed = writer.encoded_manifest, writer.placed
        # A partner on this host copies the file in the kernel when it can open this very file.
        identity = identity_of(where, layout.data_path(group.rank, attempt)) if knobs.SHARE_MEMORY else None
        # Packed here: whatever fails on one rank must still reach the others through the gather, never leave them
        # waiting in it.
        reply = calls.pack({"manifest": encoded, "home": home(root), "file": identity})
    except Exception as exc:
        error = exc
        reply = calls.pack({"error": calls.describe(exc)})
    replies = [calls.unpack(raw) for raw in calls.all_gather(group, reply)]
    _raise_failures(replies, error)
    raws = [reply["manifest"] for reply in replies]
    try:
        if isinstance(group, Group) and any(partners):
            manifests = [
                decode_local_manifest(raw, where.describe(layout.local_manifest_path(r, attempt)))
                for r, raw in enumerate(raws)
            ]
            outgoing = Outgoing(layout.data_path(group.rank, attempt), placed)
            files = [reply["file"] for reply in replies]
            replicate(group, where, manifests, outgoing, files, partners, same_host=bool(knobs.SHARE_MEMORY))
    except Exception as exc:
        error = exc
    if calls.vote(group, error is not None):
        replies = [
            calls.unpack(reply)
            for reply in calls.all_gather(group, calls.pack({"error": calls.describe(error)} if error else {}))
        ]
        _raise_failures(replies, error)
    built = None
    if group.rank == 0:
        try:
            # The layout, for the tools only (ops.local_tier): each rank's node and its node's directory, and peers.
            homes = [reply["home"] for reply in replies]
            recorded = {JOB_KEY: job, NODES_KEY: list(nodes), HOMES_KEY: homes, PEERS_KEY: peers}
            manifest_bytes, marker_bytes = build_manifest(where.url, raws, attempt, step, recorded)
            built = calls.pack({"manifest": manifest_bytes, "marker": marker_bytes})
        except Exception as exc:
            error = exc
            built = calls.pack({"error": calls.describe(exc)})
    message = calls.unpack(calls.broadcast(group, built, 0))
    if "error" in message:
        raise DistributedError("local save", {0: message["error"]}) from error
    try:
        if group.rank == min(rank for rank, node in enumerate(nodes) if node == nodes[group.rank]):
            mine = nodes[group.rank]
            held = [r for r in range(group.size) if nodes[r] == mine or any(nodes[t] == mine for t in partners[r])]
            commit_node(where, raws, attempt, message["manifest"], message["marker"], held)
    except Exception as exc:
        error = exc
    replies = [
        calls.unpack(reply)
        for reply in calls.all_gather(group, calls.pack({"error": calls.describe(error)} if error else {}))
    ]
    _raise_failures(replies, error)
    return name, decode_global_manifest(message["manifest"], where.describe(layout.global_manifest_path(attempt)))


def _raise_failures(replies: Sequence[Mapping[str, Any]], error: BaseException | None) -> None:
    failures = {rank: reply["error"] for rank, reply in enumerate(replies) if "error" in reply}
    if failures:
        raise DistributedError("local save", failures) from error
