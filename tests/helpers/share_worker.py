"""One rank of the shared-read tests: `python tests/helpers/share_worker.py SCENARIO ARGS_JSON` (torchrun env).

An FSDP2 model on a 2-D (replicate, shard) mesh as torchtitan builds HSDP, or plain replicated tensors as DDP keeps
them; each rank counts the data-file bytes it reads from storage while loading, and returns the SHA-256 of every
full tensor so tests compare states bit for bit across meshes.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import sys
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # run as a script
# args["env_by_rank"]: SHARDCKPT_* variables of one rank only, set before shardckpt reads its knobs at import (as a
# launcher that gives nodes different environments would).
if __name__ == "__main__":
    os.environ.update(json.loads(sys.argv[2]).get("env_by_rank", {}).get(os.environ["RANK"], {}))

import shardckpt
from shardckpt import knobs
from shardckpt.distributed import host_memory
from shardckpt.errors import StorageError
from shardckpt.storage.local import LocalStorage
from tests.helpers.dcp_backend_worker import counting_data_reads
from tests.helpers.launch import serve_rank


def build(seed: int, mesh_shape: list[int]) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(512, 64), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 40), nn.LayerNorm(40))
    mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=("replicate", "shard"))
    for layer in (model[0], model[1], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def digests(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str]:
    msd, osd = get_state_dict(model, optimizer)
    flat = {f"model.{k}": v for k, v in msd.items()}
    flat.update({f"optim.{fqn}.{k}": v for fqn, state in osd["state"].items() for k, v in state.items()})
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().contiguous() for k, v in flat.items()}
    return {k: hashlib.sha256(v.numpy().tobytes()).hexdigest() for k, v in full.items()}


@contextlib.contextmanager
def unreadable_data() -> Iterator[None]:
    """This process cannot read data files (an I/O error), as on a node whose mount went bad."""
    original = LocalStorage.pread_into

    def pread_into(self: LocalStorage, fd: int, path: str, start: int, out: memoryview) -> None:
        raise StorageError(f"injected I/O error reading {path}")

    LocalStorage.pread_into = pread_into  # type: ignore[method-assign]
    try:
        yield
    finally:
        LocalStorage.pread_into = original  # type: ignore[method-assign]


@contextlib.contextmanager
def dying_in_the_exchange() -> Iterator[None]:
    """This process dies (as a node does) once it has fetched its share of a shared read, before handing it over."""
    from shardckpt.distributed import shared_reads

    def die(*args: Any, **kwargs: Any) -> None:
        os._exit(3)

    with mock.patch.object(shared_reads, "any_and_least", die):
        yield


@contextlib.contextmanager
def out_of_memory_assembling() -> Iterator[None]:
    """This process has no memory left to assemble the bytes of its second round of a shared read (after the
    round's vote: the others are already in the next collective)."""
    from shardckpt.distributed import shared_reads

    original, calls = shared_reads._Assembly.settle, [0]

    def settle(self: Any, keep: bool) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            raise MemoryError("injected: no memory to assemble a round")
        return original(self, keep)

    with mock.patch.object(shared_reads._Assembly, "settle", settle):
        yield


@contextlib.contextmanager
def out_of_memory_setting_up(where: str) -> Iterator[None]:
    """This process has no memory left for its part of a shared read's setup before a collective: where="handover",
    the second round's send and receive buffers (the others are about to enter that round's all_to_all);
    where="region", its /dev/shm region (the others are about to gather the regions' names)."""
    from shardckpt.distributed import shared_reads

    if where == "region":
        with mock.patch.object(host_memory.Region, "create", side_effect=MemoryError("injected: no memory to map")):
            yield
        return
    original, calls = shared_reads._Handover.__init__, [0]

    def init(self: Any, *a: Any, **k: Any) -> None:
        calls[0] += 1
        if calls[0] == 2:
            raise MemoryError("injected: no memory to receive a round")
        original(self, *a, **k)

    with mock.patch.object(shared_reads._Handover, "__init__", init):
        yield


@contextlib.contextmanager
def slow_first_round(seconds: float) -> Iterator[None]:
    """This process takes `seconds` over the hand-over of its first round of a shared read (a busy or slow rank)."""
    import time

    from shardckpt.distributed import shared_reads

    original, calls = shared_reads._Assembly.settle, [0]

    def settle(self: Any, keep: bool) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            time.sleep(seconds)
        return original(self, keep)

    with mock.patch.object(shared_reads._Assembly, "settle", settle):
        yield


@contextlib.contextmanager
def counting_setup_collectives() -> Iterator[list[int]]:
    """Collectives a shared read runs before its rounds (plan_exchange and HostLinks.build: gathers, agreements)."""
    from shardckpt.distributed import collectives, host_memory, shared_reads

    count = [0]
    patches = []
    for module in (shared_reads, host_memory):
        for name in ("all_gather_bytes", "all_gather_fixed", "smallest"):
            original = getattr(module, name, None) or getattr(collectives, name)

            def counted(*a: Any, _original: Any = original, **k: Any) -> Any:
                count[0] += 1
                return _original(*a, **k)

            patches.append(mock.patch.object(module, name, counted, create=True))
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield count


@contextlib.contextmanager
def timing_reads() -> Iterator[list[float]]:
    """When each of this rank's shared-read rounds finished fetching (time.monotonic, in round order)."""
    import time

    from shardckpt.distributed import shared_reads

    original, ends = shared_reads._read, []

    def read(*args: Any, **kwargs: Any) -> Any:
        fetched = original(*args, **kwargs)
        ends.append(time.monotonic())
        return fetched

    with mock.patch.object(shared_reads, "_read", read):
        yield ends


@contextlib.contextmanager
def counting_hints() -> Iterator[list[int]]:
    """Bytes of data files this process announced to the kernel ahead of reading them (posix_fadvise WILLNEED)."""
    from shardckpt.storage import local

    original, count = local._LocalReader.prefetch, [0]

    def prefetch(self: Any, path: str, start: int, length: int) -> None:
        if path.startswith("data/"):
            count[0] += length
        original(self, path, start, length)

    with mock.patch.object(local._LocalReader, "prefetch", prefetch):
        yield count


def nodes(args: dict[str, Any], rank: int) -> None:
    """Simulate nodes of args["per_node"] ranks each (SHARDCKPT_NODE), as a multi-node launch would name them."""
    if args.get("per_node"):
        os.environ["SHARDCKPT_NODE"] = f"node-{rank // args['per_node']}"


@contextlib.contextmanager
def counting_links(args: dict[str, Any], rank: int) -> Iterator[list[int]]:
    """The (reader, consumer) pairs that handed bytes over through shared memory in the loads inside, and this
    rank's choice (args["no_shm_rank"]: that rank declines shared memory, as SHARDCKPT_SHARE_MEMORY=0 makes it;
    args["full_shm_rank"]: that rank's /dev/shm has no room for its region, so it only maps the others')."""
    pairs = [0]
    original = host_memory.HostLinks.build.__func__  # type: ignore[attr-defined]

    def build(cls: type, *a: Any, **k: Any) -> host_memory.HostLinks:
        links = original(cls, *a, **k)
        pairs[0] += len(links.linked)
        return links

    knobs.SHARE_MEMORY = 0 if args.get("no_shm_rank") in (rank, "all") else 1
    knobs.SHARE_MIN_SAVING = 100.0 if args.get("stingy_rank") == rank else 0.05  # SHARDCKPT_SHARE_MIN_SAVING=100
    host_memory.HostLinks.build = classmethod(build)  # type: ignore[method-assign, assignment]
    full = mock.patch("os.posix_fallocate", side_effect=OSError(errno.ENOSPC, "No space left on device"))
    try:
        with full if args.get("full_shm_rank") == rank else contextlib.nullcontext():
            yield pairs
    finally:
        host_memory.HostLinks.build = classmethod(original)  # type: ignore[method-assign, assignment]


def leftovers() -> list[str]:
    """This process's files in /dev/shm (a shared read must leave none, whatever happened)."""
    mine = f"{host_memory.PREFIX}{os.getpid()}-"
    return [name for name in os.listdir(host_memory.SHM_DIR) if name.startswith(mine)]


def scenario_hsdp_save(args: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    model, optimizer = build(0, args["mesh"])
    generator = torch.Generator().manual_seed(7)
    model(torch.randint(0, 512, (8, 4), generator=generator)).pow(2).mean().backward()
    optimizer.step()
    msd, osd = get_state_dict(model, optimizer)
    shardckpt.save({"model": msd, "optim": osd}, args["url"], step=1)
    return {"digests": digests(model, optimizer)}


def scenario_hsdp_load(args: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    nodes(args, rank)
    model, optimizer = build(1, args["mesh"])
    model(torch.zeros(2, 3, dtype=torch.long)).sum().backward()  # AdamW state exists only after a step
    optimizer.step()
    optimizer.zero_grad()
    msd, osd = get_state_dict(model, optimizer)
    with counting_data_reads() as read, counting_links(args, rank) as pairs:
        shardckpt.load({"model": msd, "optim": osd}, args["url"], share_reads=args.get("share"))
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
    dist.barrier()
    return {"digests": digests(model, optimizer), "read": read[0], "links": pairs[0]}


def replicated(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(96, 80, generator=generator) for i in range(6)}


def scenario_ddp_save(args: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    shardckpt.save(
        {"model": replicated(3)},
        args["url"],
        step=args.get("step", 1),
        compression=args.get("compression"),
        parent=args.get("parent"),
        piece_hashes=args.get("piece_hashes"),
    )
    return {}


def scenario_ddp_load(args: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    nodes(args, rank)
    state = {"model": {k: torch.zeros_like(v) for k, v in replicated(3).items()}}
    failing = contextlib.nullcontext() if args.get("fail_rank") != rank else unreadable_data()
    if args.get("die_rank") == rank:
        failing = dying_in_the_exchange()
    if args.get("oom_rank") == rank:
        failing = out_of_memory_setting_up(args["oom_at"]) if "oom_at" in args else out_of_memory_assembling()
    if args.get("slow_rank") == rank:
        failing = slow_first_round(args["slow_seconds"])
    with (
        counting_data_reads() as read,
        failing,
        counting_links(args, rank) as pairs,
        timing_reads() as reads,
        counting_hints() as hinted,
        counting_setup_collectives() as setup,
    ):
        share = args["share_by_rank"][rank] if "share_by_rank" in args else args.get("share")
        try:
            budget = args["budget_by_rank"][rank] if "budget_by_rank" in args else args.get("budget", 256 << 20)
            stats = shardckpt.load(state, args["url"], share_reads=share, max_in_flight=budget)
        finally:
            left = leftovers()
            assert not left, left
    same = all(torch.equal(state["model"][k], v) for k, v in replicated(3).items())
    timing = [end - reads[0] for end in reads]
    result = {"equal": same, "read": read[0], "links": pairs[0], "reads": timing, "hinted": hinted[0]}
    return {**result, "setup": setup[0], "fetched": stats.fetched_bytes}


FLAT = [("w0", (300, 70)), ("w1", (129,)), ("w2", (64, 90)), ("w3", (7, 5))]  # 27,764 fp32 elements


def flat_values() -> torch.Tensor:
    return torch.randn(sum(math.prod(shape) for _, shape in FLAT), generator=torch.Generator().manual_seed(5))


def scenario_flat_save(args: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """ZeRO-style flat partitions, one per rank, as DeepSpeed keeps fp32 master weights."""
    flat, size = flat_values(), -(-sum(math.prod(shape) for _, shape in FLAT) // world)
    lo, hi = rank * size, min((rank + 1) * size, flat.numel())
    shardckpt.save({"zero": shardckpt.FlatPartition(flat[lo:hi].clone(), FLAT, lo)}, args["url"], step=1)
    return {}


def scenario_flat_load(args: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """Flat partitions on another world size whose ranges overlap by args["overlap"] elements each side."""
    flat = flat_values()
    size = -(-flat.numel() // world)
    lo, hi = max(0, rank * size - args["overlap"]), min(flat.numel(), (rank + 1) * size + args["overlap"])
    part = shardckpt.FlatPartition(torch.zeros(hi - lo), FLAT, lo)
    with counting_data_reads() as read, counting_links(args, rank) as pairs:
        shardckpt.load({"zero": part}, args["url"], share_reads=True)
    return {"equal": torch.equal(part.buffer, flat[lo:hi]), "read": read[0], "links": pairs[0]}


def incremental(step: int) -> dict[str, torch.Tensor]:
    """Twelve 48 KiB tensors (more than MAX_GAP: a load never reads through one it does not need); from step 2 on,
    every other one changed: the child stores six, and six separate ranges of its parent's file by reference."""
    generator = torch.Generator().manual_seed(11)
    state = {f"layer{i:02d}.weight": torch.randn(128, 96, generator=generator) for i in range(12)}
    if step > 1:
        for i in range(1, 12, 2):
            state[f"layer{i:02d}.weight"] += step
    return state


@contextlib.contextmanager
def counting_own_and_referenced_reads() -> Iterator[list[int]]:
    """counting_data_reads, with the data files of other checkpoints of the root (references: `step-1/data/...`)."""
    original, count = LocalStorage.pread_into, [0]

    def pread_into(self: LocalStorage, fd: int, path: str, start: int, out: memoryview) -> None:
        if path.startswith("data/") or "/data/" in path:
            count[0] += memoryview(out).nbytes
        original(self, fd, path, start, out)

    LocalStorage.pread_into = pread_into  # type: ignore[method-assign]
    try:
        yield count
    finally:
        LocalStorage.pread_into = original  # type: ignore[method-assign]


def scenario_incremental_save(args: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    shardckpt.save({"model": incremental(1)}, args["parent"], step=1, piece_hashes=True)
    shardckpt.save({"model": incremental(2)}, args["url"], step=2, parent=args["parent"])
    return {}


def scenario_incremental_load(args: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """Every rank loads the whole child: half of its tensors are stored by reference in the parent's file;
    verify_first (every request kept until all are verified) with a small budget (many rounds)."""
    state = {"model": {k: torch.zeros_like(v) for k, v in incremental(2).items()}}
    with counting_own_and_referenced_reads() as read, counting_links(args, rank) as pairs:
        shardckpt.load(state, args["url"], share_reads=True, verify_first=True, max_in_flight=args["budget"])
    same = all(torch.equal(state["model"][k], v) for k, v in incremental(2).items())
    return {"equal": same, "read": read[0], "links": pairs[0]}


if __name__ == "__main__":
    serve_rank(globals(), default_timeout=120.0)
