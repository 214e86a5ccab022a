"""What `shardckpt ls` and `inspect` say about a node's local tier: for each local checkpoint its job and step, which
ranks' data files this directory holds as its node's own and as replicas for peers, and whether it is complete here.

Torch-free. Which node a directory is: the one whose recorded home (host and real path, "shardckpt.tier.homes") is
this host and directory; for a copy moved elsewhere, the one node of the save's layout whose own and replica files
are exactly those present, when only one fits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shardckpt.catalog.local_tier import HOMES_KEY, JOB_KEY, NODES_KEY, PEERS_KEY, home
from shardckpt.errors import NotFoundError
from shardckpt.format.manifest import GlobalManifest
from shardckpt.planner.partners import replica_partners
from shardckpt.storage import Storage


def is_local_copy(manifest: GlobalManifest) -> bool:
    """Whether a committed checkpoint is a node's copy of a local-tier save (its manifest names the job)."""
    return JOB_KEY in manifest.metadata


def describe_copy(checkpoint: Storage, manifest: GlobalManifest) -> dict[str, Any]:
    """A local copy as ls/inspect show it: job, ranks whose data files are here (whole), own vs replicas where the
    save's layout tells which node this is, and whether every data file is here."""
    present = [entry.rank for entry in manifest.files if _whole(checkpoint, entry.data, entry.data_size)]
    job = manifest.metadata.get(JOB_KEY)
    row: dict[str, Any] = {
        "job": job if isinstance(job, str) else None,
        "ranks_present": present,
        "complete_here": len(present) == len(manifest.files),
        "node": None,
        "own_ranks": None,
        "replica_ranks": None,
    }
    layout = _layout(manifest)
    if layout is None:
        row["why_no_node"] = "the save did not record its nodes (a save before the layout was recorded)"
        return row
    nodes, peers = layout
    row["nodes"] = nodes
    homes = manifest.metadata.get(HOMES_KEY)
    here = home(checkpoint.parent())
    candidates = _nodes_holding(nodes, peers, set(present))
    if isinstance(homes, list) and len(homes) == len(nodes) and here in homes:
        node = nodes[homes.index(here)]
        row["node_from"] = "recorded"  # this host and directory are the node's recorded home
    elif len(candidates) == 1:
        node = candidates[0]
        row["node_from"] = "files"  # moved or copied: the only node that keeps exactly these files
    else:
        row["why_no_node"] = (
            f"not its recorded home, and nodes {', '.join(map(str, candidates))} keep the same files"
            if candidates
            else "not its recorded home, and its files match no node of the save (files lost, or a copy)"
        )
        return row
    row["node"] = node
    row["own_ranks"] = [rank for rank in present if nodes[rank] == node]
    row["replica_ranks"] = [rank for rank in present if nodes[rank] != node]
    return row


def _layout(manifest: GlobalManifest) -> tuple[list[int], int] | None:
    nodes, peers = manifest.metadata.get(NODES_KEY), manifest.metadata.get(PEERS_KEY)
    if not isinstance(nodes, list) or len(nodes) != manifest.world_size:
        return None
    if not all(isinstance(node, int) and not isinstance(node, bool) for node in nodes):
        return None
    if not isinstance(peers, int) or isinstance(peers, bool) or peers < 0:
        return None
    return nodes, peers


def _nodes_holding(nodes: Sequence[int], peers: int, present: set[int]) -> list[int]:
    """The nodes of the save whose own files plus the replicas they keep are exactly `present`."""
    partners = replica_partners(nodes, peers)
    found = []
    for node in sorted(set(nodes)):
        expected = {rank for rank, home in enumerate(nodes) if home == node}
        expected |= {rank for rank, kept in enumerate(partners) if any(nodes[p] == node for p in kept)}
        if expected == present:
            found.append(node)
    return found


def _whole(checkpoint: Storage, path: str, size: int) -> bool:
    try:
        return checkpoint.size(path) == size
    except NotFoundError:
        return False
