"""One rank of the local-tier benchmark: a Shard(0) state on 4 gloo ranks as 2 simulated nodes, saved with
async_save to the persistent root and to the node-local tier (peers=1), then restored from each.

Run by benchmarks/local_tier.py through tests/helpers/launch.py; each rank's verdict goes to its JSON file.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script

import shardckpt
from benchmarks.pagecache import drop_caches
from tests.helpers.launch import serve_rank


def state(args: dict[str, Any], world: int, fill: bool) -> dict[str, DTensor]:
    mesh = init_device_mesh("cpu", (world,))
    generator = torch.Generator().manual_seed(1)
    shape = (args["rows"], 1024)
    return {
        f"t{index:03d}": distribute_tensor(
            torch.randn(shape, generator=generator) if fill else torch.zeros(shape), mesh, [Shard(0)]
        )
        for index in range(args["tensors"])
    }


def manager(args: dict[str, Any], rank: int, local: bool) -> shardckpt.Checkpointer:
    os.environ["SHARDCKPT_NODE"] = f"node-{rank // 2}"
    return shardckpt.Checkpointer(
        args["url"],
        every_steps=1 << 30,
        keep_last=2,
        async_save=True,
        preemption_signals=(),
        storage_options=args.get("options"),
        local_root=f"{args['local']}/node-{rank // 2}" if local else None,
        local_every_steps=1,
        local_keep=1,
        peers=1,
    )


def _reset_peak() -> int:
    """Reset this process's peak resident set (VmHWM) to its current size (Linux); that size, in bytes."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as file:
            file.write("5")
    except OSError:
        pass
    return _status("VmRSS")


def _status(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as file:
        for line in file:
            if line.startswith(field + ":"):
                return int(line.split()[1]) << 10
    return 0


def scenario_save(args: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """Persistent and local saves taking turns: the training stall of each (maybe_save until it returns) and the time
    until each committed (wait), medians."""
    warnings.simplefilter("ignore")
    ckpt, values = manager(args, rank, local=True), state(args, world, fill=True)
    times: dict[str, list[float]] = {
        "persistent_stall": [],
        "persistent_total": [],
        "local_stall": [],
        "local_total": [],
        "persistent_peak_mib": [],
        "local_peak_mib": [],
    }
    step = 0
    for _ in range(args["repeats"]):
        for kind in ("persistent", "local"):
            step += 1
            dist.barrier()
            before = _reset_peak()
            began = time.perf_counter()
            if kind == "persistent":
                ckpt.maybe_save(step, values, force=True)
            else:
                ckpt.maybe_save(step, values)  # not a persistent step: the local tier's
            times[f"{kind}_stall"].append(time.perf_counter() - began)
            ckpt.wait()
            # The host memory this save took above what the process held before (staging buffers are kept between
            # saves, so the first save of the run also counts their allocation: the max of the repeats shows it).
            times[f"{kind}_peak_mib"].append((_status("VmHWM") - before) / (1 << 20))
            dist.barrier()
            times[f"{kind}_total"].append(time.perf_counter() - began)
    ckpt.close()
    medians = {name: statistics.median(values) for name, values in times.items()}
    medians.update({f"{kind}_peak_first_mib": times[f"{kind}_peak_mib"][0] for kind in ("persistent", "local")})
    return medians


def scenario_restore(args: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """restore_latest from the local tier (the newest step is local) and from the persistent root alone, cold."""
    warnings.simplefilter("ignore")
    values = state(args, world, fill=False)
    seconds: dict[str, list[float]] = {"local": [], "persistent": []}
    # Every rank's first use of the storage client (S3: its session) is neither restore's cost.
    shardckpt.latest(args["url"], storage_options=args.get("options"))
    for _ in range(args["repeats"]):
        for kind in ("local", "persistent"):
            ckpt = manager(args, rank, local=kind == "local")
            if rank == 0 and not args.get("warm"):
                drop_caches()  # the persistent root's pages; tmpfs pages stay (they are the tier)
            dist.barrier()
            began = time.perf_counter()
            step = ckpt.restore_latest(values)
            dist.barrier()
            seconds[kind].append(time.perf_counter() - began)
            restored = ckpt.tier.last_restore is not None if ckpt.tier is not None else False
            assert restored == (kind == "local"), (kind, step)
    return {kind: statistics.median(times) for kind, times in seconds.items()}


if __name__ == "__main__":
    serve_rank(globals(), default_timeout=1800.0)
