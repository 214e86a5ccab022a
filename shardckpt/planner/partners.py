"""The node-local tier's placement: which ranks on other nodes keep a copy of each rank's files, and which holder
of a file serves each byte range a restore needs. Pure: node names and holdings in, assignments out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from shardckpt.errors import ShardckptUsageError
from shardckpt.planner.share import Segment, SharePlan


def replica_partners(nodes: Sequence[int], peers: int) -> list[tuple[int, ...]]:
    """For each rank, the ranks that keep a copy of its files: one rank on each of the `peers` nodes after its own
    in node order (wrapping; fewer when there are fewer other nodes), the rank with its own place on that node
    (modulo the node's size, so uneven nodes work). Losing any one node leaves every file on another node whenever
    peers >= 1 and there are two nodes or more."""
    if isinstance(peers, bool) or not isinstance(peers, int) or peers < 0:
        raise ShardckptUsageError(f"peers must be an integer >= 0, got {peers!r}")
    order = sorted(set(nodes))
    members: dict[int, list[int]] = {node: [] for node in order}
    for rank, node in enumerate(nodes):
        members[node].append(rank)
    partners: list[tuple[int, ...]] = []
    for rank, node in enumerate(nodes):
        place, at = members[node].index(rank), order.index(node)
        chosen = []
        for step in range(1, min(peers, len(order) - 1) + 1):
            other = members[order[(at + step) % len(order)]]
            chosen.append(other[place % len(other)])
        partners.append(tuple(chosen))
    return partners


def tier_readers(
    share: SharePlan, holders: Mapping[int, Sequence[int]], nodes: Sequence[int] | None = None
) -> tuple[SharePlan, list[int]]:
    """`share` with every segment's reader replaced by a rank that holds its file (`holders`: file -> ranks): a
    consumer that holds it (no transfer), else a holder on the node of most of its consumers, else any holder;
    the least loaded, ties to the lower rank. Also the files some segment needs that no rank holds (ascending):
    the plan is usable only when that list is empty."""
    load = [0] * share.world
    segments, missing = [], set()
    for segment in share.segments:
        candidates = sorted(set(holders.get(segment.file, ())))
        if not candidates:
            missing.add(segment.file)
            continue
        local = [rank for rank in candidates if rank in segment.consumers]
        if not local and nodes is not None:
            homes = {nodes[rank] for rank in segment.consumers}
            local = [rank for rank in candidates if nodes[rank] in homes]
        reader = min(local or candidates, key=lambda rank: (load[rank], rank))
        load[reader] += segment.size
        segments.append(Segment(segment.file, segment.start, segment.end, reader, segment.consumers))
    return SharePlan(share.world, tuple(segments)), sorted(missing)
