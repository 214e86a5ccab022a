"""SIGKILL at every phase of a real 2-rank save (and of retention): nothing committed is lost, and a retry works.

For each crash point (SHARDCKPT_CRASH_AT, on a rank or on the coordinator) the job first commits step-1, then
dies saving step-2. Afterwards step-1 loads bit-exact, latest() returns it, `shardckpt ls` shows step-2 as
incomplete, and a retry of step 2 at the same URL commits without touching a byte of the failed attempt's files.
The "+incremental" cases save step-2 with parent=step-1 (format 1.1: the unchanged tensor is stored by reference).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import shardckpt
from shardckpt.cli import main as cli_main
from shardckpt.format import layout
from shardckpt.ops.gc import gc
from shardckpt.ops.inspect import inspect_checkpoint
from shardckpt.ops.verify import verify
from tests.helpers.dist_worker import crash_tensors
from tests.helpers.launch import run_ranks

WORLD = 2
PHASES = {
    "writing_data:1": 1,  # the crash point -> the rank it kills
    "writing_data:0": 0,
    "after_local_manifest:1": 1,
    "after_local_manifest:0": 0,
    "before_global_manifest": 0,
    "before_commit": 0,
}
# Incremental saves (parent=step-1) die at a rank's data, after a local manifest with references, and just before
# COMMITTED (after the parent re-check): the parent must survive each, and the retry must reference it again.
INCREMENTAL = "+incremental"
CASES = {
    **PHASES,
    **{
        f"{phase}{INCREMENTAL}": PHASES[phase]
        for phase in ("writing_data:1", "after_local_manifest:0", "before_commit")
    },
}


def _snapshot(directory: Path) -> dict[str, tuple[int, int, int, str]]:
    """(inode, size, mtime_ns, sha256) of every file below `directory`, by relative path."""
    found = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            stat = path.stat()
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            found[str(path.relative_to(directory))] = (stat.st_ino, stat.st_size, stat.st_mtime_ns, digest)
    return found


def _assert_holds(url: str, step: int) -> None:
    """The checkpoint at `url` verifies and loads bit-exact as step `step` of the crash scenario."""
    assert verify(url).ok, [str(p) for p in verify(url).problems]
    expected = crash_tensors(step)
    state = {name: torch.full_like(tensor, 7) for name, tensor in expected.items()}
    state["trainer"] = None
    shardckpt.load(state, url)
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name
        assert state[name].view(torch.uint8).equal(tensor.view(torch.uint8)), name  # bits, not just values
    assert state["trainer"] == {"step": step}
    assert shardckpt.open(url).rank_objects(WORLD - 1)["rng"] == {"rank": WORLD - 1, "step": step}


def _ls(root: Path) -> dict[str, dict]:
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        assert cli_main(["ls", "--json", str(root)]) == 0
    return {row["name"]: row for row in json.loads(output.getvalue())["checkpoints"]}


@pytest.fixture(scope="module")
def crashed(tmp_path_factory) -> dict[str, dict]:
    """Each phase's job killed there; the tree as it was right after the crash is kept in <phase>-after-crash."""
    base = tmp_path_factory.mktemp("crash")
    runs: dict[str, dict] = {}
    for case, victim in CASES.items():
        phase, incremental = case.removesuffix(INCREMENTAL), case.endswith(INCREMENTAL)
        root = base / case.replace(":", "-rank").replace("+", "-")
        args = {"root": str(root), "crash_at": phase, "timeout": 30, "incremental": incremental}
        verdicts = run_ranks("crash", WORLD, args, timeout=90)
        failed = root / "step-2"
        copy = base / f"{root.name}-after-crash"
        shutil.copytree(root, copy)
        runs[case] = {"victim": victim, "verdicts": verdicts, "root": root, "copy": copy, "files": _snapshot(failed)}
        runs[case]["incremental"] = incremental
    urls = [str(run["root"] / "step-2") for run in runs.values()]
    parents = {str(run["root"] / "step-2"): str(run["root"] / "step-1") for run in runs.values() if run["incremental"]}
    retry = run_ranks("retry", WORLD, {"urls": urls, "parents": parents, "timeout": 30}, timeout=90)
    for run in runs.values():
        run["retry"] = retry
    return runs


