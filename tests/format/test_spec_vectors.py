"""The golden vectors of spec/vectors/: every valid case reads as described, every invalid case fails as named.

Cases are discovered at run time, so a new directory under spec/vectors/valid or spec/vectors/invalid is tested
without touching this file. Regenerate the vectors with `python spec/vectors/generate.py`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import shardckpt
import shardckpt.errors
from shardckpt.ops.verify import verify

VECTORS = Path(__file__).resolve().parents[2] / "spec" / "vectors"

# The format's dtype names, written out here rather than taken from the library, so a changed mapping fails.
DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F8_E8M0": torch.float8_e8m0fnu,
    "C64": torch.complex64,
}

# Invalid vectors that the library does not refuse as SPEC.md requires yet. Strict: once the library is fixed,
# the test XPASSes and fails, so the entry gets removed here. Valid cases are listed here too.
KNOWN_LIBRARY_BUGS: dict[str, str] = {}


def _cases(kind: str) -> list[Path]:
    root = VECTORS / kind
    if not root.is_dir():
        return []
    return sorted(path for path in root.iterdir() if path.is_dir() and not path.name.startswith("."))


VALID = _cases("valid")
INVALID = _cases("invalid")


def _params(cases: list[Path]) -> list[Any]:
    params = []
    for case in cases:
        reason = KNOWN_LIBRARY_BUGS.get(case.name)
        marks = [pytest.mark.xfail(strict=True, reason=f"library bug: {reason}")] if reason else []
        params.append(pytest.param(case, id=case.name, marks=marks))
    return params


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime) of every file under `root`: proves a test left the vector as it found it."""
    result = {}
    for dirpath, _, filenames in os.walk(root):
        for filename in filenames:
            stat = os.stat(os.path.join(dirpath, filename))
            result[os.path.relpath(os.path.join(dirpath, filename), root)] = (stat.st_size, stat.st_mtime_ns)
    return result


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.contiguous().reshape(-1)
    return b"" if flat.numel() == 0 else flat.view(torch.uint8).numpy().tobytes()


def _from_json(value: Any) -> Any:
    """Inverse of the tagged JSON of description.json ($tuple, $bytes, $map, $float)."""
    if isinstance(value, list):
        return [_from_json(item) for item in value]
    if isinstance(value, dict):
        if len(value) == 1:
            ((tag, item),) = value.items()
            if tag == "$tuple":
                return tuple(_from_json(x) for x in item)
            if tag == "$bytes":
                return bytes.fromhex(item)
            if tag == "$map":
                return {_from_json(k): _from_json(v) for k, v in item}
            if tag == "$float":
                return float(item)
        return {key: _from_json(item) for key, item in value.items()}
    return value


