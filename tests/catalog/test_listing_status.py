"""ls and du classify the names under a root with one rule (catalog.classify), and a link to a checkpoint is
that checkpoint: ls shows it as an alias, du counts its bytes once."""

from __future__ import annotations

import os

from shardckpt.ops.du import disk_usage
from shardckpt.ops.ls import list_checkpoints
from tests.helpers.checkpoints import sample_state, save_sharded


def _root(tmp_path) -> str:
    root = tmp_path / "root"
    save_sharded(sample_state(0), str(root / "step-00000002"), 2, step=2)
    save_sharded(sample_state(1), str(root / "step-00000010"), 2, step=10)
    os.symlink("step-00000010", root / "latest")
    (root / "broken").mkdir()
    (root / "broken" / "COMMITTED").write_bytes(b"not msgpack")
    (root / "half" / "data").mkdir(parents=True)
    (root / "notes").mkdir()  # not a checkpoint: neither listed nor counted
    return str(root)


def test_ls_shows_a_link_as_an_alias_in_the_newest_order(tmp_path) -> None:
    rows = list_checkpoints(_root(tmp_path))["checkpoints"]
    assert [(r["name"], r["status"]) for r in rows] == [
        ("step-00000002", "committed"),
        ("latest", "alias"),
        ("step-00000010", "committed"),
        ("broken", "broken"),
        ("half", "incomplete"),
    ]
    alias = rows[1]
    assert alias["alias_of"] == "step-00000010" and alias["step"] == 10


def test_du_counts_a_checkpoint_behind_a_link_once_and_agrees_with_ls(tmp_path) -> None:
    root = _root(tmp_path)
    usage = {c.name: c for c in disk_usage(root).checkpoints}
    assert set(usage) == {"step-00000002", "step-00000010", "broken", "half"}
    statuses = {r["name"]: r["status"] for r in list_checkpoints(root)["checkpoints"] if r["status"] != "alias"}
    assert {name: c.status for name, c in usage.items()} == statuses


def test_ls_of_a_folder_of_dcp_checkpoints_says_what_they_are_and_how_to_import_one(tmp_path) -> None:
    import torch

    from tests.helpers.dcp_files import dcp_dir

    root = tmp_path / "titan"
    for step in (2, 4):
        dcp_dir(root / f"step-{step}", {"w": torch.ones(2)})
    note = list_checkpoints(str(root))["note"]
    assert note.startswith(f"no shardckpt checkpoints under {root}: it holds 2 PyTorch DCP checkpoint(s)")
    assert "(step-2, step-4)" in note and f"`shardckpt import-dcp {root / 'step-4'} NEW_URL`" in note
    # Beside shardckpt checkpoints, ls lists those and still names the DCP ones it does not list.
    save_sharded(sample_state(0), str(root / "step-6"), 2, step=6)
    listing = list_checkpoints(str(root))
    assert [row["name"] for row in listing["checkpoints"]] == ["step-6"]
    assert "also holds 2 PyTorch DCP checkpoint(s) (step-2, step-4)" in listing["note"]
