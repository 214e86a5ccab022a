"""The one-pass decision of one-piece tensors (format/whole.py, used by a load) against the per-table path.

Every mutated one-piece entry must get the same outcome both ways: whole, not whole, or the same error with the
same message; a check the batch skipped would show as a batch "whole" where the per-table path raises.
"""

from __future__ import annotations

import zlib
from typing import Any

import msgpack
import numpy as np
import pytest

from shardckpt.errors import ShardckptError
from shardckpt.format.layout import data_path, local_manifest_path
from shardckpt.format.manifest import (
    FileEntry,
    GlobalManifest,
    PieceTable,
    TensorEntry,
    decode_global_manifest,
    encode_global_manifest,
)
from shardckpt.format.whole import whole_pieces

pytestmark = pytest.mark.unit

SIZE = 8 + 3 * 1024  # the data file: three 8x32 fp32 tensors back to back after an 8-byte header


def _document() -> dict[str, Any]:
    tensors = tuple(
        TensorEntry(
            f"t{i}",
            "F32",
            (8, 32),
            "box",
            PieceTable(np.array([0]), np.array([8 + 1024 * i]), np.array([[0, 0]]), np.array([[8, 32]])),
        )
        for i in range(3)
    )
    files = (FileEntry(0, data_path(0, "a"), SIZE, local_manifest_path(0, "a"), 10, 0),)
    raw = encode_global_manifest(GlobalManifest("a", 1, 64 << 10, files, tensors))
    return msgpack.unpackb(raw, raw=False, strict_map_key=False)


def _column(values: list[int], n: int | None = None) -> dict[str, Any]:
    deltas = np.diff(np.array(values, dtype=np.int64), prepend=np.int64(0))
    return {"enc": "delta-zlib", "n": len(values) if n is None else n, "data": zlib.compress(deltas.tobytes())}


MUTATIONS: list[tuple[str, str, Any]] = [
    ("offset", "column", [0]),
    ("offset", "column", [SIZE - 1024]),  # the last tensor's place: whole
    ("offset", "column", [SIZE - 1023]),  # one byte past the file's end
    ("offset", "column", [SIZE]),
    ("offset", "column", [SIZE + 1]),
    ("offset", "column", [-1]),
    ("offset", "column", [2**62]),
    ("offset", "column", [2**63 - 1]),
    ("offset", "column", [-(2**63)]),
    ("file", "column", [1]),  # one file only
    ("file", "column", [-1]),
    ("start", "column", [0, 1]),
    ("start", "column", [1, 0]),
    ("start", "column", [-1, 0]),
    ("length", "column", [8, 31]),  # one piece, not the whole tensor: the cover check's business
    ("length", "column", [8, 33]),
    ("length", "column", [9, 32]),
    ("length", "column", [0, 32]),
    ("start", "column", [0, 0, 0]),
    ("offset", "n", True),
    ("file", "n", True),
    ("start", "n", 3),
    ("offset", "n", 2),
    ("offset", "enc", "u32le"),
    ("length", "enc", "delta"),
    ("offset", "data", [1, 2]),
    ("file", "data", "text"),
    ("offset", "data", b"not zlib"),
    ("offset", "data", zlib.compress(np.int64(8).tobytes()) + b"x"),  # trailing bytes after the stream
    ("start", "data", zlib.compress(np.zeros(2, np.int64).tobytes())[:-1]),  # a truncated stream
    ("offset", "whole", {"enc": "delta-zlib", "n": 1}),
    ("offset", "whole", [8]),
    ("length", "whole", None),
]


def _outcome(entry: TensorEntry, batch: bool) -> tuple[str, Any]:
    try:
        if batch and whole_pieces([entry])[0]:
            return "whole", True
        return "verdict", entry.pieces.is_whole(entry.shape, entry.layout)
    except ShardckptError as exc:
        return type(exc).__name__, str(exc)


@pytest.mark.parametrize(("column", "part", "value"), MUTATIONS)
def test_the_batch_and_the_per_table_path_agree_on_a_mutated_piece(column: str, part: str, value: Any) -> None:
    document = _document()
    pieces = document["tensors"][1]["pieces"]
    if part == "column":
        pieces[column] = _column(value)
    elif part == "whole":
        pieces[column] = value
    else:
        pieces[column][part] = value
    raw = msgpack.packb(document, use_bin_type=True)
    reference = _outcome(decode_global_manifest(raw).tensors[1], batch=False)
    batched = _outcome(decode_global_manifest(raw).tensors[1], batch=True)
    if batched != reference and not (batched == ("whole", True) and reference == ("verdict", True)):
        pytest.fail(f"{column}.{part} = {value!r}: the batch gives {batched}, the per-table path {reference}")


def test_a_bad_piece_among_good_ones_is_left_to_the_per_table_path_alone() -> None:
    document = _document()
    document["tensors"][1]["pieces"]["offset"] = _column([SIZE - 1000])
    manifest = decode_global_manifest(msgpack.packb(document, use_bin_type=True))
    if whole_pieces(manifest.tensors) != [True, False, True]:
        pytest.fail(f"verdicts {whole_pieces(manifest.tensors)}, expected [True, False, True]")
    with pytest.raises(ShardckptError, match="a piece's bytes lie outside its data file"):
        manifest.tensors[1].pieces.is_whole((8, 32), "box")
    if manifest.tensors[2].pieces.piece(0) != (0, 8 + 2048, (0, 0), (8, 32)):
        pytest.fail(f"the batch decoded piece {manifest.tensors[2].pieces.piece(0)}, expected offset {8 + 2048}")
