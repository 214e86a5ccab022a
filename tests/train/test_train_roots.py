"""The bundled training loop pointed at a root that already holds another run's checkpoints (issue 13, finding 0).

Without --resume it refuses (a forgotten --resume would otherwise train beside the old run, whose higher steps stay
the newest); with --ignore-existing it trains, warns, and keeps every checkpoint it just saved.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import shardckpt
from tests.helpers.checkpoints import sample_state, save_sharded


def _train(root: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """One rank, in this process's interpreter (the loop sets up a one-rank group itself)."""
    command = [sys.executable, "-m", "shardckpt.train", "--ckpt", str(root), "--steps", "2", "--ckpt-every", "1"]
    command += ["--cpu", "--d-model", "16", "--layers", "1", "--heads", "2", "--global-batch", "2", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)


def test_a_new_run_into_an_old_root_is_refused_then_kept_with_a_warning(tmp_path: Path) -> None:
    root = tmp_path / "old"
    for step in (70, 80, 90):
        save_sharded(sample_state(step), str(root / f"step-{step:08d}"), 1, step=step)
    before = sorted(os.listdir(root))
    refused = _train(root)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "already holds committed checkpoints" in refused.stderr and "--resume" in refused.stderr, refused.stderr
    assert sorted(os.listdir(root)) == before
    done = _train(root, "--ignore-existing", "--keep-last", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING: step 2 is below step 90" in done.stdout, done.stdout
    first = _new_names(root, before)
    assert [name[:14] for name in first] == ["step-00000002-"]
    assert shardckpt.open(str(root / first[0])).step == 2


def _new_names(root: Path, before: list[str]) -> list[str]:
    return sorted(set(os.listdir(root)) - set(before))


def test_ignore_existing_twice_with_the_same_cadence_never_meets_a_taken_name(tmp_path: Path) -> None:
    """Issue 23.13: a second --ignore-existing run beside the first trained to its first checkpoint and died on
    'step-00000002 already holds a committed checkpoint'. Each such run names its checkpoints with its run id."""
    root = tmp_path / "old"
    save_sharded(sample_state(90), str(root / "step-00000090"), 1, step=90)
    before = sorted(os.listdir(root))
    runs = [_train(root, "--ignore-existing", "--keep-last", "1") for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stdout + run.stderr
        assert "checkpoints are named step-XXXXXXXX-" in run.stdout, run.stdout
    # Retention keeps the newest (the old run's step 90) and the checkpoint each run saved last.
    names = _new_names(root, before)
    assert len(names) == 1 and names[0].startswith("step-00000002-"), names
    assert shardckpt.open(str(root / names[0])).step == 2


def test_a_fresh_root_is_not_refused(tmp_path: Path) -> None:
    fresh = _train(tmp_path / "fresh")
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    assert "WARNING" not in fresh.stdout
    assert shardckpt.latest(str(tmp_path / "fresh")) == str(tmp_path / "fresh" / "step-00000002")


def test_a_new_run_beside_an_old_runs_local_checkpoints_is_refused(tmp_path: Path) -> None:
    """The old run died before its first persistent save (every 500 steps, local every 25): only its local tier
    holds its steps. A new run without --resume would train from scratch beside them, and a later --resume would
    take the old run's higher local step over its own; refused, as an old persistent root is."""
    root, local = tmp_path / "run", tmp_path / "local"
    import torch

    old = shardckpt.Checkpointer(str(root), every_steps=500, local_root=str(local), local_every_steps=1)
    for step in (40, 41):
        old.maybe_save(step, {"w": torch.full((4,), float(step))})
    old.close()
    before = sorted(os.listdir(local))
    refused = _train(root, "--local-root", str(local), "--local-every", "1")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "already holds local checkpoints" in refused.stderr and "--resume" in refused.stderr, refused.stderr
    assert sorted(os.listdir(local)) == before and shardckpt.latest(str(root)) is None
