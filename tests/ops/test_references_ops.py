"""verify, inspect and du of a format 1.1 checkpoint through the real `shardckpt` entry point, and diff / export of
it: referenced bytes are checked, shown with where they live, and counted once under the root."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import shardckpt
from shardckpt.errors import FormatError
from shardckpt.format.references import LEGACY_HASH_ALG
from shardckpt.ops.verify import verify
from shardckpt.tools.diff import diff
from shardckpt.tools.export import export_hf_safetensors
from tests.helpers.checkpoints import save_sharded
from tests.helpers.references import CHILD, PARENT, edit_local_manifest, save_incremental

ENTRY_POINT = str(Path(sys.executable).with_name("shardckpt"))


def _states() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    parent = {"base": torch.randn(40, 32, generator=generator), "head": torch.randn(4, 8, generator=generator)}
    return parent, {"head": torch.randn(4, 8, generator=generator)}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    parent, changed = _states()
    save_incremental(tmp_path / "root", parent, changed, 2)
    return tmp_path / "root"


def shardckpt_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [ENTRY_POINT, *args], capture_output=True, text=True, timeout=120, env=dict(os.environ), check=False
    )


def test_verify_inspect_and_du_follow_references_through_the_cli(root: Path) -> None:
    verified = shardckpt_cli("verify", str(root / CHILD), "--json")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    report = json.loads(verified.stdout)
    parent_attempt = json.loads((root / PARENT / "COMMITTED").read_text())["attempt"]
    base_bytes = 40 * 32 * 4
    # Both ranks' own files and the two referenced files; every referenced byte of base was read and checked.
    assert report["files"] == 4
    assert report["bytes_checked"] >= base_bytes

    inspected = shardckpt_cli("inspect", str(root / CHILD), "--json")
    assert inspected.returncode == 0, inspected.stderr
    summary = json.loads(inspected.stdout)
    paths = [f"{PARENT}/data/{rank:05d}-{parent_attempt}.safetensors" for rank in range(2)]
    assert [(entry["rank"], entry["path"], entry["bytes"]) for entry in summary["references"]] == [
        (0, paths[0], base_bytes // 2),
        (1, paths[1], base_bytes // 2),
    ]
    tensors = {tensor["name"]: tensor for tensor in summary["tensors"]}
    assert tensors["base"]["referenced"] == {"pieces": 2, "bytes": base_bytes, "from": paths}
    assert tensors["head"]["referenced"] == {"pieces": 0, "bytes": 0, "from": []}
    assert tensors["base"]["pieces_per_rank"] == {"0": 1, "1": 1}

    used = shardckpt_cli("du", str(root), "--json")
    assert used.returncode == 0, used.stderr
    rows = {row["name"]: row for row in json.loads(used.stdout)["checkpoints"]}
    parent, child = rows[PARENT], rows[CHILD]
    assert (child["referenced_bytes"], child["references"]) == (base_bytes, [PARENT])
    assert child["logical_bytes"] == child["data_bytes"] + base_bytes
    assert child["data_bytes"] < base_bytes  # the child's own files hold head only
    assert (parent["referenced_bytes"], parent["logical_bytes"]) == (0, parent["data_bytes"])
    # The parent's files, which the child references, count once in the root's total.
    assert json.loads(used.stdout)["total"]["committed_bytes"] == parent["committed_bytes"] + child["committed_bytes"]


def test_verify_reports_a_changed_referenced_byte_and_a_missing_parent_commit_through_the_cli(root: Path) -> None:
    attempt = json.loads((root / PARENT / "COMMITTED").read_text())["attempt"]
    path = root / PARENT / "data" / f"00001-{attempt}.safetensors"
    data = bytearray(path.read_bytes())
    data[8 + int.from_bytes(data[:8], "little")] ^= 1  # base's piece comes first in rank 1's file
    path.write_bytes(bytes(data))
    failed = shardckpt_cli("verify", str(root / CHILD))
    assert failed.returncode == 1, failed.stdout
    text = " ".join((failed.stdout + failed.stderr).split())
    assert str(path) in text and "fails its checksum" in text, text
    (root / PARENT / "COMMITTED").unlink()
    uncommitted = shardckpt_cli("verify", str(root / CHILD))
    assert uncommitted.returncode == 1
    text = " ".join((uncommitted.stdout + uncommitted.stderr).split())
    assert "not committed" in text and attempt in text, text


def test_diff_and_export_read_referenced_pieces(root: Path, tmp_path: Path) -> None:
    parent, changed = _states()
    full = str(tmp_path / "full")
    save_sharded({**parent, **changed}, full, 1, block_size=4096, step=2)
    result = diff(str(root / CHILD), full, memory_limit=4 << 20)
    assert [(d.name, d.same) for d in result.tensors] == [("base", True), ("head", True)]
    against_parent = diff(str(root / CHILD), str(root / PARENT), memory_limit=4 << 20)
    assert {d.name: d.same for d in against_parent.tensors} == {"base": True, "head": False}
    export_hf_safetensors(str(root / CHILD), str(tmp_path / "hf"), include=".", memory_limit=4 << 20)
    exported = {}
    for file in sorted((tmp_path / "hf").glob("*.safetensors")):
        exported.update(load_file(str(file)))
    assert torch.equal(exported["base"], parent["base"]) and torch.equal(exported["head"], changed["head"])
    assert shardckpt.open(str(root / CHILD)).step == 2


def _flip_first_hash(document: dict) -> None:
    column = document["referenced"]["hash"]
    column["data"] = bytes([column["data"][0] ^ 1]) + column["data"][1:]


def test_verify_checks_carried_piece_hashes_which_a_load_does_not_need(root: Path) -> None:
    edit_local_manifest(root / CHILD, 1, _flip_first_hash)
    state = {"base": torch.zeros(40, 32), "head": torch.zeros(4, 8)}
    shardckpt.load(state, str(root / CHILD))  # SPEC 6.3: a reader does not need hashes
    assert torch.equal(state["base"], _states()[0]["base"])
    report = verify(str(root / CHILD))
    problems = [str(problem) for problem in report.problems]
    attempt = json.loads((root / PARENT / "COMMITTED").read_text())["attempt"]
    held = str(root / PARENT / "data" / f"00001-{attempt}.safetensors")
    # The holder (whose writer records piece hashes) records another hash, and the bytes do not hash to this one.
    assert len(problems) == 2, problems
    assert any(held in p and "records another hash" in p for p in problems), problems
    assert any(held in p and "does not match its recorded blake3-128 hash" in p for p in problems), problems


def test_a_blake2b_root_of_the_previous_release_verifies_loads_and_has_its_hashes_checked(tmp_path: Path) -> None:
    """Checkpoints whose hashes are BLAKE2b-128 (the previous release) stay valid: the CLI verifies them (recomputing
    BLAKE2b, so a wrong recorded hash is still found) and they load; only a third alg is refused."""
    parent, changed = _states()
    old = tmp_path / "old"
    save_incremental(old, parent, changed, 2, alg=LEGACY_HASH_ALG)
    verified = shardckpt_cli("verify", str(old / CHILD), "--json")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert json.loads(verified.stdout)["files"] == 4
    state = {"base": torch.zeros(40, 32), "head": torch.zeros(4, 8)}
    shardckpt.load(state, str(old / CHILD))
    assert torch.equal(state["base"], parent["base"]) and torch.equal(state["head"], changed["head"])
    edit_local_manifest(old / CHILD, 1, _flip_first_hash)
    problems = [str(problem) for problem in verify(str(old / CHILD)).problems]
    if not any("does not match its recorded blake2b-128 hash" in p for p in problems):
        pytest.fail(f"a wrong BLAKE2b hash went unnoticed: {problems}")


def _unknown_alg(document: dict) -> None:
    document["piece_hash"]["alg"] = document["referenced"]["hash"]["alg"] = "sha256-128"


def test_an_unknown_hash_alg_is_refused_by_load_and_verify_naming_the_file_and_the_alg(root: Path) -> None:
    edit_local_manifest(root / CHILD, 0, _unknown_alg)
    attempt = json.loads((root / CHILD / "COMMITTED").read_text())["attempt"]
    manifest = str(root / CHILD / "ranks" / f"00000-{attempt}.msgpack")
    with pytest.raises(FormatError) as caught:
        shardckpt.load({"base": torch.zeros(40, 32), "head": torch.zeros(4, 8)}, str(root / CHILD))
    for fragment in (manifest, "'sha256-128'", "'blake3-128'"):
        if fragment not in str(caught.value):
            pytest.fail(f"{fragment} not named in: {caught.value}")
    failed = shardckpt_cli("verify", str(root / CHILD))
    assert failed.returncode == 1, failed.stdout + failed.stderr
    text = " ".join((failed.stdout + failed.stderr).split())
    if manifest not in text or "hash algorithm 'sha256-128'" not in text:
        pytest.fail(f"verify does not name the file and the alg: {text}")


def test_the_inspect_and_du_tables_show_what_is_stored_by_reference_and_where(root: Path) -> None:
    """The tables a person reads, not only --json: inspect says how much of the checkpoint lives in which older
    checkpoint, per tensor; du gives each checkpoint's referenced bytes in a column of their own."""
    env = {**os.environ, "COLUMNS": "120"}
    run = lambda *args: subprocess.run(  # noqa: E731
        [ENTRY_POINT, *args], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    inspected = run("inspect", str(root / CHILD))
    assert inspected.returncode == 0, inspected.stderr
    # base: 40 x 32 fp32 = 5.0 KiB, all of it in the parent's files (the fixture's child changes head only).
    assert f"5.0 KiB in 2 pieces stored by reference to {PARENT}" in inspected.stdout, inspected.stdout
    rows = {line.split()[0]: line for line in inspected.stdout.splitlines() if line.split()[:1] in (["base"], ["head"])}
    assert rows["base"].rstrip().endswith(f"5.0 KiB in {PARENT}"), rows
    assert rows["head"].rstrip().endswith("-"), rows
    assert "referenced" not in run("inspect", str(root / PARENT)).stdout  # a full checkpoint: no such column

    used = run("du", str(root))
    assert used.returncode == 0, used.stderr
    header = next(line for line in used.stdout.splitlines() if line.startswith("checkpoint"))
    assert header.split()[:5] == ["checkpoint", "status", "step", "committed", "referenced"]
    child = next(line for line in used.stdout.splitlines() if line.startswith(CHILD))
    assert "5.0 KiB" in child, used.stdout
    assert "stored by reference" not in used.stdout and "referenced: bytes a checkpoint stores" in used.stdout
