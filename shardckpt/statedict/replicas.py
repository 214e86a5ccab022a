"""Values saved once for all ranks (plain tensors, shared plain values): a digest per rank, compared before commit.

A value that differs between ranks, or that only some ranks hold, would otherwise be stored as one rank's copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import crc32c
import torch

from shardckpt.format.values import check_plain, pack_value
from shardckpt.statedict.dtensor import is_dtensor
from shardckpt.statedict.flatten import Leaf
from shardckpt.torch_bytes import format_dtype, host_bytes

# One digest entry: [name, kind, dtype, shape, crc32c]; kind "tensor" or "value" (dtype "" and shape [] there).
Digest = list[list[Any]]

HINT = (
    "A plain tensor or value is saved once for all ranks, so every rank must hold the same one: wrap one that "
    "differs between ranks (torch.get_rng_state(), a data-loader position) in shardckpt.PerRank"
)


def replica_digest(leaves: list[Leaf]) -> Digest:
    """What this rank holds of the values saved once: name, dtype, shape and CRC32C of the bytes of each."""
    digest: Digest = []
    for leaf in leaves:
        value = leaf.value
        if is_dtensor(value) or getattr(value, "shardckpt_leaf", False):
            continue  # DTensors, flat partitions, staged shards and PerRank values are each rank's own
        if isinstance(value, torch.Tensor):
            dtype = format_dtype(value.dtype)
            digest.append([leaf.name, "tensor", dtype, list(value.shape), crc32c.crc32c(host_bytes(value).data)])
        else:
            check_plain(value, f"object {leaf.name!r}")
            digest.append([leaf.name, "value", "", [], crc32c.crc32c(pack_value(value))])
    return digest


def replica_disagreements(digests: Sequence[Digest], reference: int) -> dict[int, str]:
    """For each rank whose values saved once differ from rank `reference`'s (or whose names do), why."""
    expected = {entry[0]: entry for entry in digests[reference]}
    failures: dict[int, str] = {}
    for rank, digest in enumerate(digests):
        if rank == reference:
            continue
        held = {entry[0]: entry for entry in digest}
        problems = [
            f"plain {expected[name][1]} {name!r} of rank {reference} is missing here"
            for name in sorted(expected.keys() - held.keys())
        ]
        problems += [
            f"plain {held[name][1]} {name!r} is not on rank {reference}"
            for name in sorted(held.keys() - expected.keys())
        ]
        problems += [
            f"plain {held[name][1]} {name!r} ({_describe(held[name])}) differs from rank {reference}'s "
            f"({_describe(expected[name])})"
            for name in sorted(held.keys() & expected.keys())
            if list(held[name][1:]) != list(expected[name][1:])
        ]
        if problems:
            shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
            failures[rank] = f"{shown}. {HINT}"
    return failures


def _describe(entry: list[Any]) -> str:
    _, kind, dtype, shape, crc = entry
    return f"{dtype} {list(shape)}, CRC32C {crc:#010x}" if kind == "tensor" else f"CRC32C {crc:#010x}"
