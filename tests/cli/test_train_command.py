"""`shardckpt train` is the same command as `python -m shardckpt.train`: it takes the loop's options, --help included
(through the real console entry point, at 80 columns)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest


def _shardckpt(*args: str) -> subprocess.CompletedProcess[str]:
    command = shutil.which("shardckpt", path=os.path.dirname(sys.executable)) or "shardckpt"
    env = {**os.environ, "COLUMNS": "80", "OMP_NUM_THREADS": "1"}
    return subprocess.run([command, *args], capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.slow
def test_train_takes_the_loops_options(tmp_path) -> None:
    shown = _shardckpt("train", "--help")
    assert shown.returncode == 0, shown.stderr
    assert "--ckpt" in shown.stdout and "--resume" in shown.stdout
    assert max(len(line) for line in shown.stdout.splitlines()) <= 80
    assert "--compression" in shown.stdout and "--compression-pace" in shown.stdout
    options = ["--ckpt-every", "3", "--cpu", "--compression", "zstd", "--compression-pace", "storage"]
    ran = _shardckpt("train", "--ckpt", str(tmp_path / "run"), "--steps", "3", *options)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "checkpoint step 3" in ran.stdout
    assert (tmp_path / "run" / "step-00000003" / "COMMITTED").exists()
    assert '"version": [\n  1,\n  2\n ]' in (tmp_path / "run" / "step-00000003" / "COMMITTED").read_text()
