"""Pure resharding math: boxes, exact-cover validation, and read plans from stored pieces to wanted boxes.

No I/O, no torch, no fsspec: every function here maps arrays of integers to arrays of integers.
"""

from shardckpt.planner.box import Box, intersect, row_major_strides
from shardckpt.planner.cover import check_cover
from shardckpt.planner.plan import Copy, ReadPlan, ReadRequest, Target, VerifySpan, plan_reads

__all__ = [
    "Box",
    "Copy",
    "ReadPlan",
    "ReadRequest",
    "Target",
    "VerifySpan",
    "check_cover",
    "intersect",
    "plan_reads",
    "row_major_strides",
]
