"""The first hour of a new user (issue 16), through the real `shardckpt` entry point at COLUMNS=80: every mistake
explained, names whole, strict JSON, gc's grace period as documented, --version, export --force."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardckpt
from shardckpt.cli.common import EXIT_ERROR, EXIT_FAILED
from shardckpt.errors import NotFoundError
from tests.helpers.checkpoints import save_sharded

ENTRY_POINT = str(Path(sys.executable).with_name("shardckpt"))
COMMANDS = ["ls", "inspect", "verify", "du", "gc", "diff", "export", "import-dcp", "import-deepspeed"]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "80"}
    return subprocess.run([ENTRY_POINT, *args], capture_output=True, text=True, timeout=120, env=env)


def _strict(text: str) -> object:
    def refuse(constant: str) -> object:
        raise AssertionError(f"not strict JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.slow
def test_each_wrong_place_says_what_it_is_and_what_to_do(tmp_path) -> None:
    root = tmp_path / "run"
    shardckpt.save({"w": torch.ones(2)}, str(root / "step-00000001"), step=1)
    (tmp_path / "empty").mkdir()
    dcp = tmp_path / "dcp"
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"x")
    (dcp / "__0_0.distcp").write_bytes(b"x")
    writer = shardckpt.ShardWriter(str(tmp_path / "half"), rank=0, world_size=2, step=2)
    writer.add("a", torch.ones(1), global_shape=(2,), offsets=(0,))
    writer.close()
    with pytest.raises(NotFoundError, match="does not exist"):
        shardckpt.open(str(tmp_path / "rnu" / "step-00000001"))  # a typo
    with pytest.raises(shardckpt.NotCommittedError, match=r"root of 1 checkpoint.*latest.*shardckpt ls"):
        shardckpt.open(str(root))
    expected = {
        "rnu": "does not exist",
        "empty": "exists but is empty",
        "run": "root of 1 checkpoint(s) (e.g. step-00000001)",
        "dcp": "shardckpt import-dcp",
        "half": "a save failed or is still running",
    }
    for name, message in expected.items():
        result = cli("inspect", str(tmp_path / name))
        code = EXIT_FAILED if name == "half" else EXIT_ERROR  # an incomplete checkpoint is a verdict, the rest errors
        assert result.returncode == code and message in result.stdout + result.stderr, (name, result)
    missing = cli("ls", str(tmp_path / "rnu"))
    assert missing.returncode == EXIT_ERROR and "does not exist" in missing.stderr and missing.stdout == ""
    empty = cli("ls", "--json", str(tmp_path / "empty"))
    assert empty.returncode == 0 and "is empty" in _strict(empty.stdout)["note"]


def _many_names(url: str) -> list[str]:
    names = [
        f"optim.state.model.transformer.blocks.{b}.{part}.weight.{key}"
        for b in range(8)
        for part in ("attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")
        for key in ("exp_avg", "exp_avg_sq")
    ]
    shardckpt.save({name: torch.ones(3, 2) for name in names}, url, step=7)
    return names


def test_inspect_piped_gives_one_record_per_line_with_every_name_whole(tmp_path) -> None:
    url = str(tmp_path / "ck")
    names = _many_names(url)
    table = cli("inspect", url)
    assert table.returncode == 0, table.stderr
    assert "\x1b" not in table.stdout, table.stdout
    shown = [line.split()[0] for line in table.stdout.splitlines() if line.startswith("optim.")]
    assert sorted(shown) == sorted(names)  # whole and distinct (issue 26.5: no name loses its middle)
    picked = cli("inspect", url, "--filter", r"blocks\.3\..*dense_4h")
    rows = [line for line in picked.stdout.splitlines() if "F32" in line]
    assert picked.returncode == 0 and len(rows) == 2 and "2 tensors matching" in picked.stdout
    tree = cli("inspect", url, "--tree", "--filter", r"blocks\.[01]\.")
    assert tree.returncode == 0
    assert "      query_key_value.weight.  " in tree.stdout and "8 tensors" in tree.stdout
    assert "        exp_avg_sq  " in tree.stdout  # leaves under their prefix, whole


@pytest.mark.slow
@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_fits_80_columns(command: str) -> None:
    result = cli(*([command] if command else []), "--help")
    assert result.returncode == 0
    assert max(map(len, result.stdout.splitlines())) <= 80, result.stdout


def test_inspect_json_is_strict_and_whole(tmp_path) -> None:
    url = str(tmp_path / "ck")
    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "params": list(range(300)), "eps": math.nan}]
    state = {"w": torch.ones(2), "groups": groups, "blob": b"\x00\xff", "limits": {1: -math.inf, "x": math.inf}}
    shardckpt.save(state, url, step=1)
    result = cli("inspect", "--json", url)
    assert result.returncode == 0, result.stderr
    objects = {o["name"]: o["value"] for o in _strict(result.stdout)["objects"]}
    assert objects["groups"] == [
        {"lr": 1e-3, "betas": [0.9, 0.999], "params": list(range(300)), "eps": {"$float": "nan"}}
    ]
    assert objects["blob"] == {"$bytes": "AP8="}
    assert objects["limits"] == {"$map": [[1, {"$float": "-inf"}], ["x", {"$float": "inf"}]]}
    assert "$bytes" in cli("inspect", "--help").stdout


def test_gc_grace_protects_unfinished_saves_only_as_documented(tmp_path) -> None:
    root = tmp_path / "run"
    for step in (1, 2):
        shardckpt.save({"w": torch.ones(2)}, str(root / f"step-{step}"), step=step)
    writer = shardckpt.ShardWriter(str(root / "step-3"), rank=0, world_size=2, step=3)
    writer.add("a", torch.ones(1), global_shape=(2,), offsets=(0,))
    writer.close()
    help_text = " ".join(cli("gc", "--help").stdout.split())
    assert "Under a root of full checkpoints, --keep-last N deletes every committed checkpoint" in help_text
    assert "keep uncommitted checkpoints and leftovers modified within" in help_text
    result = cli("gc", str(root), "--keep-last", "1", "--json")  # everything is seconds old: within the grace
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(root)) == ["step-2", "step-3"]  # the committed step-1 went, the running save stayed


@pytest.mark.slow
def test_version_counts_and_ls_agrees_with_du(tmp_path) -> None:
    version = cli("--version")
    assert version.returncode == 0 and version.stdout.startswith(f"shardckpt {shardckpt.__version__} (checkpoint")
    root = tmp_path / "run"
    save_sharded({"w": torch.ones(40, 3)}, str(root / "step-1"), 1)
    shown = cli("inspect", str(root / "step-1")).stdout
    assert "1 rank," in shown and "1 ranks" not in shown
    listed = _strict(cli("ls", "--json", str(root)).stdout)["checkpoints"][0]
    usage = _strict(cli("du", "--json", str(root)).stdout)["checkpoints"][0]
    assert listed["bytes"] == usage["data_bytes"] < usage["committed_bytes"]
    assert "data files" in " ".join(cli("ls", "--help").stdout.split())


@pytest.mark.slow
def test_export_force_replaces_only_a_previous_export(tmp_path) -> None:
    url, out = str(tmp_path / "ck"), tmp_path / "hf"
    shardckpt.save({"model.w": torch.ones(4, 2), "model.b": torch.ones(3)}, url, step=1)
    assert cli("export", url, str(out)).returncode == 0
    again = cli("export", url, str(out))
    assert again.returncode == EXIT_ERROR and "--force" in again.stderr
    (out / "config.json").write_text("{}")  # the user's own file beside the export: kept
    assert cli("export", url, str(out), "--force").returncode == 0
    assert sorted(os.listdir(out)) == [
        "config.json",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]
    (out / "model-00009-of-00009.safetensors").write_bytes(b"not named by the index")
    refused = cli("export", url, str(out), "--force")
    assert refused.returncode == EXIT_ERROR and "does not name" in refused.stderr
    assert (out / "model.safetensors.index.json").exists()  # nothing deleted
    refused = cli("export", url, str(tmp_path / "ck"), "--force")  # a checkpoint is never replaced
    assert refused.returncode == EXIT_ERROR and os.path.exists(os.path.join(url, "COMMITTED"))
