"""Every kind of file x every kind of damage: verify names the file and the fault, load raises the typed error,
and the caller's tensors hold exactly what shardckpt.load's docstring promises.

Kinds: a data file, a local manifest, the global manifest, COMMITTED. Damage: a flipped byte, a truncation, a
deletion, the same-named file of another checkpoint (same attempt id, other content), appended garbage.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import shardckpt
from shardckpt.cli import main as cli_main
from shardckpt.format import layout
from tests.helpers.checkpoints import sample_state, save_sharded

ATTEMPT = "samename"
WORLD = 3
RANK = 1  # whose data file and local manifest get damaged

FILES = {
    "data": layout.data_path(RANK, ATTEMPT),
    "local": layout.local_manifest_path(RANK, ATTEMPT),
    "global": layout.global_manifest_path(ATTEMPT),
    "committed": layout.COMMITTED,
}

# (kind, damage) -> (error load raises, what verify must say, whether load can have written destinations first).
# Everything but data bytes is checked before the first destination byte is written (see shardckpt.load).
EXPECTED: dict[tuple[str, str], tuple[type[Exception], str, bool]] = {
    ("data", "flip"): (shardckpt.IntegrityError, "fails its checksum", True),
    ("data", "truncate"): (shardckpt.IntegrityError, "truncated", False),
    ("data", "delete"): (shardckpt.NotFoundError, "does not exist", False),
    ("data", "replace"): (shardckpt.IntegrityError, "fails its checksum", True),
    ("data", "append"): (shardckpt.IntegrityError, "trailing bytes", False),
    ("local", "flip"): (shardckpt.IntegrityError, "promises", False),
    ("local", "truncate"): (shardckpt.IntegrityError, "promises", False),
    ("local", "delete"): (shardckpt.NotFoundError, "does not exist", False),
    ("local", "replace"): (shardckpt.IntegrityError, "promises", False),
    ("local", "append"): (shardckpt.IntegrityError, "promises", False),
    ("global", "flip"): (shardckpt.IntegrityError, "promises", False),
    ("global", "truncate"): (shardckpt.IntegrityError, "promises", False),
    ("global", "delete"): (shardckpt.NotFoundError, "does not exist", False),
    ("global", "replace"): (shardckpt.IntegrityError, "promises", False),
    ("global", "append"): (shardckpt.IntegrityError, "promises", False),
    ("committed", "flip"): (shardckpt.FormatError, "not a valid JSON", False),
    ("committed", "truncate"): (shardckpt.FormatError, "not a valid JSON", False),
    ("committed", "delete"): (shardckpt.NotCommittedError, "not committed", False),
    ("committed", "replace"): (shardckpt.IntegrityError, "promises", False),
    ("committed", "append"): (shardckpt.FormatError, "not a valid JSON", False),
}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> tuple[Path, Path]:
    """Two checkpoints whose files have the same names (same attempt id) and different content."""
    base = tmp_path_factory.mktemp("matrix")
    save_sharded(sample_state(0), str(base / "ck"), WORLD, attempt=ATTEMPT, block_size=4096)
    save_sharded(sample_state(1), str(base / "other"), WORLD, attempt=ATTEMPT, block_size=4096)
    return base / "ck", base / "other"


def _piece_byte(root: Path) -> int:
    """A byte inside the first piece of tensor 'w' that RANK stores (past the safetensors header)."""
    entry = shardckpt.open(str(root)).manifest.tensor("w")
    assert entry is not None
    pieces = [int(o) for f, o in zip(entry.pieces.file.tolist(), entry.pieces.offset.tolist()) if f == RANK]
    return pieces[0] + 5


def _damage(root: Path, other: Path, kind: str, damage: str) -> Path:
    target = root / FILES[kind]
    if damage == "flip":
        data = bytearray(target.read_bytes())
        at = _piece_byte(root) if kind == "data" else (0 if kind == "committed" else len(data) // 2)
        data[at] ^= 0x55
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        data = target.read_bytes()
        target.write_bytes(data[: len(data) // 2 if kind == "committed" else len(data) - 10])
    elif damage == "delete":
        target.unlink()
    elif damage == "replace":
        before = target.read_bytes()
        shutil.copyfile(other / FILES[kind], target)
        assert target.read_bytes() != before
    else:
        with open(target, "ab") as handle:
            handle.write(b"garbage!")
    return target


def _sentinels(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Destinations whose every element differs from the checkpoint's, so any write shows."""
    out = {}
    for name, tensor in state.items():
        if tensor.dtype == torch.bool:
            out[name] = ~tensor
        elif tensor.is_floating_point():
            out[name] = torch.full_like(tensor, 12345.0)
        else:
            out[name] = torch.full_like(tensor, 777_777)
    return out


