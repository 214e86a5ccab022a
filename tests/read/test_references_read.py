"""Opening a format 1.1 checkpoint that stores pieces by reference (SPEC 6.2), before the reader follows references:
it decodes and is refused with a typed error that says so, never an IndexError from a file index past `files`."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import shardckpt
from shardckpt.errors import FormatError

VECTORS = Path(__file__).resolve().parents[2] / "spec" / "vectors"


def test_a_referencing_checkpoint_is_refused_with_a_message_naming_the_feature(tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.copytree(VECTORS / "valid" / "references_basic", root)
    with pytest.raises(FormatError) as caught:
        shardckpt.open(str(root / "step-2"))
    message = str(caught.value)
    for fragment in ("step-2", "['step-1']", "references", "does not read them yet"):
        if fragment not in message:
            pytest.fail(f"{fragment!r} not in: {message}")
    # The referenced checkpoint itself is an ordinary 1.0 checkpoint and reads as before.
    assert shardckpt.open(str(root / "step-1")).read("w").shape == (4, 3)
