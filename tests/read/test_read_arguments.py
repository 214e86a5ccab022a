"""Boxes and read limits callers pass: integers only (a float was truncated into a silently wrong slice), within the
tensor (a huge offset was an untyped OverflowError), and limits that neither make no sense nor make a read crawl.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import shardckpt
from shardckpt import knobs
from shardckpt.planner import Box

ROWS = torch.arange(100 * 7, dtype=torch.float32).reshape(100, 7)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("args") / "c")
    shardckpt.save({"a": ROWS}, url, step=1)
    return url


@pytest.mark.parametrize(
    ("offsets", "shape", "match"),
    [
        ((49.5, 0), (2, 7), r"tensor 'a': offsets must be integers, got \(49.5, 0\)"),
        ((49, 0), (2.7, 7), r"tensor 'a': shape must be integers, got \(2.7, 7\)"),
        ((True, 0), (2, 7), r"tensor 'a': offsets must be"),
        ("ab", (2, 7), r"tensor 'a': offsets must be"),
        ((2**63 - 1, 0), (1, 7), r"tensor 'a' of shape \[100, 7\]: offsets \[9223372036854775807, 0\]"),
        ((2**64, 0), (1, 7), r"end within it"),
        ((99, 0), (2, 7), r"offsets \[99, 0\] and shape \[2, 7\] must be non-negative and end within it"),
    ],
)
def test_a_read_box_of_floats_or_out_of_range_is_a_usage_error_naming_it(saved: str, offsets, shape, match) -> None:
    checkpoint = shardckpt.open(saved)
    with pytest.raises(shardckpt.ShardckptUsageError, match=match):
        checkpoint.read("a", offsets=offsets, shape=shape)
    with pytest.raises(shardckpt.ShardckptUsageError, match=match):
        checkpoint.plan({"a": [(offsets, shape)]})


def test_numpy_and_torch_integers_are_integers(saved: str) -> None:
    checkpoint = shardckpt.open(saved)
    got = checkpoint.read("a", offsets=(np.int64(3), torch.tensor(1)), shape=torch.Size([2, 6]))
    assert torch.equal(got, ROWS[3:5, 1:7])
    assert torch.equal(checkpoint.read("a", offsets=(98, 0)), ROWS[98:])
    into = torch.zeros(2, 7)
    checkpoint.read_into([("a", Box((np.int32(4), 0), (2, 7)), into)])
    assert torch.equal(into, ROWS[4:6])


def test_read_into_refuses_a_box_of_floats(saved: str) -> None:
    with pytest.raises(shardckpt.ShardckptUsageError, match=r"tensor 'a': box offsets must be integers"):
        shardckpt.open(saved).read_into([("a", Box((49.5, 0), (2, 7)), torch.zeros(2, 7))])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"max_in_flight": -1}, r"max_in_flight must be an integer >= 1, got -1"),
        ({"max_in_flight": 0}, r"max_in_flight must be an integer >= 1, got 0"),
        ({"max_in_flight": True}, r"max_in_flight must be an integer >= 1, got True"),
        ({"max_in_flight": 1.5}, r"max_in_flight must be an integer >= 1, got 1.5"),
        ({"max_gap": -1}, r"max_gap must be an integer >= 0, got -1"),
        ({"max_request": 8}, r"max_request must be an integer >= 4096, got 8"),
        ({"max_request": 4095}, r"max_request must be an integer >= 4096, got 4095"),
    ],
)
def test_open_and_load_refuse_limits_that_make_no_sense_or_crawl(saved: str, options: dict, match: str) -> None:
    """Before, max_in_flight=-1, 0, True or 1.5 were taken silently, and max_request=8 read 128 KiB in 12 s."""
    with pytest.raises(shardckpt.ShardckptUsageError, match=match):
        shardckpt.open(saved, **options)
    if "max_request" not in options:  # load has no max_request (SHARDCKPT_MAX_REQUEST, checked as a knob)
        with pytest.raises(shardckpt.ShardckptUsageError, match=match):
            shardckpt.load({"a": torch.zeros(100, 7)}, saved, **options)


def test_the_smallest_max_request_still_reads(saved: str) -> None:
    got = shardckpt.open(saved, max_request=knobs.MIN_REQUEST, max_in_flight=1).read("a")
    assert torch.equal(got, ROWS)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"global_shape": (10.0, 4)}, r"tensor 'a': global_shape must be integers"),
        ({"global_shape": (10, 4), "offsets": (2.5, 0)}, r"tensor 'a': offsets must be integers"),
        ({"global_shape": (40,), "flat_offset": 2.5}, r"tensor 'a': flat_offset must be integers"),
    ],
)
def test_a_writer_piece_placed_by_floats_is_a_usage_error(tmp_path: Path, options: dict, match: str) -> None:
    """Before, ShardWriter.add truncated them: a piece stored at another place than the caller meant."""
    writer = shardckpt.ShardWriter(str(tmp_path / "c"), rank=0, world_size=1)
    tensor = torch.zeros(8) if "flat_offset" in options else torch.zeros(2, 4)
    with pytest.raises(shardckpt.ShardckptUsageError, match=match):
        writer.add("a", tensor, **options)
