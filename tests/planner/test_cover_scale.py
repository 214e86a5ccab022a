"""Exact cover at scale: 500k irregular (non-grid) pieces, which the old slab sweep checked in quadratic time.

Every column of a square tensor is cut once at a random row, so no grid exists and every row slab is crossed by
every column. The time is printed for the record (run with -s); there is no timed assertion.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from shardckpt.errors import CoverageError
from shardckpt.planner.cover import check_cover

pytestmark = pytest.mark.slow  # half a million pieces per test

COLUMNS = 250_000  # two pieces per column: 500,000 pieces


def split_columns(columns: int, seed: int = 0) -> tuple[tuple[int, int], np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    rows = columns
    cut = rng.integers(1, rows, columns)
    column = np.arange(columns, dtype=np.int64)
    top = np.stack([np.zeros(columns, np.int64), column], 1)
    bottom = np.stack([cut, column], 1)
    ones = np.ones(columns, np.int64)
    start = np.concatenate([top, bottom]).astype(np.int64)
    length = np.concatenate([np.stack([cut, ones], 1), np.stack([rows - cut, ones], 1)]).astype(np.int64)
    return (rows, columns), start, length


def test_half_a_million_irregular_pieces_are_checked() -> None:
    shape, start, length = split_columns(COLUMNS)
    began = time.perf_counter()
    check_cover("w", shape, "box", start, length)
    print(f"\n{start.shape[0]} irregular pieces: exact cover checked in {time.perf_counter() - began:.2f} s")


@pytest.mark.parametrize("fault", ["gap", "overlap"])
def test_half_a_million_irregular_pieces_with_one_fault_name_it(fault: str) -> None:
    shape, start, length = split_columns(COLUMNS)
    column = 12_345 + int(np.nonzero(length[COLUMNS + 12_345 :, 0] >= 2)[0][0])  # a bottom piece of 2+ rows
    victim, cells = COLUMNS + column, f"{column}:{column + 1}"
    if fault == "gap":  # the bottom piece loses its first row
        start[victim, 0] += 1
        length[victim, 0] -= 1
        expected = rf"elements \[{start[victim, 0] - 1}:{start[victim, 0]}, {cells}\] are covered by no piece \(gap\)"
    else:  # the bottom piece grows one row up, into the top piece
        start[victim, 0] -= 1
        length[victim, 0] += 1
        expected = rf"pieces {column} and {victim} both cover \[{start[victim, 0]}:{start[victim, 0] + 1}, {cells}\]"
    with pytest.raises(CoverageError, match=expected):
        check_cover("w", shape, "box", start, length)
