"""One rank of the local-tier tests: `python tests/helpers/tier_worker.py SCENARIO ARGS_JSON` (torchrun env).

Nodes are simulated (SHARDCKPT_NODE per rank, each node its own local directory); each rank counts the data-file
bytes it reads from the persistent root while restoring, and compares what it restored with the exact state of
the step it resumed from.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # run as a script
# args["env_by_rank"]: SHARDCKPT_* variables of one rank only, set before shardckpt reads its knobs at import.
if __name__ == "__main__":
    os.environ.update(json.loads(sys.argv[2]).get("env_by_rank", {}).get(os.environ["RANK"], {}))

import shardckpt
from shardckpt.distributed.protocol import resolve_group
from shardckpt.format import layout
from shardckpt.local_tier import LocalTier
from shardckpt.storage.local import LocalStorage
from tests.helpers.launch import serve_rank


def full(step: int) -> dict[str, torch.Tensor]:
    """The whole state after `step` steps: what every world size must restore bit for bit."""
    return {
        "w": torch.arange(64 * 256, dtype=torch.float32).reshape(64, 256) / 7 + step,  # 16 KiB per rank of 4
        "b": torch.arange(5, dtype=torch.float64) * step - 1 / 3,
        "n": torch.tensor([step], dtype=torch.int64),
    }


def sharded(step: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    whole = full(step)
    return {
        "w": distribute_tensor(whole["w"], mesh, [Shard(0)]),
        "b": distribute_tensor(whole["b"], mesh, [Shard(0)]),
        "n": whole["n"],
    }


def checkpointer(args: dict[str, Any], variant: str, node: str) -> shardckpt.Checkpointer:
    base = os.path.join(args["base"], variant)
    return shardckpt.Checkpointer(
        os.path.join(base, "persistent"),
        every_steps=2,
        keep_last=2,
        preemption_signals=(),
        local_root=os.path.join(base, f"local-{node}"),
        local_every_steps=1,
        async_save=variant == "peers1",  # local saves behind training, as persistent ones
        local_keep=2,
        peers=int(variant[-1]),
    )


def scenario_train(args: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """Steps 1..3 with a persistent save every 2 and a local one every step, for peers=1 and peers=0; then node
    1's ranks SIGKILL themselves (mid-run: before step 4), the others stop."""
    node = args["nodes"][rank]
    os.environ["SHARDCKPT_NODE"] = node
    managers = {variant: checkpointer(args, variant, node) for variant in ("peers1", "peers0")}
    for step in range(1, 4):
        for manager in managers.values():
            manager.maybe_save(step, sharded(step, world))
    for manager in managers.values():
        manager.wait()
    taken = managers["peers1"].tier.footprint(rank)  # type: ignore[union-attr]
    dist.barrier()
    if node == args["killed"]:
        os.kill(os.getpid(), signal.SIGKILL)
    return {"own": taken.own_bytes, "replicas": taken.replica_bytes, "checkpoints": taken.checkpoints}