def _same(a: Any, b: Any) -> bool:
    """Equal including types (tuple vs list, bool vs int, bytes vs str) and float bits (-0.0, nan)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[key], b[key]) for key in a)
    return bool(a == b)


def test_vector_lists_are_not_empty() -> None:
    if len(VALID) == 0 or len(INVALID) == 0:
        pytest.fail(f"{len(VALID)} valid and {len(INVALID)} invalid vectors under {VECTORS}", pytrace=False)


def test_known_bugs_name_existing_vectors() -> None:
    names = {case.name for case in INVALID + VALID}
    assert set(KNOWN_LIBRARY_BUGS) <= names, set(KNOWN_LIBRARY_BUGS) - names


@pytest.mark.parametrize("case", _params(VALID))
def test_valid_vector(case: Path) -> None:
    description = json.loads((case / "description.json").read_text())
    before = _snapshot(case)
    case = case / description.get("checkpoint", "")  # a root of several checkpoints names the one to read
    checkpoint = shardckpt.open(str(case))
    assert checkpoint.manifest.world_size == description["world_size"]
    assert checkpoint.step == description["step"]
    if "attempt" in description:
        assert checkpoint.marker.attempt == description["attempt"]
    if "block_size" in description:
        assert checkpoint.manifest.block_size == description["block_size"]

    expected_tensors = description["tensors"]
    assert sorted(checkpoint.tensors) == sorted(expected_tensors)
    for name, expected in expected_tensors.items():
        tensor = checkpoint.read(name)
        assert tensor.dtype == DTYPES[expected["dtype"]], name
        assert list(tensor.shape) == expected["shape"], name
        assert hashlib.sha256(_tensor_bytes(tensor)).hexdigest() == expected["sha256"], name
        if "values" in expected:
            assert tensor.tolist() == expected["values"], name

    objects = _from_json(description["objects"])
    assert _same(checkpoint.objects, objects), (checkpoint.objects, objects)
    rank_objects = description.get("rank_objects", {})
    for rank in range(description["world_size"]):
        expected_rank = _from_json(rank_objects.get(str(rank), {}))
        assert _same(checkpoint.rank_objects(rank), expected_rank), (rank, checkpoint.rank_objects(rank))

    report = verify(str(case))
    assert report.ok, [str(problem) for problem in report.problems]

    # Every data file opens with stock safetensors and holds exactly the expected keys.
    data_files = description["data_files"]
    attempt = checkpoint.marker.attempt
    assert sorted(data_files) == [
        f"data/{rank:05d}-{attempt}.safetensors" for rank in range(checkpoint.manifest.world_size)
    ]
    for path, keys in data_files.items():
        with safe_open(str(case / path), framework="pt") as handle:
            assert sorted(handle.keys()) == sorted(keys), path
            metadata = handle.metadata()
            assert metadata["format"] == "shardckpt" and metadata["attempt"] == attempt, metadata
            assert metadata["rank"] == str(int(path.split("/")[1].split("-")[0])), metadata
            for key in keys:
                name = key if key in expected_tensors else key.rsplit("#", 1)[0]
                # SPEC 4.1: a compressed file's pieces are U8 entries of their stored bytes.
                dtype = (
                    torch.uint8
                    if checkpoint.manifest.files[0].logical_size
                    else DTYPES[expected_tensors[name]["dtype"]]
                )
                assert handle.get_tensor(key).dtype == dtype, (path, key)
    assert _snapshot(case.parent if "checkpoint" in description else case) == before, "reading a vector changed it"


@pytest.mark.parametrize("case", _params(INVALID))
def test_invalid_vector(case: Path) -> None:
    expected = json.loads((case / "expected_error.json").read_text())
    error = getattr(shardckpt.errors, expected["error"], None)
    assert isinstance(error, type) and issubclass(error, shardckpt.errors.ShardckptError), expected["error"]
    operation = expected["operation"]
    assert operation in ("open", "read", "verify"), operation
    before = _snapshot(case)
    case = case / expected.get("checkpoint", "")  # a root of several checkpoints names the one to read

    if operation == "open":
        with pytest.raises(error) as caught:
            shardckpt.open(str(case))
    elif operation == "read":
        checkpoint = shardckpt.open(str(case))
        with pytest.raises(error) as caught:
            for name in checkpoint.tensors:
                checkpoint.read(name)
    if operation in ("open", "read"):
        assert type(caught.value) is error, f"raised {type(caught.value).__name__}, expected exactly {error.__name__}"
        message = str(caught.value)
        for fragment in expected.get("message_contains", []):
            assert fragment in message, f"{fragment!r} not named in: {message}"

    # Whatever the operation, a full verification of an invalid checkpoint is not ok.
    report = verify(str(case))
    assert not report.ok, f"verify() found nothing wrong with {case.name}"
    problems = "\n".join(str(problem) for problem in report.problems)
    fragments = expected.get("verify_contains", [])
    if operation == "verify":
        assert fragments, "a verify vector must name what the report has to mention"
    for fragment in fragments:
        assert fragment in problems, f"{fragment!r} not named in the verify report: {problems}"
    assert _snapshot(case.parent if "checkpoint" in expected else case) == before, "reading a vector changed it"
