"""Exit codes and --json a script can trust, and a mistyped root said out loud (issue 26.1, 26.4, 26.8), through the
real `shardckpt` entry point and the public API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import shardckpt
from shardckpt.api import NoCheckpointWarning
from shardckpt.cli import main as cli_main
from shardckpt.cli.common import EXIT_ERROR, EXIT_FAILED, EXIT_OK, EXIT_USAGE

ENTRY_POINT = str(Path(sys.executable).with_name("shardckpt"))


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "80"}
    return subprocess.run([ENTRY_POINT, *args], capture_output=True, text=True, timeout=120, env=env)


def _json_error(result: subprocess.CompletedProcess[str]) -> dict[str, object]:
    error = json.loads(result.stdout)["error"]
    assert set(error) == {"type", "message", "exit_code"} and error["exit_code"] == result.returncode, error
    return error  # type: ignore[no-any-return]


def test_a_missing_place_is_one_error_code_for_every_command_and_json_says_so(tmp_path: Path, capsys) -> None:
    """Issue 26.4 and 26.1: every command exits EXIT_ERROR (not "differs", not "check failed") on a root or checkpoint
    that does not exist, and with --json prints the error as JSON on stdout."""
    url = str(tmp_path / "ck")
    shardckpt.save({"model.w": torch.ones(2)}, url, step=1)
    missing = str(tmp_path / "ROOT-typo")
    commands = [
        ["ls", missing],
        ["du", missing],
        ["gc", missing, "--keep-last", "1"],
        ["inspect", missing],
        ["verify", missing],
        ["diff", missing, url],
        ["diff", url, missing],
        ["export", missing, str(tmp_path / "out")],
        ["import-dcp", missing, str(tmp_path / "imported")],
        ["import-deepspeed", missing, str(tmp_path / "imported")],
    ]
    # Two through the installed entry point (its exit status is main's), every one in process (the same main, a
    # second faster each): the suite's time goes to what differs between commands.
    for argv in commands[:1] + commands[-1:]:
        text = cli(*argv)
        assert text.returncode == EXIT_ERROR and text.stdout == "", (argv, text)
        assert text.stderr.startswith("shardckpt: error: ") and text.stderr.count("\n") == 1, (argv, text.stderr)
    for argv in commands:
        assert cli_main(argv) == EXIT_ERROR, argv
        text = capsys.readouterr()
        assert text.out == "", (argv, text)
        assert text.err.startswith("shardckpt: error: ") and text.err.count("\n") == 1, (argv, text.err)
        assert "ROOT-typo" in text.err, (argv, text.err)
        assert cli_main([*argv, "--json"]) == EXIT_ERROR, argv
        out = capsys.readouterr().out
        error = json.loads(out)["error"]
        assert set(error) == {"type", "message", "exit_code"} and error["exit_code"] == EXIT_ERROR, error
        assert error["type"] == "NotFoundError" and "ROOT-typo" in str(error["message"]), (argv, error)
    for argv in (["ls", missing], ["du", missing], ["gc", missing, "--keep-last", "1"]):
        assert cli_main(argv) == EXIT_ERROR and "does not exist" in capsys.readouterr().err, argv
    assert cli_main(["diff", url, url]) == EXIT_OK
    usage = cli("ls", "--json", "--no-such-option", missing)
    assert usage.returncode == EXIT_USAGE and _json_error(usage)["type"] == "UsageError"
    assert "--no-such-option" in str(_json_error(usage)["message"])
    epilog = " ".join(cli("--help").stdout.split())
    assert "3 error" in epilog and "2 usage error" in epilog and "(diff) they differ" in epilog


def test_diff_that_differs_is_not_an_error(tmp_path: Path) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    shardckpt.save({"w": torch.ones(2)}, a, step=1)
    shardckpt.save({"w": torch.zeros(2)}, b, step=1)
    assert cli("diff", a, b).returncode == EXIT_FAILED
    differs = cli("diff", a, b, "--json")
    assert differs.returncode == EXIT_FAILED and json.loads(differs.stdout)["identical"] is False


def test_a_mistyped_root_is_said_by_latest_and_restore_latest(tmp_path: Path) -> None:
    """Issue 26.1: a start from scratch names the root and what it is; a root that exists but is empty says so."""
    typo = str(tmp_path / "ROOT-typo")
    with pytest.warns(NoCheckpointWarning, match=r"ROOT-typo: it does not exist .*starts from scratch"):
        assert shardckpt.latest(typo) is None
    with pytest.warns(NoCheckpointWarning, match=r"ROOT-typo: it does not exist"):
        assert shardckpt.Checkpointer(typo).restore_latest({"w": torch.ones(2)}) is None
    (tmp_path / "fresh").mkdir()
    with pytest.warns(NoCheckpointWarning, match=r"fresh: it is empty"):
        assert shardckpt.latest(str(tmp_path / "fresh")) is None
    shardckpt.save({"w": torch.ones(2)}, str(tmp_path / "run" / "step-1"), step=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a root with a committed checkpoint: nothing to say
        assert shardckpt.latest(str(tmp_path / "run")) == str(tmp_path / "run" / "step-1")


def test_gc_says_which_checkpoints_it_kept_back_and_why(tmp_path: Path) -> None:
    """Issue 26.8: on a root of recent incremental checkpoints gc --keep-last deletes nothing, and says why; its help
    no longer claims that recent committed checkpoints always go."""
    root = tmp_path / "run"
    parent = None
    for step in (1, 2, 3):
        url = str(root / f"step-{step}")
        state = {"frozen": torch.ones(256), "w": torch.full((4,), float(step))}
        shardckpt.save(state, url, step=step, parent=parent, piece_hashes=True)
        parent = url
    result = cli("gc", str(root), "--keep-last", "1")
    assert result.returncode == EXIT_OK, result.stderr
    for name in ("step-1", "step-2"):
        assert f"{name}: kept (committed, older than the newest 1, but within the grace period" in result.stdout
    assert sorted(os.listdir(root)) == ["step-1", "step-2", "step-3"]
    summary = json.loads(cli("gc", str(root), "--keep-last", "1", "--json").stdout)
    assert {s["checkpoint"] for s in summary["skipped"]} == {"step-1", "step-2"}
    collected = cli("gc", str(root), "--keep-last", "1", "--grace", "0")
    assert collected.returncode == EXIT_OK and "step-1: " in collected.stdout, collected.stdout
    left = sorted(os.listdir(root))
    kept_back = [line for line in collected.stdout.splitlines() if ": kept (" in line]
    assert all("reference" in line for line in kept_back) and len(kept_back) == len(left) - 1, collected.stdout
    help_text = " ".join(cli("gc", "--help").stdout.split())
    assert "deletes every committed checkpoint older than the newest N, however recent." not in help_text.replace(
        "Under a root of full checkpoints, --keep-last N deletes", ""
    )
    assert "gc names each checkpoint it kept back and why" in help_text


def test_a_root_with_a_latest_link_is_a_root_not_a_deepspeed_directory(tmp_path: Path) -> None:
    """Issue 26.8: `latest` as a link to a checkpoint (a shardckpt habit) is no sign of DeepSpeed; its file is."""
    root = tmp_path / "run"
    shardckpt.save({"w": torch.ones(2)}, str(root / "step-1"), step=1)
    os.symlink("step-1", root / "latest")
    result = cli("inspect", str(root))
    assert result.returncode == EXIT_ERROR and "is not a checkpoint but a root of" in result.stderr, result.stderr
    assert "DeepSpeed" not in result.stderr
    deepspeed = tmp_path / "ds"
    (deepspeed / "global_step5").mkdir(parents=True)
    (deepspeed / "latest").write_text("global_step5")
    assert "import-deepspeed" in cli("inspect", str(deepspeed)).stderr
    only_file = tmp_path / "ds-tagged"
    only_file.mkdir()
    (only_file / "latest").write_text("my-tag")
    assert "import-deepspeed" in cli("inspect", str(only_file)).stderr
