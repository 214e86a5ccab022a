"""`shardckpt ls` / `inspect` on a node's local tier (issue 28): the job, the step, which ranks' data files the node
holds as its own and as replicas for peers, whether the checkpoint is complete on the node alone, which node it is
(its recorded home, else the files it keeps); --json fields; a persistent root shows none of it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardckpt
from shardckpt.catalog.local_tier import HOMES_KEY, JOB_KEY, NODES_KEY, PEERS_KEY, home
from shardckpt.distributed.tier_save import local_name
from shardckpt.format import layout
from shardckpt.planner.partners import replica_partners
from shardckpt.storage import open_storage
from shardckpt.write.node_commit import build_manifest, commit_node
from shardckpt.write.writer import ShardWriter
from tests.cli.test_cli_commands import run_command

pytestmark = pytest.mark.unit

NODES = [0, 0, 1, 2]  # 4 ranks on 3 nodes; with peers=1 node n keeps its own ranks and the previous node's


def node_tiers(tmp_path: Path, step: int = 7, job: str = "job-\x1b[31mred") -> dict[int, Path]:
    """One local save as the tier writes it (tier_save.save_local without the process group): each rank's files in
    its node's directory, replicas copied to partners, then each node's manifests and COMMITTED; the node dirs."""
    dirs = {node: tmp_path / f"node-{node}" for node in sorted(set(NODES))}
    attempt = layout.new_attempt()
    name = local_name(step, job, attempt)
    raws = []
    for rank, node in enumerate(NODES):
        writer = ShardWriter(str(dirs[node] / name), rank=rank, world_size=len(NODES), attempt=attempt, step=step)
        writer.add("w", torch.full((2, 4), float(rank)), global_shape=(2 * len(NODES), 4), offsets=(2 * rank, 0))
        writer.close()
        raws.append(writer.encoded_manifest)
    for rank, kept in enumerate(replica_partners(NODES, 1)):
        for partner in kept:
            data = layout.data_path(rank, attempt)
            shutil.copy(dirs[NODES[rank]] / name / data, dirs[NODES[partner]] / name / data)
    homes = [home(open_storage(str(dirs[node]))) for node in NODES]
    recorded = {JOB_KEY: job, NODES_KEY: NODES, HOMES_KEY: homes, PEERS_KEY: 1}
    manifest, marker = build_manifest(name, raws, attempt, step, recorded)
    for directory in dirs.values():
        commit_node(open_storage(str(directory / name)), raws, attempt, manifest, marker)
    return dirs


def ls_json(root: Path) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "shardckpt.cli", "ls", str(root), "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return json.loads(result.stdout)


def test_ls_and_inspect_say_which_node_holds_what_of_each_local_checkpoint(tmp_path, capsys) -> None:
    dirs = node_tiers(tmp_path)
    listing = ls_json(dirs[1])
    assert listing["local_tier"] is True
    (row,) = listing["checkpoints"]
    local = row["local"]
    assert (row["step"], local["job"], local["node"], local["node_from"]) == (7, "job-\x1b[31mred", 1, "recorded")
    # Node 1 holds rank 2 (its own) and, with peers=1, node 0's ranks 0 and 1: not rank 3 (node 2's).
    assert (local["own_ranks"], local["replica_ranks"], local["complete_here"]) == ([2], [0, 1], False)
    assert ls_json(dirs[0])["checkpoints"][0]["local"]["replica_ranks"] == [3]  # node 0 keeps node 2's
    # A copy of node 2's directory elsewhere: not its recorded home, but only node 2 keeps exactly ranks 2 and 3.
    shutil.copytree(dirs[2], tmp_path / "moved")
    moved = ls_json(tmp_path / "moved")["checkpoints"][0]["local"]
    assert (moved["node"], moved["node_from"], moved["own_ranks"], moved["replica_ranks"]) == (2, "files", [3], [2])
    code, shown = run_command(["ls", str(dirs[1])], terminal=True)
    assert code == 0 and "local tier of node 1" in shown and "own ranks 2, replicas of ranks 0-1" in shown, shown
    assert "\x1b[31mred" not in shown and "job-\\x1b[31mred" in shown  # the job is untrusted text: escaped
    code, shown = run_command(["inspect", row["url"]], terminal=False)
    assert code == 0 and "data files here: ranks 0-2 of 4" in shown and "not complete here" in shown, shown
    capsys.readouterr()
    assert run_command(["inspect", row["url"], "--json"], terminal=False)[0] == 0  # --json goes to stdout
    assert json.loads(capsys.readouterr().out)["local"]["own_ranks"] == [2]


def test_a_local_save_records_its_node_and_a_persistent_root_shows_no_local_tier(tmp_path) -> None:
    saver = shardckpt.Checkpointer(
        str(tmp_path / "persistent"),
        every_steps=2,
        local_root=str(tmp_path / "local"),
        local_every_steps=1,
        preemption_signals=(),
    )
    for step in (1, 2, 3):
        saver.maybe_save(step, {"w": torch.arange(6.0) + step})
    saver.close()
    listing = ls_json(tmp_path / "local")
    assert [row["step"] for row in listing["checkpoints"]] == [1, 3] and listing["local_tier"] is True
    local = listing["checkpoints"][-1]["local"]
    assert (local["node"], local["node_from"], local["own_ranks"], local["replica_ranks"]) == (0, "recorded", [0], [])
    assert local["complete_here"] is True and local["job"] == str(tmp_path / "persistent")
    persistent = ls_json(tmp_path / "persistent")
    assert "local_tier" not in persistent and all("local" not in row for row in persistent["checkpoints"])
