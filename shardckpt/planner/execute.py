"""Carrying out a planned copy between byte buffers with numpy strided views (no Python loop per run).

Pure: the restorer hands in the bytes it fetched and the destination's bytes; tests hand in plain arrays.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import as_strided

from shardckpt.planner.plan import Copy

ByteArray = npt.NDArray[np.uint8]


def apply_copy(copy: Copy, fetched: ByteArray, fetched_start: int, destination: ByteArray) -> None:
    """Copy `copy` from `fetched` (file bytes beginning at absolute offset `fetched_start`) into `destination`."""
    src_offset = copy.src - fetched_start
    if src_offset < 0 or src_offset + _span(copy.shape, copy.src_strides) > fetched.size:
        raise ValueError(f"copy {copy} reads outside the fetched range")
    if copy.dst < 0 or copy.dst + _span(copy.shape, copy.dst_strides) > destination.size:
        raise ValueError(f"copy {copy} writes outside its destination of {destination.size} bytes")
    source = as_strided(fetched[src_offset:], shape=copy.shape, strides=(*copy.src_strides, 1), writeable=False)
    target = as_strided(destination[copy.dst :], shape=copy.shape, strides=(*copy.dst_strides, 1))
    np.copyto(target, source)


def apply_copies(
    copies: Sequence[Copy], fetched: ByteArray, fetched_start: int, destinations: Sequence[ByteArray]
) -> None:
    """apply_copy for each copy into its target's destination; a plain byte run (most copies) as one slice
    assignment, without the strided views' cost."""
    size = fetched.size
    for copy in copies:
        destination = destinations[copy.target]
        if len(copy.shape) == 1:
            count, src, dst = copy.shape[0], copy.src - fetched_start, copy.dst
            if src >= 0 and dst >= 0 and src + count <= size and dst + count <= destination.size:
                destination[dst : dst + count] = fetched[src : src + count]
                continue
        apply_copy(copy, fetched, fetched_start, destination)  # strided, or out of range (its error)


def _span(shape: tuple[int, ...], strides: tuple[int, ...]) -> int:
    return sum((n - 1) * s for n, s in zip(shape[:-1], strides)) + shape[-1]
