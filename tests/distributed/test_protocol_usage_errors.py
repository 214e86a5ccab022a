"""Impossible requests to public code raise ShardckptUsageError (a ValueError), never a bare ValueError.

Boxes, retry policies, S3 tuning options and fault specifications; the CLI maps the same class to exit code 2.
"""

from __future__ import annotations

import pytest

from shardckpt.errors import ShardckptUsageError
from shardckpt.planner.box import Box
from shardckpt.storage import RetryPolicy, open_storage
from shardckpt.testing.faults import Fault, RequestFault


@pytest.mark.parametrize(
    "make",
    [
        lambda: Box((0,), (1, 2)),  # ranks differ
        lambda: Box((-1,), (2,)),
        lambda: Box((0,), (-2,)),
        lambda: RetryPolicy(attempts=0),
        lambda: RetryPolicy(deadline=0),
        lambda: RetryPolicy(base_delay=-1),
        lambda: open_storage("s3://bucket/prefix", part_size=1),
        lambda: open_storage("s3://bucket/prefix", max_in_flight=0),
        lambda: Fault(op="nope"),
        lambda: Fault(op="write", kind="nope"),
        lambda: RequestFault(kind="nope"),
    ],
)
def test_impossible_arguments_are_usage_errors(make) -> None:
    with pytest.raises(ShardckptUsageError):
        make()
