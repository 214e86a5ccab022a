"""Decoded values that later code trusts: times are finite numbers, and every string a writer encodes is valid
UTF-8 (no lone surrogates), refused before anything is written.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_hostile_manifests import ATTEMPT, Chain

import shardckpt
from shardckpt.cli import main as cli_main
from shardckpt.errors import FormatError
from shardckpt.format import layout
from shardckpt.format.manifest import decode_commit_marker, decode_global_manifest


@pytest.fixture
def committed(tmp_path: Path) -> Path:
    root = tmp_path / "root" / "ck"
    writer = shardckpt.ShardWriter(str(root), rank=0, world_size=1, attempt=ATTEMPT, block_size=4096)
    writer.add("w", torch.ones(2, 2))
    writer.close()
    shardckpt.commit(str(root), world_size=1, attempt=ATTEMPT)
    return root


# ---------------------------------------------------------------------------------------------- times

NON_FINITE_JSON = ["1e999", "-1e999", "1E400", "-0.1e310"]


@pytest.mark.parametrize("text", NON_FINITE_JSON)
def test_a_commit_marker_with_a_non_finite_time_is_refused(committed: Path, text: str) -> None:
    raw = (committed / layout.COMMITTED).read_text()
    document = json.loads(raw)
    hostile = json.dumps(document).replace(f'"created": {json.dumps(document["created"])}', f'"created": {text}')
    assert text in hostile
    with pytest.raises(FormatError, match="created"):
        decode_commit_marker(hostile.encode())


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_a_global_manifest_with_a_non_finite_time_is_refused(committed: Path, value: float) -> None:
    chain = Chain(committed)
    document = chain.global_()
    document["created"] = value
    with pytest.raises(FormatError, match="created"):
        decode_global_manifest(msgpack.packb(document, use_bin_type=True))


@pytest.mark.parametrize("json_output", [False, True])
def test_ls_survives_a_marker_with_an_infinite_time(committed: Path, capsys, json_output: bool) -> None:
    path = committed / layout.COMMITTED
    path.write_text(path.read_text().replace('"created": ', '"created": 1e999, "ignored": ', 1))
    code = cli_main(["ls", *(["--json"] if json_output else []), str(committed.parent)])
    out = capsys.readouterr().out
    assert code in (0, 1)
    assert "Infinity" not in out and "broken" in out
    if json_output:
        json.loads(out, parse_constant=lambda name: pytest.fail(f"{name} in ls --json output"))
