"""spec/conformance.py, the harness other implementations run the vectors with: the library's own reader adapter
passes every vector through it, and the harness fails a reader that reads wrong data or accepts a broken file."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

SPEC = Path(__file__).resolve().parents[2] / "spec"


def _module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


harness = _module(SPEC / "conformance.py")
adapter = _module(SPEC / "readers" / "shardckpt_reader.py")


@pytest.mark.parametrize("case", harness.cases("valid"), ids=lambda case: case.name)
def test_the_library_passes_every_valid_vector(case: Path) -> None:
    description = json.loads((case / "description.json").read_text())
    path = str(case / description.get("checkpoint", ""))
    assert harness.judge_valid(description, adapter.read(path)) == []
    assert adapter.verify(path) == {"ok": True, "problems": []}


@pytest.mark.parametrize("case", harness.cases("invalid"), ids=lambda case: case.name)
def test_the_library_passes_every_invalid_vector(case: Path) -> None:
    expected = json.loads((case / "expected_error.json").read_text())
    path = str(case / expected.get("checkpoint", ""))
    assert harness.judge_invalid(expected, adapter.read(path), adapter.verify(path)) == []


def test_the_harness_fails_wrong_answers() -> None:
    case = SPEC / "vectors" / "valid" / "single_rank_basic"
    description = json.loads((case / "description.json").read_text())
    answer = adapter.read(str(case))
    name = next(iter(answer["tensors"]))
    answer["tensors"][name]["sha256"] = "0" * 64
    assert any("sha256" in problem for problem in harness.judge_valid(description, answer))
    expected = json.loads((SPEC / "vectors" / "invalid" / "data_bit_flip" / "expected_error.json").read_text())
    assert harness.judge_invalid(expected, {"ok": True}, None) != []
    assert harness.judge_invalid(expected, {"ok": False, "error": "FormatError"}, None) != []
    assert harness.judge_invalid(expected, {"ok": False, "error": "IntegrityError"}, {"ok": True}) != []


def test_the_harness_runs_a_reader_command() -> None:
    reader = [sys.executable, str(SPEC / "readers" / "shardckpt_reader.py")]
    verifier = f"{sys.executable} {SPEC / 'readers' / 'shardckpt_reader.py'} --verify"
    command = [sys.executable, str(SPEC / "conformance.py"), "-k", "no_committed", "--verifier", verifier, *reader]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS invalid/no_committed" in done.stdout and "1 of 1 vectors passed" in done.stdout, done.stdout
