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
from shardckpt.format import layout
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
