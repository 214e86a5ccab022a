"""The command line as a newcomer meets it: help with examples everywhere, progress bars only on a terminal,
one-line errors and the exit codes of the contract (0 ok, 1 failed, 2 usage, 3 error)."""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys

import pytest
import torch
from rich.console import Console

from shardckpt.cli import main as cli_main
from shardckpt.cli.common import EXIT_ERROR
from shardckpt.cli.main import build_parser, command_runner
from tests.helpers.checkpoints import save_sharded

COMMAND_NAMES = ["inspect", "verify", "ls", "gc", "export", "import-dcp", "diff", "du"]


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("name", COMMAND_NAMES)
def test_every_command_explains_itself_with_examples(name: str) -> None:
    text = subcommands()[name].format_help()
    description = text.split("\n\n")[1]
    assert len(description) > 80, description  # a sentence or two, not a fragment
    assert "examples:" in text and f"shardckpt {name} " in text.split("examples:")[1]
    assert "--json" in text and "--storage-option" in text


def test_top_level_help_lists_every_command() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "shardckpt.cli", "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0
    listed = result.stdout.split("positional arguments:")[1].split("options:")[0]
    assert all(name in listed for name in COMMAND_NAMES + ["train"])
    assert "Exit codes" in result.stdout and "examples:" in result.stdout


def run_command(argv: list[str], terminal: bool) -> tuple[int, str]:
    """Run a command in-process with a console that is (or is not) a terminal; returns (code, what it printed)."""
    args = build_parser().parse_args(argv)
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=terminal, width=160)
    return command_runner(args.command)(args, console), buffer.getvalue()


def test_progress_bars_show_bytes_and_rate_on_a_terminal_only(tmp_path, capsys) -> None:
    url = str(tmp_path / "ck")
    save_sharded({"model.w": torch.randn(512, 1024), "model.b": torch.randn(1024)}, url, 2)
    code, shown = run_command(["export", url, str(tmp_path / "tty")], terminal=True)
    assert code == 0 and "exporting" in shown and "/2.0 MiB" in shown and "MiB/s" in shown  # bytes done/total, rate
    code, shown = run_command(["diff", url, url], terminal=True)
    assert code == 0 and "comparing" in shown and "B/s" in shown
    for argv in (["export", url, str(tmp_path / "pipe")], ["diff", url, url]):
        code, shown = run_command(argv, terminal=False)
        assert code == 0 and "B/s" not in shown and "\x1b" not in shown  # a pipe gets the result, nothing else
    code, shown = run_command(["export", url, str(tmp_path / "quiet"), "-q"], terminal=True)
    assert code == 0 and "B/s" not in shown and "exported" in shown
    code, shown = run_command(["export", url, str(tmp_path / "json"), "--json"], terminal=True)
    assert code == 0 and "B/s" not in shown and shown == ""  # --json: the JSON document alone, on stdout
    assert json.loads(capsys.readouterr().out)["tensors"] == 2


def test_errors_are_one_line_with_the_exit_codes_of_the_contract(tmp_path, capsys) -> None:
    missing = str(tmp_path / "missing")
    url = str(tmp_path / "ck")
    save_sharded({"model.w": torch.ones(4, 2)}, url, 1)
    failing = [
        ["export", missing, str(tmp_path / "out")],
        ["diff", url, missing],
        ["import-dcp", missing, str(tmp_path / "imported")],
        ["import-dcp", url, str(tmp_path / "imported")],  # a shardckpt checkpoint is not a DCP one
    ]
    for argv in failing:
        assert cli_main(argv) == EXIT_ERROR, argv
        err = capsys.readouterr().err
        assert err.startswith("shardckpt: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert cli_main(["export", url, str(tmp_path / "out"), "--memory-limit", "1KiB"]) == 2
    assert "memory limit" in capsys.readouterr().err
    for argv in (["diff", url], ["du"], ["export", url, "o", "--dtype", "int3"], ["diff", url, url, "--atol", "x"]):
        with pytest.raises(SystemExit) as exit_info:
            cli_main(argv)
        assert exit_info.value.code == 2, argv
