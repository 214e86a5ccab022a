"""The rank launcher (tests/helpers/launch.py) itself: what its forked ranks see, a hung rank, a failing rank.

Every multi-process test stands on it, so what it promises beyond a passing run is checked here.
"""

from __future__ import annotations

import os

import pytest

from tests.helpers.launch import run_like_torchrun, run_ranks


def test_a_hung_rank_is_killed_at_the_deadline_and_the_others_see_this_launchs_environment(
    tmp_path, monkeypatch
) -> None:
    # Set after the fork server may have started: a rank must still see it (as S3 credentials must reach ranks).
    monkeypatch.setenv("SHARDCKPT_TEST_LAUNCH", f"set by {os.getpid()}")
    args = {"hang": 1, "pid_dir": str(tmp_path), "variable": "SHARDCKPT_TEST_LAUNCH"}
    # The deadline is every rank's: 8 s leaves the others (~0.5 s of CPU each) room on a loaded machine.
    verdicts = run_ranks("launch", 3, args, timeout=8)
    assert verdicts[1] is None, verdicts[1]
    hung = int((tmp_path / "hung.pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(hung, 0)  # killed and reaped, not left running
    for rank in (0, 2):
        verdict = verdicts[rank]
        assert verdict is not None and verdict["ok"] is True, verdict
        assert verdict["value"]["variable"] == f"set by {os.getpid()}"
        assert verdict["value"]["threads"] == 1  # as OMP_NUM_THREADS=1 gives a fresh interpreter
        assert verdict["value"]["pid"] not in (os.getpid(), hung)


def test_run_like_torchrun_fails_the_test_with_the_output_of_each_rank_that_exited_otherwise_than_0(tmp_path) -> None:
    script = tmp_path / "script.py"
    script.write_text(
        "import os, sys\n"
        "print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], 'local', os.environ['LOCAL_WORLD_SIZE'])\n"
        "sys.exit(int(sys.argv[1]) if os.environ['RANK'] == '1' else 0)\n"
    )
    outputs = run_like_torchrun(2, str(script), "0")
    assert outputs == ["rank 0 of 2 local 2\n", "rank 1 of 2 local 2\n"]
    with pytest.raises(pytest.fail.Exception) as failed:
        run_like_torchrun(2, str(script), "3")
    message = str(failed.value)
    assert "{1: 3}" in message and "rank 1 of 2 local 2" in message
    assert "rank 0 of 2" not in message
