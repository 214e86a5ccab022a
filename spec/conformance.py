"""Run the golden vectors against any reader of the format: a reader command in, PASS/FAIL per vector out.

    python spec/conformance.py [--verifier CMD] [-k SUBSTRING] -- READER CMD ...

Standard library only, so it runs beside an implementation in any language (spec/README.md, "Conformance").
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

VECTORS = Path(__file__).resolve().parent / "vectors"
ERRORS = ("FormatError", "CoverageError", "IntegrityError", "NotCommittedError", "NotFoundError", "StorageError")


def cases(kind: str, substring: str = "") -> list[Path]:
    root = VECTORS / kind
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and substring in p.name)


def _same(a: Any, b: Any) -> bool:
    """JSON equality in which NaN equals NaN and -0.0 differs from 0.0 (floats are compared bit for bit)."""
    if isinstance(a, float) and isinstance(b, float):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def judge_valid(description: dict[str, Any], result: dict[str, Any]) -> list[str]:
    """Why a reader's answer for a valid vector is wrong (empty: it passes)."""
    if result.get("ok") is not True:
        return [f"refused a valid checkpoint: {result.get('error')}: {result.get('message')}"]
    problems = [
        f"{key} is {result.get(key)!r}, expected {description[key]!r}"
        for key in ("world_size", "step")
        if result.get(key) != description[key]
    ]
    tensors = result.get("tensors", {})
    if sorted(tensors) != sorted(description["tensors"]):
        problems.append(f"tensors {sorted(tensors)}, expected {sorted(description['tensors'])}")
    for name, expected in description["tensors"].items():
        found = tensors.get(name, {})
        for key in ("dtype", "shape", "sha256"):
            if found.get(key) != expected[key]:
                problems.append(f"tensor {name!r}: {key} {found.get(key)!r}, expected {expected[key]!r}")
    if not _same(result.get("objects"), description["objects"]):
        problems.append(f"objects {result.get('objects')!r}, expected {description['objects']!r}")
    expected_ranks = description.get("rank_objects", {})
    found_ranks = result.get("rank_objects", {})
    for rank in range(description["world_size"]):
        if not _same(found_ranks.get(str(rank), {}), expected_ranks.get(str(rank), {})):
            problems.append(f"objects of rank {rank}: {found_ranks.get(str(rank))!r}")
    return problems


def judge_invalid(expected: dict[str, Any], result: dict[str, Any], verified: dict[str, Any] | None) -> list[str]:
    """Why a reader's (and verifier's) answer for an invalid vector is wrong (empty: it passes)."""
    problems = []
    if expected["operation"] in ("open", "read"):
        if result.get("ok") is None:
            problems.append(f"no answer ({result.get('error')}: {result.get('message')})")
        elif result.get("ok") is not False:
            problems.append(f"read it without an error; SPEC requires {expected['error']} ({expected['rule']})")
        elif result.get("error") != expected["error"]:
            problems.append(f"raised {result.get('error')}, expected {expected['error']}: {result.get('message')}")
    if verified is not None and verified.get("ok") is not False:
        problems.append(f"the verifier found nothing wrong ({expected['rule']})")
    return problems


def run(command: Sequence[str], checkpoint: Path, timeout: float) -> dict[str, Any]:
    """The command's JSON answer for one checkpoint; a crash, hang or non-JSON output is an answer too."""
    try:
        done = subprocess.run([*command, str(checkpoint)], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": None, "error": "timeout", "message": f"no answer in {timeout:.0f} s"}
    try:
        answer = json.loads(done.stdout)
    except json.JSONDecodeError:
        tail = (done.stderr or done.stdout).strip()[-300:]
        return {"ok": None, "error": "no JSON answer", "message": f"exit {done.returncode}: {tail}"}
    if not isinstance(answer, dict):
        return {"ok": None, "error": "no JSON object", "message": done.stdout[:300]}
    if answer.get("ok") is False and answer.get("error") not in ERRORS:
        answer["message"] = f"{answer.get('error')} is not an error class of SPEC 13: {answer.get('message')}"
    return answer


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--verifier", help="a verifier command: ok true on every valid vector, ok false on every invalid one"
    )
    parser.add_argument("-k", default="", help="only vectors whose name contains this")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per vector (a hang fails)")
    parser.add_argument("reader", nargs="+", help="the reader command; the checkpoint path is appended")
    args = parser.parse_args(argv)
    verifier = shlex.split(args.verifier) if args.verifier else None
    failed = total = 0
    for case in cases("valid", args.k):
        description = json.loads((case / "description.json").read_text())
        checkpoint = case / description.get("checkpoint", "")
        problems = judge_valid(description, run(args.reader, checkpoint, args.timeout))
        if verifier and run(verifier, checkpoint, args.timeout).get("ok") is not True:
            problems.append("the verifier did not find it ok")
        failed, total = failed + bool(problems), total + 1
        print(f"{'FAIL' if problems else 'PASS'} valid/{case.name}" + "".join(f"\n    {p}" for p in problems))
    for case in cases("invalid", args.k):
        expected = json.loads((case / "expected_error.json").read_text())
        checkpoint = case / expected.get("checkpoint", "")
        result = run(args.reader, checkpoint, args.timeout)
        verified = run(verifier, checkpoint, args.timeout) if verifier else None
        problems = judge_invalid(expected, result, verified)
        failed, total = failed + bool(problems), total + 1
        print(f"{'FAIL' if problems else 'PASS'} invalid/{case.name}" + "".join(f"\n    {p}" for p in problems))
    print(f"{total - failed} of {total} vectors passed")
    return 1 if failed or not total else 0


if __name__ == "__main__":
    sys.exit(main())
