"""One rank of a multi-process test: `python tests/dist_worker.py SCENARIO ARGS_JSON` with torchrun's env vars.

Each rank writes its verdict to RESULT_DIR/rank-<r>.json before teardown, then leaves with os._exit so a
known gloo abort at interpreter exit cannot be mistaken for a test failure (FIELD-NOTES).
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # run as a script

import shardckpt
from tests.helpers.launch import serve_rank


def build(seed: int, world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(13, 6), nn.Linear(6, 7), nn.ReLU(), nn.Linear(7, 5), nn.LayerNorm(5))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[1], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, world: int) -> None:
    generator = torch.Generator().manual_seed(100)
    tokens = torch.randint(0, 13, (12, 3), generator=generator)
    mine = tokens.chunk(world)[rank]
    loss = model(mine).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    msd, osd = get_state_dict(model, optimizer)
    flat: dict[str, torch.Tensor] = {}
    for name, value in msd.items():
        flat[f"model.{name}"] = value.full_tensor() if isinstance(value, DTensor) else value
    for fqn, state in osd["state"].items():
        for key, value in state.items():
            flat[f"optim.{fqn}.{key}"] = value.full_tensor() if isinstance(value, DTensor) else value
    return {k: v.detach().clone().contiguous() for k, v in flat.items()}


def scenario_save(args: dict, rank: int, world: int) -> dict:
    model, optimizer = build(0, world)
    train_step(model, optimizer, rank, world)
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd, "rng": shardckpt.PerRank({"rank": rank}), "epoch": 3}
    manifest = shardckpt.save(state, args["url"], step=1)
    reference = full_state(model, optimizer)
    if rank == 0:
        save_file(reference, args["reference"])
    return {"attempt": manifest.attempt, "tensors": len(manifest.tensors)}


def scenario_load(args: dict, rank: int, world: int) -> dict:
    results = {}
    for url, reference_path in zip(args["urls"], args["references"]):
        model, optimizer = build(1, world)  # other initial values: everything must come from the checkpoint
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd, "rng": shardckpt.PerRank(None), "epoch": 0}
        stats = shardckpt.load(state, url)
        set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
        reference = load_file(reference_path)
        restored = full_state(model, optimizer)
        mismatched = sorted(k for k in reference if not torch.equal(reference[k], restored[k]))
        missing = sorted(set(reference) ^ set(restored))
        rng = state["rng"].value
        results[url] = {
            "mismatched": mismatched + missing,
            "needed": stats.needed_bytes,
            "fetched": stats.fetched_bytes,
            "epoch": state["epoch"],
            "rng": rng,
        }
    return results


def scenario_layouts(args: dict, rank: int, world: int) -> dict:
    """Shard(1), Replicate and a 2-D mesh saved on `world` ranks; checked by a single-process read later."""
    torch.manual_seed(5)
    full = {"col": torch.randn(6, 10), "rep": torch.randn(4, 3), "grid": torch.randn(9, 7)}
    mesh = init_device_mesh("cpu", (world,))
    state = {
        "col": distribute_tensor(full["col"], mesh, [Shard(1)]),
        "rep": distribute_tensor(full["rep"], mesh, [Replicate()]),
    }
    if world == 4:
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
        state["grid"] = distribute_tensor(full["grid"], mesh2, [Shard(0), Shard(1)])
        state["grid_rep"] = distribute_tensor(full["grid"], mesh2, [Replicate(), Shard(0)])
    shardckpt.save(state, args["url"])
    if rank == 0:
        save_file({**full, "grid_rep": full["grid"].clone()}, args["reference"])
    fresh = {
        k: torch.zeros_like(v)
        if not isinstance(v, DTensor)
        else distribute_tensor(torch.zeros(v.shape), v.device_mesh, v.placements)
        for k, v in state.items()
    }
    shardckpt.load(fresh, args["url"])
    return {"equal": {k: torch.equal(fresh[k].full_tensor(), state[k].full_tensor()) for k in state}}


def scenario_flat_to_fsdp(args: dict, rank: int, world: int) -> dict:
    """ZeRO-style flat partitions saved on `world` ranks, loaded into a real FSDP2 model, saved, loaded back flat."""
    model, _ = build(0, world)
    params = [(f"model.{name}", tuple(p.shape)) for name, p in model.named_parameters()]
    reference = full_state(*build(0, world))  # the same seed: the full parameters the flat buffers hold
    flat = torch.cat([reference[name].reshape(-1) for name, _ in params])
    lo, hi = _chunk(flat.numel(), world, rank)
    shardckpt.save({"zero": shardckpt.FlatPartition(flat[lo:hi].clone(), params, lo)}, args["flat_url"])
    fsdp, _ = build(7, world)  # other values: all must come from the flat checkpoint
    msd = fsdp.state_dict()
    shardckpt.load({"model": msd}, args["flat_url"])
    restored = {f"model.{k}": v.full_tensor() for k, v in msd.items()}
    into_fsdp = all(torch.equal(restored[name], reference[name]) for name, _ in params)
    shardckpt.save({"model": msd}, args["box_url"])
    back = shardckpt.FlatPartition(torch.zeros(hi - lo), params, lo)
    shardckpt.load({"zero": back}, args["box_url"])
    return {"into_fsdp": into_fsdp, "back_to_flat": torch.equal(back.buffer, flat[lo:hi])}


def _chunk(length: int, world: int, rank: int) -> tuple[int, int]:
    size = -(-length // world)
    start = min(rank * size, length)
    return start, min(start + size, length)


def scenario_fail(args: dict, rank: int, world: int) -> dict:
    state = {"w": distribute_tensor(torch.ones(8, 2), init_device_mesh("cpu", (world,)), [Shard(0)])}
    if rank == args["bad_rank"]:
        if args.get("die"):
            os._exit(9)  # a real crash in the middle of the save
        state["oops"] = object()  # cannot be stored: this rank fails while writing
    try:
        shardckpt.save(state, args["url"])
    except shardckpt.DistributedError as exc:
        return {"raised": "DistributedError", "failures": {str(k): v for k, v in exc.failures.items()}}
    except shardckpt.ShardckptError as exc:
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": None}


def crash_tensors(step: int) -> dict[str, torch.Tensor]:
    """The full tensors of step `step` in the crash tests: several per rank, so a crash can fall between them."""
    generator = torch.Generator().manual_seed(1000 + step)
    return {
        "a": torch.randn(64, 33, generator=generator),
        "b": torch.randint(-(2**40), 2**40, (40, 7), generator=generator),
        "c": torch.randn(96, 5, generator=generator).bfloat16(),
        "d": torch.randn(17, generator=generator, dtype=torch.float64),
        # The same at every step: an incremental save stores it by reference to the previous checkpoint.
        "frozen": torch.randn(48, 20, generator=torch.Generator().manual_seed(999)),
    }


def crash_state(rank: int, world: int, step: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    state: dict = {name: distribute_tensor(t, mesh, [Shard(0)]) for name, t in crash_tensors(step).items()}
    state["rng"] = shardckpt.PerRank({"rank": rank, "step": step})
    state["trainer"] = {"step": step}
    return state


def scenario_crash(args: dict, rank: int, world: int) -> dict:
    """Commit step-1, then save step-2 with SHARDCKPT_CRASH_AT armed (retention: prune with it armed instead)."""
    from shardckpt.catalog.retention import prune
    from shardckpt.storage import open_storage

    root = args["root"]
    incremental = bool(args.get("incremental"))
    shardckpt.save(crash_state(rank, world, 1), f"{root}/step-1", step=1, piece_hashes=incremental)
    if args.get("retention"):
        shardckpt.save(crash_state(rank, world, 2), f"{root}/step-2", step=2)
        shardckpt.save(crash_state(rank, world, 3), f"{root}/step-3", step=3)
        os.environ["SHARDCKPT_CRASH_AT"] = args["crash_at"]
        if rank == 0:
            prune(open_storage(root), keep_last=1)
        dist.barrier()
        return {"raised": None}
    os.environ["SHARDCKPT_CRASH_AT"] = args["crash_at"]
    parent = f"{root}/step-1" if incremental else None
    try:
        shardckpt.save(crash_state(rank, world, 2), f"{root}/step-2", step=2, parent=parent)
    except shardckpt.ShardckptError as exc:
        return {"raised": type(exc).__name__, "message": str(exc)[:1000]}
    return {"raised": None}


def scenario_retry(args: dict, rank: int, world: int) -> dict:
    """Save step 2 again to each URL (which holds the leftovers of a crashed attempt), incremental ones again on
    their parent."""
    parents = args.get("parents", {})
    return {
        url: shardckpt.save(crash_state(rank, world, 2), url, step=2, parent=parents.get(url)).attempt
        for url in args["urls"]
    }


def scenario_dcp_save(args: dict, rank: int, world: int) -> dict:
    """One trained FSDP2 model + AdamW state saved by torch.distributed.checkpoint and by shardckpt.

    Rank 0 keeps the full tensors (DTensor.full_tensor) as the reference for export and import tests.
    """
    import torch.distributed.checkpoint as dcp

    model, optimizer = build(0, world)
    train_step(model, optimizer, rank, world)
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd, "extra": {"epoch": 3, "tag": "dcp"}}, checkpoint_id=args["dcp_dir"])
    shardckpt.save({"model": msd, "optim": osd}, args["url"], step=1)
    reference = full_state(model, optimizer)
    if rank == 0:
        save_file(reference, args["reference"])
    return {"tensors": len(reference)}


def _protocol_case(case: str, url: str, rank: int, world: int) -> dict:
    """One case of scenario_protocol_faults; the injected fault (if any) is armed on one rank only."""
    from unittest import mock

    from shardckpt.distributed import protocol
    from shardckpt.storage.local import LocalStorage

    def fail(error: BaseException):
        def raising(*args, **kwargs):
            raise error

        return raising

    mesh = init_device_mesh("cpu", (world,))
    state: dict = {"w": distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Shard(0)]), "epoch": 3}
    patches: list = []
    operation = "save"
    # coordinator_*: each rank names another coordinator (rank 1 one outside the group of 2 in coordinator_range).
    coordinator = {"coordinator_save": rank, "coordinator_load": rank, "coordinator_range": 2 * rank}.get(case, 0)
    if case == "exists_fault" and rank == 0:
        patches.append(mock.patch.object(LocalStorage, "exists", fail(shardckpt.StorageError("injected: stat"))))
    elif case == "open_fault" and rank == 1:
        patches.append(mock.patch.object(protocol, "open_storage", fail(shardckpt.StorageError("injected: open"))))
    elif case == "flatten_fault" and rank == 1:
        state[("not", "a", "str")] = torch.ones(1)
    elif case == "replicated_tensor":
        state["rng"] = torch.tensor([rank, 7])
    elif case == "partial_tensor" and rank == 1:
        state["extra"] = torch.ones(2)
    elif case == "replicated_value":
        state["seed"] = 1000 + rank
    elif case == "partial_value" and rank == 1:
        state["note"] = "only here"
    elif case == "replicated_ok":
        state["rng"] = shardckpt.PerRank(torch.tensor([rank, 7]))
        state["seed"] = shardckpt.PerRank(1000 + rank)
        state["shared"] = torch.tensor([5, 7])
    elif case.startswith("load_") or case in ("dtensor_shape", "coordinator_load"):
        if case == "load_stateful_fault":
            state["app"] = {"epoch": 3}  # what the Stateful below holds
        shardckpt.save(state, url)
        operation = "load"
        if case == "dtensor_shape":
            state = {"w": distribute_tensor(torch.zeros(2, 2), mesh, [Shard(0)]), "epoch": 0}
        else:
            state = {"w": distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)]), "epoch": 0}
        if case == "load_opening_fault" and rank == 0:
            patches.append(mock.patch.object(protocol, "read_opening", fail(PermissionError(13, "injected: denied"))))
        if case == "load_open_fault" and rank == 1:
            patches.append(mock.patch.object(protocol, "open_storage", fail(shardckpt.StorageError("injected: open"))))
        if case == "load_stateful_fault":
            state["app"] = _StatefulFailing(rank == 1)
    if case.startswith("ckpt_"):
        return _checkpointer_case(case, url, rank, state, fail)
    # agree_*: each rank passes its own step, metadata or block size (before: rank 0's was committed silently).
    differing: dict = {
        "agree_step": {"step": 100 + rank},
        "agree_metadata": {"step": 7, "metadata": {"run": f"rank{rank}-config"}},
        "agree_block_size": {"block_size": 4096 * (1 + 15 * rank)},
        # Equal step, metadata (its dicts built in another order on each rank) and block size; compression differs
        # between the ranks, as it may.
        "agree_ok": {
            "step": 7,
            "metadata": {"a": 1, "b": [2, {"x": 1, "y": (3,)}]} if rank else {"b": [2, {"y": (3,), "x": 1}], "a": 1},
            "block_size": 4096,
            "compression": "zstd" if rank else None,
        },
    }.get(case, {})
    for patch in patches:
        patch.start()
    try:
        if case == "url_differs" and rank == 1:  # a rank saving to another URL than the coordinator's
            url += "-elsewhere"
        if operation == "save":
            shardckpt.save(state, url, coordinator=coordinator, **differing)
        else:
            shardckpt.load(state, url, coordinator=coordinator)
    except shardckpt.DistributedError as exc:
        return {"raised": "DistributedError", "failures": {str(k): v for k, v in exc.failures.items()}}
    except Exception as exc:
        return {"raised": type(exc).__name__, "message": str(exc)[:2000]}
    finally:
        for patch in patches:
            patch.stop()
    if case == "replicated_ok":
        fresh = {
            "w": distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)]),
            "epoch": 0,
            "rng": shardckpt.PerRank(None),
            "seed": shardckpt.PerRank(None),
            "shared": torch.zeros(2, dtype=torch.int64),
        }
        shardckpt.load(fresh, url)
        return {
            "raised": None,
            "rng": fresh["rng"].value.tolist(),
            "seed": fresh["seed"].value,
            "shared": fresh["shared"].tolist(),
        }
    return {"raised": None}


class _StatefulFailing:
    """A DCP Stateful whose state_dict() fails on one rank (a dataloader whose worker died there)."""

    def __init__(self, failing: bool) -> None:
        self.failing = failing

    def state_dict(self) -> dict:
        if self.failing:
            raise RuntimeError("injected: stateful")
        return {"epoch": 0}

    def load_state_dict(self, state: dict) -> None:
        pass


def _checkpointer_case(case: str, url: str, rank: int, state: dict, fail) -> dict:
    """The Checkpointer's own collectives: a failure on one rank (its state, its staging, the coordinator's
    listing or retention) reaches every rank, or (retention, after the commit) only warns."""
    from unittest import mock

    from shardckpt import checkpointer as checkpointer_module

    def broken_state() -> dict:
        if rank == 1:
            raise RuntimeError("injected: state")
        return state

    patches: list = []
    if case == "ckpt_latest_fault" and rank == 0:
        patches.append(mock.patch.object(checkpointer_module, "latest", fail(shardckpt.StorageError("injected: list"))))
    if case == "ckpt_retention_fault" and rank == 0:
        patches.append(mock.patch.object(checkpointer_module, "retain", fail(shardckpt.StorageError("injected: rm"))))
    for patch in patches:
        patch.start()
    try:
        manager = shardckpt.Checkpointer(url, every_steps=1, async_save=case == "ckpt_stage_fault")
        if case == "ckpt_latest_fault":
            manager.restore_latest(state)
        elif case == "ckpt_retention_fault":
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                manager.save(1, state)
            return {"raised": None, "warned": any("retention" in str(w.message) for w in caught)}
        elif case == "ckpt_step_differs":  # before: an IntegrityError blaming a missing file, two partial saves
            manager.save(1 + rank, state, wait=True)
        elif case == "ckpt_maybe_step_differs":  # before: rank 0 (due) waited in the save for rank 1 (not due)
            shardckpt.Checkpointer(url, every_steps=2).maybe_save(2 + rank, state)
        else:
            manager.save(1, broken_state)
            manager.wait()
    except shardckpt.DistributedError as exc:
        return {"raised": "DistributedError", "failures": {str(k): v for k, v in exc.failures.items()}}
    except Exception as exc:
        return {"raised": type(exc).__name__, "message": str(exc)[:2000]}
    finally:
        for patch in patches:
            patch.stop()
    return {"raised": None}


def scenario_protocol_faults(args: dict, rank: int, world: int) -> dict:
    """Each case of args["cases"] in turn on one group; each rank's outcome is written as soon as it is known, so a
    case that hangs (until the group timeout) still leaves the verdicts of the cases before it."""
    outcomes = {}
    for case in args["cases"]:
        outcomes[case] = _protocol_case(case, os.path.join(args["root"], case), rank, world)
        with open(os.path.join(args["root"], f"{case}.rank-{rank}.json"), "w") as handle:
            json.dump(outcomes[case], handle)
    return outcomes


def _seeded_rng(seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.get_rng_state()


def scenario_per_rank_save(args: dict, rank: int, world: int) -> dict:
    """Each rank saves its own RNG state (the README's fill-in) at the top level and nested in a dict."""
    state = {
        "w": torch.arange(6.0),
        "rng": shardckpt.PerRank({"torch": _seeded_rng(100 + rank)}),
        "loop": {"position": shardckpt.PerRank({"t": torch.full((2,), rank), "n": rank})},
    }
    shardckpt.save(state, args["url"], step=1)
    return {}


def scenario_per_rank_load(args: dict, rank: int, world: int) -> dict:
    """For each PerRank(missing=...) choice: which saved rank's values this rank got, or the error it raised."""
    outcomes = {}
    for missing in ("keep", "wrap", "error"):
        rng = shardckpt.PerRank("mine", missing=missing)
        position = shardckpt.PerRank("mine", missing=missing)
        state = {"w": torch.zeros(6), "rng": rng, "loop": {"position": position}}
        try:
            shardckpt.load(state, args["url"])
        except shardckpt.ShardckptError as exc:
            outcomes[missing] = {"raised": type(exc).__name__, "message": str(exc)}
            continue
        got = {}
        if rng.value != "mine":
            got["rng"] = next(r for r in range(8) if torch.equal(rng.value["torch"], _seeded_rng(100 + r)))
        else:
            got["rng"] = "mine"
        got["position"] = position.value if position.value == "mine" else position.value["n"]
        if position.value != "mine":
            assert torch.equal(position.value["t"], torch.full((2,), got["position"]))
        outcomes[missing] = got
    return outcomes


def scenario_series(args: dict, rank: int, world: int) -> dict:
    """An incremental series with run names on every rank (issues 23.2, 23.13): the names and parents each saw."""
    mesh = init_device_mesh("cpu", (world,))
    base = torch.arange(64.0).reshape(8, 8)
    kinds, urls = [], []
    for run in range(2):  # a restart half way: the series goes on from what the root holds, under new names
        ckpt = shardckpt.Checkpointer(
            args["root"], every_steps=1, keep_last=1, incremental=True, full_every=3, run_names=True
        )
        for step in range(3 * run + 1, 3 * run + 4):
            state = {"base": distribute_tensor(base, mesh, [Shard(0)]), "head": torch.full((4,), float(step))}
            ckpt.maybe_save(step, state)
            kinds.append("F" if ckpt.records[-1].parent is None else "i")
            urls.append(ckpt.records[-1].url)
        ckpt.close()
    return {"kinds": "".join(kinds), "urls": urls}


def scenario_launch(args: dict, rank: int, world: int) -> dict:
    """For the launcher's own test: rank args["hang"] writes its pid and hangs; the others say what they see."""
    if rank == args["hang"]:
        with open(os.path.join(args["pid_dir"], "hung.pid"), "w") as handle:
            handle.write(str(os.getpid()))
        dist.barrier()
        while True:
            time.sleep(60)
    dist.barrier()
    return {"variable": os.environ.get(args["variable"]), "threads": torch.get_num_threads(), "pid": os.getpid()}


def main() -> None:
    serve_rank(globals(), default_timeout=60)


if __name__ == "__main__":
    main()
