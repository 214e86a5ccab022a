"""One rank of the MoE tests (tests/distributed/test_moe.py): `python moe_worker.py SCENARIO ARGS_JSON`.

scenario_save (4 ranks) saves the per-expert and the grouped states and reloads the grouped ones on EP 4 x FSDP 1;
scenario_load (3 ranks) reloads all of them on FSDP 3 / EP 1 x FSDP 3. Each part reports its verdict on its own.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # run as a script
import shardckpt
from tests.helpers.launch import serve_rank
from tests.helpers.moe_model import (
    Box,
    chunk,
    grid_boxes,
    grouped_model,
    per_expert_model,
    train_step,
    verified_read_bytes,
)

BLOCK = 4096  # the smallest checksum block: the tests' expert rows are multiples of it
VARIANTS = {"shard1": 1, "strided": 0}  # FSDP's tensor dim on the grouped experts


def leaves(state: dict) -> dict[str, torch.Tensor]:
    """The tensors of {"model": msd, "optim": osd} by stored name (DTensors kept as they are)."""
    out = {f"model.{name}": value for name, value in state["model"].items()}
    for fqn, entries in state["optim"]["state"].items():
        out.update({f"optim.state.{fqn}.{key}": value for key, value in entries.items()})
    return out


def local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def part(results: dict, name: str, run: Callable[[], dict]) -> None:
    """Run one part of a scenario; a failure is that part's verdict, so the other parts still report."""
    began = time.perf_counter()
    try:
        results[name] = {"ok": True, **run(), "seconds": time.perf_counter() - began}
    except Exception as exc:
        results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}


# Per-expert tensors under FSDP2 (Shard(0) over all ranks): saved on 4, loaded on 3.


def per_expert_save(args: dict, rank: int, world: int) -> dict:
    config = args["per_expert"]
    model, optimizer = per_expert_model(0, world, **config)
    train_step(model, optimizer, config["dim"], rank)
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    # The saved values: each rank's own shards (20,000 full_tensor gathers would take longer than the save).
    shards = {name: local(value).detach().clone().contiguous() for name, value in leaves(state).items()}
    save_file(shards, os.path.join(args["root"], f"per-expert-rank{rank}.safetensors"))
    manifest = shardckpt.save(state, os.path.join(args["root"], "per-expert"), block_size=BLOCK)
    return {"stored": len(manifest.tensors), "world": world}


def per_expert_load(args: dict, rank: int, world: int) -> dict:
    config = args["per_expert"]
    model, optimizer = per_expert_model(1, world, **config)  # other values: all must come from the checkpoint
    train_step(model, optimizer, config["dim"], rank)
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    stats = shardckpt.load(state, os.path.join(args["root"], "per-expert"), max_gap=0)
    dumps = [load_file(os.path.join(args["root"], f"per-expert-rank{r}.safetensors")) for r in range(args["saved"])]
    mismatched, expected, needed = [], 0, 0
    for name, value in leaves(state).items():
        mine = local(value)
        if isinstance(value, DTensor):  # FSDP2: torch.chunk of dim 0 over the ranks, in rank order
            full = torch.cat([dump[name] for dump in dumps])
            start, stop = chunk(full.shape[0], world, rank)
            want = full[start:stop]
            stored = grid_boxes(full.shape, {0: args["saved"]})
            box: Box = ((start,) + (0,) * (full.dim() - 1), (stop - start, *full.shape[1:]))
        else:  # AdamW's step: one replicated scalar, stored once
            want, stored, box = dumps[0][name], [((), ())], ((), ())
        if mine.shape != want.shape or not torch.equal(mine, want):
            mismatched.append(name)
        expected += verified_read_bytes(stored, box, mine.element_size(), BLOCK)
        needed += mine.numel() * mine.element_size()
    return {
        "tensors": len(leaves(state)),
        "mismatched": mismatched[:20],
        "needed": stats.needed_bytes,
        "fetched": stats.fetched_bytes,
        "expected_needed": needed,
        "expected_fetched": expected,
    }


# Grouped experts [experts, ...] under expert parallelism x FSDP2 on a 2-D (fsdp, ep) mesh.


def expert_box(shape: tuple[int, ...], ep: int, fsdp: int, fsdp_dim: int, rank: int) -> Box:
    """The box rank `rank` of an (fsdp, ep) mesh holds: experts split over EP, then FSDP splits tensor dim
    `fsdp_dim` (dim 0: within the rank's experts, which is what _StridedShard(0) means)."""
    f, e = divmod(rank, ep)
    offsets, sizes = [0] * len(shape), list(shape)
    offsets[0], stop = chunk(shape[0], ep, e)
    sizes[0] = stop - offsets[0]
    start, stop = chunk(sizes[fsdp_dim], fsdp, f)
    offsets[fsdp_dim] += start
    sizes[fsdp_dim] = stop - start
    return tuple(offsets), tuple(sizes)


