"""One rank of the compression benchmark's reshard row: real tensors sharded by rows (FSDP's Shard(0)) saved with and
without compression on 4 ranks, then loaded on 3 with the bytes each rank read from storage counted (rchar).

Run by benchmarks/compression_io.py through tests/helpers/launch.py; each rank's verdict goes to its JSON file.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script

import shardckpt
from benchmarks.compression_data import minilm_weights, synthetic_weights
from benchmarks.dist_worker import read_bytes
from benchmarks.pagecache import drop_caches
from tests.helpers.launch import serve_rank


def full_tensors(args: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The same tensors on every rank: MiniLM's weights, or the smoke test's synthetic ones."""
    return minilm_weights() if args["source"] == "minilm" else synthetic_weights(args.get("elements", 1 << 16))


def sharded(full: dict[str, torch.Tensor], world: int, zero: bool) -> dict[str, DTensor]:
    """Every tensor as FSDP2 shards it (Shard(0): torch.chunk's rows, trailing ranks fewer or none), cut locally:
    every rank holds the full tensors, so no collective is needed."""
    mesh = init_device_mesh("cpu", (world,))
    rank = dist.get_rank()
    state = {}
    for name, tensor in full.items():
        pieces = tensor.chunk(world, dim=0)
        local = pieces[rank] if rank < len(pieces) else tensor[:0]
        local = torch.zeros_like(local) if zero else local.clone()
        state[name] = DTensor.from_local(
            local, mesh, [Shard(0)], shape=tensor.shape, stride=tensor.stride(), run_check=False
        )
    return state


def scenario_save(args: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    state = sharded(full_tensors(args), world, zero=False)
    for url, compression in ((args["plain"], None), (args["packed"], "zstd")):
        shardckpt.save(state, url, step=1, compression=compression, storage_options=args.get("options"))
    dist.barrier()
    return {}


def scenario_load(args: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """Each checkpoint loaded once more after an untimed load (whose lazy imports read module files, which rchar
    would count), cold unless args["warm"]: this rank's bytes read (rchar, and what the load says it fetched from
    storage), seconds, and whether its shards equal the saved tensors'."""
    full = full_tensors(args)
    result: dict[str, Any] = {}
    for way in ("plain", "packed"):
        state = sharded(full, world, zero=True)
        shardckpt.load(state, args[way], storage_options=args.get("options"))
        state = sharded(full, world, zero=True)
        if not args.get("warm") and rank == 0:
            drop_caches()
        dist.barrier()
        before, began = read_bytes(), time.perf_counter()
        stats = shardckpt.load(state, args[way], storage_options=args.get("options"))
        dist.barrier()
        seconds, read = time.perf_counter() - began, read_bytes() - before
        expected = sharded(full, world, zero=False)
        agree = all(torch.equal(state[name].to_local(), expected[name].to_local()) for name in full)
        fetched, needed = getattr(stats, "fetched_bytes", None), getattr(stats, "needed_bytes", None)
        result[way] = {"read": read, "fetched": fetched, "needed": needed, "seconds": seconds, "agree": agree}
    return result


if __name__ == "__main__":
    serve_rank(globals(), default_timeout=900.0)
