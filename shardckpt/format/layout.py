"""Names of the objects that make up one checkpoint, and the rules every stored path must follow.

A manifest may only name files that these functions could have produced: no '..', no absolute paths, no URLs.
"""

from __future__ import annotations

import re
import secrets

from shardckpt.errors import FormatError
from shardckpt.format.limits import MAX_ATTEMPT_CHARS, MAX_MARKER_GENERATION, MAX_PATH_CHARS

COMMITTED = "COMMITTED"
_SUCCESSOR = re.compile(r"COMMITTED-([2-9]|[1-9][0-9]{1,4})")  # SPEC 14.2: generation 2.. in plain decimal
DATA_DIR = "data"
RANKS_DIR = "ranks"

_ATTEMPT = re.compile(rf"[0-9a-z]{{1,{MAX_ATTEMPT_CHARS}}}")
# ASCII digits only (\d also matches other scripts' digits); the rank must be written exactly as data_path does.
_DATA = re.compile(rf"{DATA_DIR}/([0-9]{{5,8}})-([0-9a-z]{{1,{MAX_ATTEMPT_CHARS}}})\.safetensors")
_LOCAL = re.compile(rf"{RANKS_DIR}/([0-9]{{5,8}})-([0-9a-z]{{1,{MAX_ATTEMPT_CHARS}}})\.msgpack")
_GLOBAL = re.compile(rf"manifest-([0-9a-z]{{1,{MAX_ATTEMPT_CHARS}}})\.msgpack")
# A claim on an attempt (SPEC 14), and the temporary name a local create-only write of it may leave on a crash.
_CLAIM = re.compile(rf"claim-([0-9a-z]{{1,{MAX_ATTEMPT_CHARS}}})(?:\.tmp-[0-9a-f]{{1,32}})?")


def marker_name(generation: int) -> str:
    """The commit marker of a checkpoint's `generation`: COMMITTED (1), then COMMITTED-2, COMMITTED-3, ... for the
    saves that superseded it (SPEC 14.2)."""
    if not 1 <= generation <= MAX_MARKER_GENERATION:
        raise FormatError(f"marker generation must be 1..{MAX_MARKER_GENERATION}, got {generation}")
    return COMMITTED if generation == 1 else f"{COMMITTED}-{generation}"


def marker_generation(name: str) -> int | None:
    """The generation of a commit marker name (COMMITTED: 1, COMMITTED-<g>: g), None for any other name."""
    if name == COMMITTED:
        return 1
    match = _SUCCESSOR.fullmatch(name)
    return int(match.group(1)) if match and int(match.group(1)) <= MAX_MARKER_GENERATION else None


def new_attempt() -> str:
    """A fresh random attempt id: every save attempt writes files no other attempt can name."""
    return secrets.token_hex(8)


def validate_attempt(attempt: object) -> str:
    if not isinstance(attempt, str) or not _ATTEMPT.fullmatch(attempt):
        raise FormatError(f"attempt id must be 1..{MAX_ATTEMPT_CHARS} characters of [0-9a-z], got {attempt!r}")
    return attempt


def data_path(rank: int, attempt: str) -> str:
    return f"{DATA_DIR}/{rank:05d}-{validate_attempt(attempt)}.safetensors"


def local_manifest_path(rank: int, attempt: str) -> str:
    return f"{RANKS_DIR}/{rank:05d}-{validate_attempt(attempt)}.msgpack"


def global_manifest_path(attempt: str) -> str:
    return f"manifest-{validate_attempt(attempt)}.msgpack"


def claim_path(attempt: str) -> str:
    return f"claim-{validate_attempt(attempt)}"


def _check_path(path: object, pattern: re.Pattern[str], what: str) -> re.Match[str]:
    if not isinstance(path, str) or len(path) > MAX_PATH_CHARS:
        raise FormatError(f"{what} path must be a string of at most {MAX_PATH_CHARS} characters, got {path!r}")
    match = pattern.fullmatch(path)
    if match is None:
        # One message for traversal, absolute paths, URLs and plain typos alike: only layout names are legal.
        raise FormatError(f"{what} path {path!r} is not a name this format allows (expected {pattern.pattern})")
    return match


def parse_data_path(path: object) -> tuple[int, str]:
    """(rank, attempt) of a data file path; FormatError for anything else."""
    match = _check_path(path, _DATA, "data file")
    return _canonical_rank(match, path), match.group(2)


def parse_local_manifest_path(path: object) -> tuple[int, str]:
    match = _check_path(path, _LOCAL, "local manifest")
    return _canonical_rank(match, path), match.group(2)


def _canonical_rank(match: re.Match[str], path: object) -> int:
    rank = int(match.group(1))
    if match.group(1) != f"{rank:05d}":
        raise FormatError(f"path {path!r} does not write its rank {rank} as exactly {rank:05d}")
    return rank


def parse_global_manifest_path(path: object) -> str:
    return _check_path(path, _GLOBAL, "global manifest").group(1)


def parse_claim_path(path: object) -> str:
    """The attempt a claim (or a claim's temporary name) is on; FormatError for anything else."""
    return _check_path(path, _CLAIM, "claim").group(1)