def grouped_expected(state: dict, layout: tuple[int, int], saved: tuple[int, int], fsdp_dim: int, rank: int) -> int:
    """The verified-read bytes of this rank's boxes, from the hand-computed layouts of the saving and loading
    meshes (ep, fsdp): experts as expert_box says, routers torch.chunk'ed over all ranks, steps whole."""
    total = 0
    for name, value in leaves(state).items():
        shape, itemsize = tuple(value.shape), value.element_size()
        if ".experts." in name and not name.endswith(".step"):
            stored = [expert_box(shape, *saved, fsdp_dim, r) for r in range(saved[0] * saved[1])]
            box = expert_box(shape, *layout, fsdp_dim, rank)
        elif isinstance(value, DTensor):
            stored = grid_boxes(shape, {0: saved[0] * saved[1]})
            start, stop = chunk(shape[0], layout[0] * layout[1], rank)
            box = ((start, 0), (stop - start, shape[1]))
        else:
            stored, box = [((), ())], ((), ())
        total += verified_read_bytes(stored, box, itemsize, BLOCK)
    return total


def full_values(state: dict) -> dict[str, torch.Tensor]:
    return {
        name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
        for name, value in leaves(state).items()
    }


def grouped_save(args: dict, rank: int, variant: str) -> dict:
    config, (ep, fsdp) = args["grouped"], args["grouped_save"]
    model, optimizer, _ = grouped_model(0, ep, fsdp, VARIANTS[variant], **config)
    train_step(model, optimizer, config["dim"], rank)
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    placements = {name: [str(p) for p in v.placements] for name, v in leaves(state).items() if isinstance(v, DTensor)}
    shardckpt.save(state, os.path.join(args["root"], f"grouped-{variant}"), block_size=BLOCK)
    reference = full_values(state)
    if rank == 0:
        save_file(reference, os.path.join(args["root"], f"grouped-{variant}.safetensors"))
    return {"placements": placements}


def grouped_load(args: dict, rank: int, variant: str, layout: tuple[int, int]) -> dict:
    config = args["grouped"]
    ep, fsdp = layout
    model, optimizer, _ = grouped_model(1, ep, fsdp, VARIANTS[variant], **config)
    train_step(model, optimizer, config["dim"], rank)
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    stats = shardckpt.load(state, os.path.join(args["root"], f"grouped-{variant}"), max_gap=0)
    reference = load_file(os.path.join(args["root"], f"grouped-{variant}.safetensors"))
    restored = full_values(state)
    mismatched = sorted(name for name in reference if not torch.equal(reference[name], restored.get(name)))
    return {
        "mismatched": mismatched + sorted(set(reference) ^ set(restored)),
        "needed": stats.needed_bytes,
        "fetched": stats.fetched_bytes,
        "expected_fetched": grouped_expected(state, layout, tuple(args["grouped_save"]), VARIANTS[variant], rank),
        "expert_bytes": sum(
            local(v).numel() * local(v).element_size() for n, v in leaves(state).items() if ".experts." in n
        ),
    }


def scenario_save(args: dict, rank: int, world: int) -> dict:
    results: dict = {}
    part(results, "per_expert", lambda: per_expert_save(args, rank, world))
    for variant in VARIANTS:
        part(results, f"grouped_{variant}_save", lambda: grouped_save(args, rank, variant))  # noqa: B023
        for layout in args["grouped_loads_here"]:
            key = f"grouped_{variant}_load_{layout[0]}x{layout[1]}"
            part(results, key, lambda: grouped_load(args, rank, variant, tuple(layout)))  # noqa: B023
    return results


def scenario_load(args: dict, rank: int, world: int) -> dict:
    results: dict = {}
    part(results, "per_expert", lambda: per_expert_load(args, rank, world))
    for variant in VARIANTS:
        for layout in args["grouped_loads_here"]:
            key = f"grouped_{variant}_load_{layout[0]}x{layout[1]}"
            part(results, key, lambda: grouped_load(args, rank, variant, tuple(layout)))  # noqa: B023
    return results


def main() -> None:
    warnings.filterwarnings("ignore")
    serve_rank(globals(), default_timeout=120)


if __name__ == "__main__":
    main()
