"""The shardckpt command: inspect, verify and ls outputs, --json, and exit codes 0/1/2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import s3fs
import torch

import shardckpt
from shardckpt.cli import main as cli_main
from shardckpt.cli.common import EXIT_ERROR
from tests.helpers.checkpoints import S3_BUCKET, sample_state, save_sharded


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shardckpt.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_inspect_json_and_table(tmp_path) -> None:
    url = str(tmp_path / "ck")
    save_sharded(sample_state(), url, 2)
    result = run("inspect", "--json", url)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["status"] == "committed" and summary["world_size"] == 2
    tensors = {t["name"]: t for t in summary["tensors"]}
    assert tensors["w"]["shape"] == [37, 11] and tensors["w"]["dtype"] == "F32"
    assert tensors["w"]["pieces_per_rank"] == {"0": 1, "1": 1}
    table = run("inspect", url)
    assert table.returncode == 0 and "committed" in table.stdout and "rank_info" in table.stdout


@pytest.mark.slow
def test_verify_exit_codes(tmp_path) -> None:
    url = str(tmp_path / "ck")
    save_sharded(sample_state(), url, 2)
    ok = run("verify", "--json", url)
    assert ok.returncode == 0 and json.loads(ok.stdout)["ok"] is True
    data = sorted(os.listdir(os.path.join(url, "data")))[0]
    path = os.path.join(url, "data", data)
    with open(path, "r+b") as handle:
        handle.seek(os.path.getsize(path) - 5)
        handle.write(b"\xff")
    bad = run("verify", url)
    assert bad.returncode == 1 and data in bad.stdout and "FAILED" in bad.stdout
    assert run("verify").returncode == 2
    assert run("frobnicate", url).returncode == 2


@pytest.mark.slow
def test_inspect_incomplete_and_ls(tmp_path) -> None:
    root = tmp_path / "root"
    shardckpt.save({"a": torch.ones(3)}, str(root / "step-1"), step=1)
    writer = shardckpt.ShardWriter(str(root / "step-2"), rank=0, world_size=2, step=2)
    writer.add("a", torch.ones(1), global_shape=(2,), offsets=(0,))
    writer.close()
    assert cli_main(["inspect", str(root / "step-2")]) == 1
    listing = run("ls", "--json", str(root))
    assert listing.returncode == 0
    rows = {r["name"]: r for r in json.loads(listing.stdout)["checkpoints"]}
    assert rows["step-1"]["status"] == "committed" and rows["step-1"]["step"] == 1
    assert rows["step-2"]["status"] == "incomplete"
    table = run("ls", str(root))
    assert "incomplete" in table.stdout and "committed" in table.stdout


def test_errors_are_one_line(tmp_path) -> None:
    result = run("inspect", str(tmp_path / "missing"))
    assert result.returncode == EXIT_ERROR
    result = run("verify", str(tmp_path / "missing"))
    assert result.returncode == EXIT_ERROR and "Traceback" not in result.stderr + result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("command", ["inspect", "verify", "ls"])
def test_help_for_every_command(command: str) -> None:
    result = run(command, "--help")
    assert result.returncode == 0 and "--json" in result.stdout


def test_inspect_verify_ls_on_s3_with_storage_options(s3_server, s3_url, monkeypatch, capsys) -> None:
    save_sharded(sample_state(), f"{s3_url}/step-1", 2)  # written through the AWS_* environment
    writer = shardckpt.ShardWriter(f"{s3_url}/step-2", rank=0, world_size=2, step=2)
    writer.add("a", torch.ones(1), global_shape=(2,), offsets=(0,))
    writer.close()
    # From here on the commands get the endpoint and credentials from --storage-option alone.
    for name in [name for name in os.environ if name.startswith("AWS_")]:
        monkeypatch.delenv(name)
    options = s3_server.storage_options()
    flags = [f"--storage-option=endpoint_url={s3_server.endpoint}"]
    flags += [f"--storage-option=key={options['key']}", f"--storage-option=secret={options['secret']}"]

    def cli_json(*args: str) -> dict:
        assert cli_main([*args, "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)

    assert cli_json("inspect", f"{s3_url}/step-1")["world_size"] == 2
    rows = {r["name"]: r["status"] for r in cli_json("ls", s3_url)["checkpoints"]}
    assert rows == {"step-1": "committed", "step-2": "incomplete"}
    assert cli_main(["inspect", *flags, f"{s3_url}/step-2"]) == 1
    verify = run("verify", "--json", *flags, f"{s3_url}/step-1")  # the real command line, once
    assert verify.returncode == 0 and json.loads(verify.stdout)["ok"] is True, verify.stdout + verify.stderr

    raw = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    data = sorted(raw.ls(f"{s3_url.removeprefix('s3://')}/step-1/data", refresh=True))[0]
    corrupted = bytearray(raw.cat_file(data))
    corrupted[-5] ^= 0xFF
    raw.pipe_file(data, bytes(corrupted))  # a plain overwrite, as a faulty disk or a stray tool would do
    capsys.readouterr()
    assert cli_main(["verify", "-q", *flags, f"{s3_url}/step-1"]) == 1
    bad = capsys.readouterr()
    assert os.path.basename(data) in bad.out and "FAILED" in bad.out

    assert cli_main(["ls", *flags, f"s3://no-such-bucket-{S3_BUCKET}/x"]) == EXIT_ERROR
    missing = capsys.readouterr()
    assert "no-such-bucket" in missing.err and "Traceback" not in missing.err


def _exit_code(argv: list[str]) -> object:
    try:
        return cli_main(argv)
    except SystemExit as exc:  # argparse's usage errors
        return exc.code


STORAGE_OPTION_COMMANDS = [
    ["inspect", "URL"],
    ["verify", "URL"],
    ["ls", "URL"],
    ["gc", "URL"],
    ["du", "URL"],
    ["diff", "URL", "URL"],
    ["export", "URL", "OUT"],
    ["import-dcp", "URL", "URL"],
    ["import-deepspeed", "URL", "URL"],
]


@pytest.mark.parametrize("bad", ["bad", "=value", "config_kwargs={not json"])
@pytest.mark.parametrize("command", STORAGE_OPTION_COMMANDS, ids=lambda command: command[0])
def test_a_malformed_storage_option_is_a_usage_error(tmp_path, capsys, command: list[str], bad: str) -> None:
    argv = [str(tmp_path / "missing") if word in ("URL", "OUT") else word for word in command]
    assert _exit_code([*argv, "--storage-option", bad]) == 2
    assert "--storage-option" in capsys.readouterr().err