@pytest.mark.parametrize("phase", sorted(CASES))
def test_the_job_died_at_that_phase(crashed, phase: str) -> None:
    run = crashed[phase]
    victim, verdicts = run["victim"], run["verdicts"]
    assert verdicts[victim] is None, f"rank {victim} was to be killed at {phase} but finished: {verdicts[victim]}"
    survivor = verdicts[1 - victim]
    assert survivor is not None and survivor["ok"], survivor
    assert survivor["value"]["raised"] == "DistributedError", survivor  # the peer's death is an error, not a hang
    failed = run["copy"] / "step-2"
    names = set(run["files"])
    assert not (failed / layout.COMMITTED).exists()
    locals_ = {name for name in names if name.startswith("ranks/")}
    data = {name for name in names if name.startswith("data/")}
    manifests = {name for name in names if name.startswith("manifest-")}
    name, _, rank = phase.removesuffix(INCREMENTAL).partition(":")
    if name == "writing_data":  # the victim's data file is partial, no local manifest of the victim exists
        assert data and not any(n.startswith(f"ranks/{int(rank):05d}-") for n in locals_) and not manifests
    elif name == "after_local_manifest":
        assert any(n.startswith(f"ranks/{int(rank):05d}-") for n in locals_) and not manifests
    elif name == "before_global_manifest":
        assert len(locals_) == WORLD and not manifests
    else:
        assert len(locals_) == WORLD and len(manifests) == 1


@pytest.mark.parametrize("phase", sorted(CASES))
def test_the_previous_checkpoint_survives_bit_exact(crashed, phase: str) -> None:
    root = crashed[phase]["copy"]
    assert shardckpt.latest(str(root)) == str(root / "step-1")
    _assert_holds(str(root / "step-1"), 1)
    rows = _ls(root)
    assert rows["step-1"]["status"] == "committed"
    assert rows["step-2"]["status"] == "incomplete"
    with pytest.raises(shardckpt.NotCommittedError):
        shardckpt.open(str(root / "step-2"))


@pytest.mark.parametrize("phase", sorted(CASES))
def test_a_retry_at_the_same_url_commits_without_touching_the_failed_attempt(crashed, phase: str) -> None:
    run = crashed[phase]
    retry = run["retry"]
    url = str(run["root"] / "step-2")
    assert all(verdict is not None and verdict["ok"] for verdict in retry), retry
    attempts = {verdict["value"][url] for verdict in retry}
    assert len(attempts) == 1
    failed_attempts = {name.split("-", 1)[1].split(".")[0] for name in run["files"] if "/" in name}
    assert attempts.isdisjoint(failed_attempts)  # a new attempt id: it cannot name a file of the failed one
    now = _snapshot(run["root"] / "step-2")
    for name, stat in run["files"].items():
        assert now.get(name) == stat, f"{name} of the failed attempt was touched by the retry"
    assert shardckpt.latest(str(run["root"])) == url
    _assert_holds(url, 2)
    _assert_holds(str(run["root"] / "step-1"), 1)
    references = inspect_checkpoint(url)["references"]
    if run["incremental"]:  # the retry stored the unchanged tensor by reference to step-1 again
        assert {entry["checkpoint"] for entry in references} == {"step-1"}, references
    else:
        assert references == []


def test_a_crash_during_retention_leaves_every_surviving_checkpoint_loadable(tmp_path) -> None:
    root = tmp_path / "retention"
    verdicts = run_ranks("crash", WORLD, {"root": str(root), "crash_at": "during_retention", "retention": True})
    assert verdicts[0] is None, f"the coordinator was to be killed during retention: {verdicts[0]}"
    assert not (root / "step-1" / layout.COMMITTED).exists()  # the crash came after the marker went
    assert (root / "step-1" / "data").is_dir()  # ... and before its files did
    rows = _ls(root)
    assert rows["step-1"]["status"] == "incomplete"
    assert {rows["step-2"]["status"], rows["step-3"]["status"]} == {"committed"}
    assert shardckpt.latest(str(root)) == str(root / "step-3")
    _assert_holds(str(root / "step-2"), 2)
    _assert_holds(str(root / "step-3"), 3)
    # Finishing the job: gc removes the half-deleted checkpoint and the one retention had still to prune.
    plan = gc(str(root), keep_last=1, grace=0)
    assert plan.ok and sorted(action.checkpoint for action in plan.actions) == ["step-1", "step-2"]
    assert sorted(os.listdir(root)) == ["step-3"]
    _assert_holds(str(root / "step-3"), 3)