def _destinations() -> dict:
    state: dict = {name: t.clone() for name, t in _sentinels(sample_state(0)).items()}
    state["trainer"] = "untouched"
    return state


def _verify_json(url: Path) -> tuple[int, dict]:
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        code = cli_main(["verify", "--json", str(url)])
    return code, json.loads(output.getvalue())


@pytest.fixture
def damaged(request, pristine, tmp_path) -> Callable[[str, str], Path]:
    def make(kind: str, damage: str) -> Path:
        root = tmp_path / "ck"
        shutil.copytree(pristine[0], root)
        _damage(root, pristine[1], kind, damage)
        return root

    return make


@pytest.mark.parametrize(("kind", "damage"), sorted(EXPECTED))
def test_verify_names_the_file_and_the_fault(damaged, kind: str, damage: str) -> None:
    root = damaged(kind, damage)
    code, report = _verify_json(root)
    assert code == 1 and report["ok"] is False
    named = [p for p in report["problems"] if Path(FILES[kind]).name in p["path"] + p["message"]]
    assert named, f"no problem names {FILES[kind]}: {report['problems']}"
    assert any(EXPECTED[(kind, damage)][1] in p["message"] for p in named), report["problems"]


@pytest.mark.parametrize(("kind", "damage"), sorted(EXPECTED))
@pytest.mark.parametrize("verify_first", [False, True])
def test_load_raises_the_typed_error_and_leaves_what_the_docstring_says(
    damaged, kind: str, damage: str, verify_first: bool
) -> None:
    root = damaged(kind, damage)
    error, _, may_write = EXPECTED[(kind, damage)]
    state = _destinations()
    # max_in_flight=1: one read request per wave, so a data failure late in the plan comes after earlier copies.
    with pytest.raises(shardckpt.ShardckptError) as caught:
        shardckpt.load(state, str(root), max_in_flight=1, verify_first=verify_first)
    assert type(caught.value) is error, f"{type(caught.value).__name__}: {caught.value}"
    assert Path(FILES[kind]).name in str(caught.value) or kind == "committed"
    expected, sentinel = sample_state(0), _sentinels(sample_state(0))
    assert state["trainer"] == "untouched"  # plain values are set only after every tensor was filled
    written = False
    for name, tensor in expected.items():
        old, new = state[name] == sentinel[name], state[name] == tensor
        assert bool((old | new).all()), f"{name} holds bytes that are neither its old value nor the checkpoint's"
        written |= bool((new & ~old).any())
    if verify_first or not may_write:
        assert not written, "a destination was written although the failure is caught before any write"
    else:
        assert written, "this failure comes after earlier waves were copied; the docstring says so"


def test_a_flipped_header_byte_does_not_stop_a_load_but_fails_verify(pristine, tmp_path) -> None:
    """Readers locate every byte through the manifests (SPEC section 4); only a verifier needs the header."""
    root = tmp_path / "ck"
    shutil.copytree(pristine[0], root)
    path = root / FILES["data"]
    data = bytearray(path.read_bytes())
    data[20] ^= 0x01
    path.write_bytes(bytes(data))
    state = _destinations()
    shardckpt.load(state, str(root))
    for name, tensor in sample_state(0).items():
        assert torch.equal(state[name], tensor), name
    code, report = _verify_json(root)
    assert code == 1 and any("safetensors header" in p["message"] for p in report["problems"])


def test_an_intact_checkpoint_loads_in_both_modes(pristine) -> None:
    for verify_first in (False, True):
        state = _destinations()
        shardckpt.load(state, str(pristine[0]), max_in_flight=1, verify_first=verify_first)
        for name, tensor in sample_state(0).items():
            assert torch.equal(state[name], tensor), name
        assert state["trainer"] == {"step": 1, "lr": 0.5}
    assert _verify_json(pristine[0])[0] == 0
