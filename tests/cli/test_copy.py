"""`shardckpt copy` through the real entry point (issue 26.6): an incremental checkpoint copied with its parents,
materialised, or refused with the way out; across storages (local -> S3 -> local); checked before COMMITTED, which
a failed or interrupted copy never gets; a lone `cp -r` named as missing its parent by load, ls and inspect."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardckpt
from shardckpt.errors import IntegrityError, NotCommittedError, ShardckptUsageError
from shardckpt.ops.copy import copy_checkpoint
from shardckpt.tools.materialize import materialize

ENTRY_POINT = str(Path(sys.executable).with_name("shardckpt"))


def cli(*args: str, columns: int = 80) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": str(columns)}
    return subprocess.run([ENTRY_POINT, *args], capture_output=True, text=True, timeout=120, env=env)


def _series(root: str) -> dict[str, torch.Tensor]:
    """Three saves of an incremental series; 'frozen' never changes, so steps 2 and 3 hold it by reference."""
    state = {"frozen": torch.arange(4096, dtype=torch.float32), "w": torch.zeros(64), "step": 0}
    checkpointer = shardckpt.Checkpointer(root, every_steps=1, incremental=True, preemption_signals=())
    for step in (1, 2, 3):
        state["w"].fill_(step)
        state["step"] = step
        checkpointer.maybe_save(step, state)
    checkpointer.close()
    return state


def _loaded(url: str, storage_options: dict | None = None) -> dict[str, torch.Tensor]:
    into = {"frozen": torch.zeros(4096), "w": torch.zeros(64), "step": -1}
    shardckpt.load(into, url, storage_options=storage_options)
    return into


def _same(a: dict, b: dict) -> bool:
    return torch.equal(a["frozen"], b["frozen"]) and torch.equal(a["w"], b["w"]) and a["step"] == b["step"]


def test_an_incremental_checkpoint_copies_with_its_parents_or_materialised(tmp_path) -> None:
    root = tmp_path / "run"
    state = _series(str(root))
    newest = str(root / "step-00000003")
    assert shardckpt.open(newest).marker.references  # the premise: step 3 references step 1's file

    refused = cli("copy", newest, f"{tmp_path / 'archive'}/")
    assert refused.returncode == 2, refused.stderr
    assert "--with-parents" in refused.stderr and "--materialize" in refused.stderr
    assert not (tmp_path / "archive" / "step-00000003" / "COMMITTED").exists()

    done = cli("copy", "--json", "--with-parents", newest, f"{tmp_path / 'archive'}/")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert [Path(url).name for url in report["committed"]] == ["step-00000001", "step-00000003"]
    assert _same(_loaded(str(tmp_path / "archive" / "step-00000003")), state)
    assert cli("verify", str(tmp_path / "archive" / "step-00000003")).returncode == 0
    into_root = cli("copy", newest, str(tmp_path / "archive"))  # no '/': the root itself would become a checkpoint
    assert into_root.returncode == 2 and "already exists" in into_root.stderr, into_root.stderr
    inside = cli("copy", newest, f"{newest}/copy")
    assert inside.returncode == 2 and "into itself" in inside.stderr, inside.stderr
    again = cli("copy", "--json", "--with-parents", newest, f"{tmp_path / 'archive'}/")  # a re-run: nothing to do
    assert again.returncode == 0 and json.loads(again.stdout)["committed"] == [], again.stderr

    alone = tmp_path / "alone" / "final"
    materialized = cli("copy", "--materialize", newest, str(alone))
    assert materialized.returncode == 0, materialized.stderr
    assert shardckpt.open(str(alone)).marker.references == ()
    assert shardckpt.open(str(alone)).marker.step == 3
    assert _same(_loaded(str(alone)), state)
    assert cli("verify", str(alone)).returncode == 0


def test_a_lone_copy_of_an_incremental_checkpoint_says_its_parent_is_missing(tmp_path) -> None:
    _series(str(tmp_path / "run"))
    shutil.copytree(tmp_path / "run" / "step-00000003", tmp_path / "archive" / "step-00000003")  # cp -r
    with pytest.raises(NotCommittedError, match=r"step-00000001, which is missing.*--with-parents"):
        _loaded(str(tmp_path / "archive" / "step-00000003"))
    rows = json.loads(cli("ls", "--json", str(tmp_path / "archive")).stdout)["checkpoints"]
    assert rows[0]["parents"] == ["step-00000001"] and rows[0]["missing_parents"] == ["step-00000001"]
    table = cli("ls", str(tmp_path / "archive"), columns=120).stdout
    assert "parents" in table and "missing step-00000001" in table, table
    # Narrow terminals: the column may be cut (the table rework fits names), but "missing" comes first.
    assert "missing" in cli("ls", str(tmp_path / "archive"), columns=80).stdout
    shown = cli("inspect", str(tmp_path / "archive" / "step-00000003"))
    assert "step-00000001 missing" in shown.stdout, shown.stdout
    parents = json.loads(cli("inspect", "--json", str(tmp_path / "archive" / "step-00000003")).stdout)["parents"]
    assert [(p["name"], p["present"]) for p in parents] == [("step-00000001", False)]


def test_copy_local_to_s3_and_back(tmp_path, s3_server, s3_url) -> None:
    state = _series(str(tmp_path / "run"))
    endpoint = f"--storage-option=endpoint_url={s3_server.endpoint}"
    up = cli("copy", endpoint, "--with-parents", str(tmp_path / "run" / "step-00000003"), f"{s3_url}/")
    assert up.returncode == 0, up.stderr
    listed = json.loads(cli("ls", "--json", endpoint, s3_url).stdout)["checkpoints"]
    assert [(r["name"], r.get("parents")) for r in listed] == [
        ("step-00000001", None),
        ("step-00000003", ["step-00000001"]),
    ]
    down = cli("copy", endpoint, "--materialize", f"{s3_url}/step-00000003", str(tmp_path / "back"))
    assert down.returncode == 0, down.stderr
    assert _same(_loaded(str(tmp_path / "back")), state)


def test_a_failed_or_interrupted_copy_is_never_committed_and_a_rerun_finishes_it(tmp_path) -> None:
    shardckpt.save({"w": torch.arange(50_000, dtype=torch.float32)}, str(tmp_path / "src"), step=1)

    def stop(nbytes: int) -> None:
        raise KeyboardInterrupt  # the user's ^C (or a lost machine) in the middle of the data

    target = str(tmp_path / "dst")
    with pytest.raises(KeyboardInterrupt):
        copy_checkpoint(str(tmp_path / "src"), target, progress=stop)
    assert not (tmp_path / "dst" / "COMMITTED").exists()
    finished = cli("copy", "--json", str(tmp_path / "src"), target)
    assert finished.returncode == 0, finished.stderr
    assert json.loads(finished.stdout)["kept_files"] >= 1
    assert torch.equal(shardckpt.open(target).read("w"), torch.arange(50_000, dtype=torch.float32))

    data = next((tmp_path / "src" / "data").iterdir())
    raw = bytearray(data.read_bytes())
    raw[-100] ^= 0xFF  # a flipped bit in the source: the copy must not commit it
    data.chmod(0o644)
    data.write_bytes(bytes(raw))
    bad = cli("copy", str(tmp_path / "src"), str(tmp_path / "bad"))
    assert bad.returncode == 3 and "fails its checks" in bad.stderr, bad.stderr
    assert not (tmp_path / "bad" / "COMMITTED").exists()
    with pytest.raises(IntegrityError):
        copy_checkpoint(str(tmp_path / "src"), str(tmp_path / "bad"))
    shardckpt.save({"w": torch.ones(2)}, str(tmp_path / "other"), step=9)
    refused = cli("copy", str(tmp_path / "other"), target)  # onto another committed checkpoint
    assert refused.returncode != 0 and "never overwritten" in refused.stderr, refused.stderr


def test_a_copy_interrupted_inside_a_data_file_is_finished_by_a_rerun(tmp_path, monkeypatch) -> None:
    # Found by an outside test: an interruption between two chunks of one file (any file over COPY_CHUNK, so any
    # real data file) left it short, and every rerun refused it ("delete the destination and copy again") instead
    # of finishing the copy as promised.
    expected = torch.arange(50_000, dtype=torch.float32)
    shardckpt.save({"w": expected}, str(tmp_path / "src"), step=1)
    monkeypatch.setattr("shardckpt.ops.copy.COPY_CHUNK", 4096)
    written: list[int] = []

    def stop(nbytes: int) -> None:
        written.append(nbytes)
        if len(written) == 5:  # the manifest, then a few chunks into the data file
            raise KeyboardInterrupt

    target = tmp_path / "dst"
    with pytest.raises(KeyboardInterrupt):
        copy_checkpoint(str(tmp_path / "src"), str(target), progress=stop)
    data = next((tmp_path / "src" / "data").iterdir())
    assert 0 < (target / "data" / data.name).stat().st_size < data.stat().st_size  # the premise: a short file
    assert not (target / "COMMITTED").exists()
    report = copy_checkpoint(str(tmp_path / "src"), str(target))
    assert report.committed == [str(target)]
    assert torch.equal(shardckpt.open(str(target)).read("w"), expected)


def test_a_copy_into_the_source_through_a_link_is_refused(tmp_path) -> None:
    # Found by an outside test: "into itself" compared the spelled paths, so a link to the source's root let a copy
    # land inside the source, where deleting the source (gc, retention) would take the committed copy with it.
    shardckpt.save({"w": torch.ones(3)}, str(tmp_path / "run" / "step-00000001"), step=1)
    (tmp_path / "alias").symlink_to(tmp_path / "run")
    inside = str(tmp_path / "alias" / "step-00000001" / "copy")
    with pytest.raises(ShardckptUsageError, match="into itself"):
        copy_checkpoint(str(tmp_path / "run" / "step-00000001"), inside)
    assert not (tmp_path / "run" / "step-00000001" / "copy").exists()
    with pytest.raises(ShardckptUsageError, match="into itself"):
        materialize(str(tmp_path / "run" / "step-00000001"), inside)
    with pytest.raises(ShardckptUsageError, match="into itself"):  # --materialize had no such check at all
        materialize(str(tmp_path / "run" / "step-00000001"), str(tmp_path / "run" / "step-00000001" / "copy"))
    assert not (tmp_path / "run" / "step-00000001" / "copy").exists()


def test_a_source_file_of_another_size_than_its_manifest_says_is_refused_before_any_byte_is_copied(tmp_path) -> None:
    # Found by an outside test: a data file replaced by a link to another file (a key, a password file) was copied
    # whole into the destination (an S3 bucket, say) before the checks refused the copy, and stayed there.
    shardckpt.save({"w": torch.ones(1000)}, str(tmp_path / "src"), step=1)
    secret = tmp_path / "secret"
    secret.write_bytes(b"not checkpoint data\n" * 100)
    data = next((tmp_path / "src" / "data").iterdir())
    data.unlink()
    data.symlink_to(secret)
    with pytest.raises(IntegrityError, match=data.name):
        copy_checkpoint(str(tmp_path / "src"), str(tmp_path / "dst"))
    copied = tmp_path / "dst" / "data" / data.name
    assert not copied.exists() or b"not checkpoint data" not in copied.read_bytes()


@pytest.mark.parametrize("spelled", [".", "./", "../step-00000001/.", "sub/.."])
def test_a_source_spelled_with_dots_copies_under_its_own_name(tmp_path, spelled) -> None:
    # Found by an outside test: `shardckpt copy . /archive/` from inside a checkpoint took '.' for its name and
    # wrote the checkpoint into /archive itself, not /archive/step-00000001.
    source = tmp_path / "run" / "step-00000001"
    shardckpt.save({"w": torch.ones(3)}, str(source), step=1)
    (source / "sub").mkdir()
    (tmp_path / "archive").mkdir()
    done = subprocess.run(
        [ENTRY_POINT, "copy", spelled, f"{tmp_path / 'archive'}/"], capture_output=True, text=True, cwd=source
    )
    assert done.returncode == 0, done.stderr
    assert os.listdir(tmp_path / "archive") == ["step-00000001"]
    assert shardckpt.open(str(tmp_path / "archive" / "step-00000001")).step == 1


def test_a_committed_destination_of_the_same_attempt_but_other_bytes_is_not_already_there(tmp_path) -> None:
    """Attempt ids are unique only within a checkpoint (SPEC 6.2): a destination committed under the same attempt id
    is this copy only when its COMMITTED names the same manifest bytes (SPEC 9 'Existing marker'), else a copy that
    reported "already there" would leave other data where the user believes the source's copy is."""
    vectors = Path(__file__).resolve().parents[2] / "spec" / "vectors" / "valid"
    source, other = vectors / "single_rank_basic", vectors / "objects"  # both attempt golden1
    destination = tmp_path / "dst"
    shutil.copytree(other, destination, ignore=shutil.ignore_patterns("description.json"))
    before = {path: path.read_bytes() for path in destination.rglob("*") if path.is_file()}
    refused = cli("copy", str(source), str(destination))
    assert refused.returncode != 0 and "never overwritten" in refused.stderr, refused.stdout + refused.stderr
    assert {path: path.read_bytes() for path in destination.rglob("*") if path.is_file()} == before
    again = copy_checkpoint(str(source), str(tmp_path / "copy"))  # the same checkpoint copied twice: already there
    assert copy_checkpoint(str(source), str(tmp_path / "copy")).already_there == [again.committed[0]]
    # A parent at the destination's root under the referenced name and attempt, but not the source's parent.
    root = tmp_path / "root"
    shutil.copytree(other, root / "step-1", ignore=shutil.ignore_patterns("description.json"))
    child = cli("copy", "--with-parents", str(vectors / "references_basic" / "step-2"), f"{root}/")
    assert child.returncode != 0 and "copy to another root" in child.stderr, child.stdout + child.stderr
    assert sorted(path.name for path in root.iterdir()) == ["step-1"]  # refused before writing anything
