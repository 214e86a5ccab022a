"""One rank of the shared-read benchmark: an HSDP state (DTensors [Replicate(), Shard(0)] on a 2-D mesh) saved by
shardckpt and DCP, then loaded on other meshes with shared reads, with every rank reading its own, and by DCP.

Run by benchmarks/shared_reads.py through tests/helpers/launch.py; each rank's verdict goes to its JSON file.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script

import shardckpt
from benchmarks.dist_worker import read_bytes
from benchmarks.pagecache import drop_caches
from tests.helpers.launch import serve_rank


def hsdp_state(args: dict[str, Any], fill: bool) -> dict[str, DTensor]:
    """`tensors` fp32 tensors of rows x 1024 on a (replicate, shard) mesh: each replica group holds all of them."""
    replicas, shards = args["mesh"]
    mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    rows = args["rows"]
    shard = mesh.get_local_rank("shard")
    state = {}
    for index in range(args["tensors"]):
        local_rows = rows // shards
        if fill:  # the same values in every replica of a shard, as HSDP keeps them
            local = torch.randn(local_rows, 1024, generator=torch.Generator().manual_seed(index * 1000 + shard))
        else:
            local = torch.zeros(local_rows, 1024)
        state[f"t{index:03d}"] = DTensor.from_local(
            local, mesh, [Replicate(), Shard(0)], shape=(rows, 1024), stride=(1024, 1), run_check=False
        )
    return state


def ddp_state(args: dict[str, Any], fill: bool) -> dict[str, torch.Tensor]:
    """The same tensors as plain (non-DTensor) tensors every rank holds whole, as DDP keeps them."""
    rows = args["rows"]
    return {
        f"t{index:03d}": torch.randn(rows, 1024, generator=torch.Generator().manual_seed(index))
        if fill
        else torch.zeros(rows, 1024)
        for index in range(args["tensors"])
    }


def scenario_save(args: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    state = hsdp_state(args, fill=True)
    shardckpt.save(state, args["url"], step=1, storage_options=args.get("options"))
    if args.get("dcp"):
        dcp.save(state, storage_writer=FileSystemWriter(args["dcp"]))
    if args.get("ddp_url"):
        replicated = ddp_state(args, fill=True)
        shardckpt.save(replicated, args["ddp_url"], step=1, storage_options=args.get("options"))
        if args.get("ddp_dcp"):
            dcp.save(replicated, storage_writer=FileSystemWriter(args["ddp_dcp"]))
    dist.barrier()
    return {}


def scenario_load(args: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """The HSDP state on args["mesh"] (args["ddp"]: the DDP state instead) loaded every way: see measure()."""
    if args.get("ddp"):
        state: dict[str, Any] = ddp_state(args, fill=False)
        url, dcp_dir = args["ddp_url"], args.get("ddp_dcp")
    else:
        state, url, dcp_dir = hsdp_state(args, fill=False), args["url"], args.get("dcp")
    result = measure(args, rank, state, url, dcp_dir)
    if args.get("ddp"):  # every rank loads every tensor: check one rank's values, bit for bit
        expected = ddp_state(args, fill=True)
        assert all(torch.equal(state[name], value) for name, value in expected.items()), "DDP load differs"
    return result


def measure(args: dict[str, Any], rank: int, state: dict[str, Any], url: str, dcp_dir: str | None) -> dict[str, Any]:
    """Each way of loading `repeats` times, taking turns, cold unless args["warm"]; per way: median seconds and this
    rank's bytes read (rchar: every read syscall, page cache or disk; for S3 the bytes the load fetched)."""
    options = args.get("options")
    ways = {
        "shared": lambda: shardckpt.load(state, url, share_reads=True, storage_options=options),
        "alone": lambda: shardckpt.load(state, url, share_reads=False, storage_options=options),
    }
    if dcp_dir:
        ways["dcp"] = lambda: dcp.load(state, storage_reader=FileSystemReader(dcp_dir))
    for run in ways.values():  # untimed, uncounted: lazy imports (their reads count in rchar), first allocations
        run()
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    read: dict[str, int] = {}
    for _ in range(args["repeats"]):
        for way, run in ways.items():
            if not args.get("warm") and rank == 0:
                drop_caches()
            dist.barrier()
            before, began = read_bytes(), time.perf_counter()
            stats = run()
            dist.barrier()
            seconds[way].append(time.perf_counter() - began)
            fetched = getattr(stats, "fetched_bytes", None)
            read[way] = fetched if args.get("options") and fetched is not None else read_bytes() - before
    return {way: {"seconds": statistics.median(times), "read": read[way]} for way, times in seconds.items()}


if __name__ == "__main__":
    serve_rank(globals(), default_timeout=900.0)