def scenario_restore(args: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """Restore both variants on this world size: the step each resumed from, whether every tensor equals that
    step's state exactly, and the data bytes read from each persistent root."""
    node = args["nodes"][rank]
    os.environ["SHARDCKPT_NODE"] = node
    outcome: dict[str, Any] = {}
    for variant in ("peers1", "peers0"):
        persistent = os.path.join(args["base"], variant, "persistent")
        manager = checkpointer(args, variant, node)
        state = sharded(0, world)
        with counting_reads(persistent) as read, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step = manager.restore_latest(state)
        assert step is not None
        expected = full(step)
        exact = all(torch.equal(state[k].full_tensor() if k != "n" else state[k], expected[k]) for k in expected)
        tier = manager.tier.last_restore if manager.tier is not None else None
        outcome[variant] = {
            "step": step,
            "exact": exact,
            "persistent_bytes": read[0],
            "local_bytes": None if tier is None else tier.local_bytes,
            "warnings": [str(w.message)[:300] for w in caught],
        }
    return outcome


def scenario_replicate(args: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """Local saves with every rank its own node (peers=2 on 3 ranks: each rank sends its file to two and receives
    two), first through the group, then with the kernel copying between ranks of this host. Every point-to-point
    message is recorded: where a receive lands (a mapping of which file, per /proc/self/maps), whether a send comes
    from the state's own memory, and every buffer the replication allocates (tier_replicate.scratch)."""
    from shardckpt import knobs
    from shardckpt.distributed import tier_replicate

    os.environ["SHARDCKPT_NODE"] = f"n{rank}"
    generator = torch.Generator().manual_seed(7)  # the same values on every rank: plain tensors are replicated
    # Replicated tensors are written by one rank each, the largest first: one 2.5 MiB tensor per rank (split by the
    # 1 MiB window into several rounds, sent from this memory), then rank 0 the 2 MiB non-contiguous one (read back
    # from the file), and small ones (merged into one message, read back). No DTensor: its first use costs seconds.
    state: dict[str, Any] = {f"big{index}": torch.randn(640, 1024, generator=generator) for index in range(world)}
    state["t"] = torch.randn(512, 1024, generator=generator).t()
    for index in range(6):
        state[f"s{index}"] = torch.randn(30, generator=generator)
    memory = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in state.values()]
    seen: dict[str, list[Any]] = {"recv": [], "send": [], "scratch": [], "other": []}
    original = {name: getattr(dist, name) for name in ("isend", "irecv", "all_to_all_single", "send", "recv")}
    original_scratch = tier_replicate.scratch

    def recording(name: str) -> Any:
        def call(*call_args: Any, **kwargs: Any) -> Any:
            tensor = call_args[0]  # all_to_all_single: the output
            low = tensor.data_ptr()
            high = low + tensor.numel() * tensor.element_size()
            if name in ("irecv", "recv", "all_to_all_single"):
                seen["recv"].append([name, high - low, _mapped_file(low, high)])
            if name in ("isend", "send", "all_to_all_single"):
                sent = call_args[1] if name == "all_to_all_single" else tensor
                start = sent.data_ptr()
                end = start + sent.numel() * sent.element_size()
                seen["send"].append([name, end - start, any(a <= start and end <= b for a, b in memory)])
            return original[name](*call_args, **kwargs)

        return call

    def counted_scratch(size: int) -> Any:
        seen["scratch"].append(size)
        return original_scratch(size)

    outcome: dict[str, Any] = {}
    root = os.path.join(args["base"], "local")
    group = resolve_group(None)
    tier = LocalTier(os.path.join(root, f"n{rank}"), group=group, job="replicate", every_steps=1, keep=1, peers=2)
    # The ranks' environments disagree on the window: every rank must still cut the files alike (the smallest).
    knobs.LOCAL_TIER_IN_FLIGHT = knobs.LOCAL_TIER_IN_FLIGHT * (1 + 3 * (rank % 2))
    for mode, share in (("group", 0), ("host", 1)):
        knobs.SHARE_MEMORY = share
        for key in seen:
            seen[key] = []
        for name in original:
            setattr(dist, name, recording(name))
        tier_replicate.scratch = counted_scratch  # type: ignore[assignment]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a failed local save only warns: here it must not fail
                name = tier.save(state, 1 if mode == "group" else 2, group)
        finally:
            for key, function in original.items():
                setattr(dist, key, function)
            tier_replicate.scratch = original_scratch  # type: ignore[assignment]
        dist.barrier()
        copies = {}
        for source in range(world):  # every node's copy of each rank's file: how many, how many distinct
            contents = []
            for node in range(world):
                data = os.path.join(root, f"n{node}", str(name), layout.DATA_DIR)
                for file in os.listdir(data):
                    if file.startswith(f"{source:05d}-"):
                        with open(os.path.join(data, file), "rb") as handle:
                            contents.append(handle.read())
            copies[source] = [len(contents), len(set(contents))]
        outcome[mode] = {**seen, "copies": copies, "root": os.path.realpath(root)}
        if mode == "host":
            # Rank 1 cannot create a replica (a full tmpfs): no byte moves, every rank learns why, nothing commits.
            opened = tier_replicate.open_mapped
            if rank == 1:
                tier_replicate.open_mapped = _no_room  # type: ignore[assignment]
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                refused = tier.save(state, 3, group)
            tier_replicate.open_mapped = opened  # type: ignore[assignment]
            outcome["refused"] = {"name": refused, "warnings": [str(w.message) for w in caught]}
    dist.barrier()
    outcome["left"] = sorted(os.listdir(os.path.join(root, f"n{rank}")))
    return outcome


def scenario_disagree(args: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """Ranks whose local tiers disagree on what must be one (the job: its default, the persistent root's real path,
    differs where nodes mount it at other paths; peers; the cadence): each case's error per rank, None when made."""
    os.environ["SHARDCKPT_NODE"] = f"n{rank}"
    cases = {
        "job": {"job": "/fsx/run" if rank == 0 else "/mnt/fsx/run", "peers": 1, "every_steps": 1},
        "peers": {"job": "run", "peers": rank, "every_steps": 1},
        "every": {"job": "run", "peers": 1, "every_steps": 1 + rank},
        "agreed": {"job": "run", "peers": 1, "every_steps": 1},
    }
    errors: dict[str, str | None] = {}
    for case, options in cases.items():
        try:
            LocalTier(os.path.join(args["base"], f"n{rank}"), group=resolve_group(None), keep=1 + rank, **options)
        except shardckpt.errors.ShardckptError as exc:
            errors[case] = f"{type(exc).__name__}: {exc}"
        else:
            errors[case] = None
    return errors


def scenario_share_differs(args: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """scenario_disagree's cases, then a local save and a restore from it, every rank its own node, where rank 1's
    environment says SHARDCKPT_SHARE_MEMORY=0 (args' env_by_rank): the step restored, whether it came back exact."""
    refused = scenario_disagree(args, rank, world)
    generator = torch.Generator().manual_seed(11)  # plain tensors, the same on every rank: one writer each
    state = {f"t{index}": torch.randn(64, 1024, generator=generator) for index in range(world)}
    group = resolve_group(None)
    tier = LocalTier(os.path.join(args["base"], f"n{rank}"), group=group, job="share", every_steps=1, keep=1, peers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed local save only warns: here it must not fail
        assert tier.save(state, 1, group) is not None
    restored = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
    try:
        found = tier.restore(restored, group, newer_than=None)
    except Exception as exc:
        return {"refused": refused, "restore": {"error": f"{type(exc).__name__}: {exc}"}}
    exact = all(torch.equal(restored[name], tensor) for name, tensor in state.items())
    return {
        "refused": refused,
        "restore": {"error": None, "step": None if found is None else found.step, "exact": exact},
    }


def _no_room(where: Any, path: str, size: int) -> Any:
    raise shardckpt.errors.StorageError(f"{where.describe(path)}: no room left (injected)")


def _mapped_file(low: int, high: int) -> str | None:
    """The file whose shared mapping holds addresses [low, high) whole, or None (anonymous memory)."""
    with open("/proc/self/maps", encoding="utf-8") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(value, 16) for value in fields[0].split("-"))
            if start <= low and high <= end:
                return fields[5].strip() if len(fields) == 6 and fields[1].endswith("s") else None
    return None


class counting_reads:
    """Data-file bytes read (at the storage layer) under one root while inside, in the list's one element."""

    def __init__(self, root: str) -> None:
        self.root, self.count, self.original = os.path.abspath(root), [0], LocalStorage.pread_into

    def __enter__(self) -> list[int]:
        original, root, count = self.original, self.root, self.count

        def pread_into(storage: LocalStorage, fd: int, path: str, start: int, out: memoryview) -> None:
            if storage.root.startswith(root) and f"/{layout.DATA_DIR}/" in f"/{path}":
                count[0] += memoryview(out).nbytes
            original(storage, fd, path, start, out)

        LocalStorage.pread_into = pread_into  # type: ignore[method-assign]
        return count

    def __exit__(self, *exc: object) -> None:
        LocalStorage.pread_into = self.original  # type: ignore[method-assign]


if __name__ == "__main__":
    serve_rank(globals(), 60.0)
