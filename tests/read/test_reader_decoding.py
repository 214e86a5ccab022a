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


# -------------------------------------------------------------------------------- strings a writer encodes

SURROGATES = ["\ud800", "w\udfff", "a\udc80b"]


def _writer(root: Path) -> shardckpt.ShardWriter:
    return shardckpt.ShardWriter(str(root), rank=0, world_size=1, attempt=ATTEMPT, block_size=4096)


@pytest.mark.parametrize("name", SURROGATES)
def test_a_tensor_name_with_a_lone_surrogate_is_refused_before_writing(tmp_path: Path, name: str) -> None:
    root = tmp_path / "ck"
    writer = _writer(root)
    with pytest.raises(FormatError, match="UTF-8"):
        writer.add(name, torch.ones(2))
    assert not (root / "data").exists() or not list((root / "data").iterdir())  # nothing written yet
    writer.close()  # the writer is still usable: it writes a valid rank without the refused tensor
    shardckpt.commit(str(root), world_size=1, attempt=ATTEMPT)
    assert shardckpt.open(str(root)).tensors == {}


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("\ud800", 1),
        ("ok", "\ud800"),
        ("ok", {"\udc00": 1}),
        ("ok", ["fine", ("nested", {"k": "\udfff"})]),
    ],
)
def test_an_object_with_a_lone_surrogate_is_refused_when_added(tmp_path: Path, name: str, value: object) -> None:
    writer = _writer(tmp_path / "ck")
    with pytest.raises(FormatError, match="UTF-8"):
        writer.add_object(name, value)
    assert not (tmp_path / "ck" / "data").exists() or not list((tmp_path / "ck" / "data").iterdir())


def test_metadata_with_a_lone_surrogate_is_a_typed_error(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    writer = _writer(root)
    writer.add("w", torch.ones(2))
    writer.close()
    with pytest.raises(FormatError, match="UTF-8"):
        shardckpt.commit(str(root), world_size=1, attempt=ATTEMPT, metadata={"note": "\ud800"})
    assert not (root / layout.COMMITTED).exists()


@settings(max_examples=200, deadline=None)
@given(text=st.text(st.characters(), min_size=1, max_size=20))
def test_names_are_accepted_exactly_when_they_encode_as_utf8_without_nul(text: str) -> None:
    from shardckpt.format.strict import check_name

    try:
        text.encode("utf-8")
        valid = "\x00" not in text
    except UnicodeEncodeError:
        valid = False
    if valid:
        assert check_name(text, "t") == text
    else:
        with pytest.raises(FormatError):
            check_name(text, "t")
