"""`python -m benchmarks.scale_dcp`: PyTorch DCP's metadata figures for the MoE state of benchmarks.scale_moe.

DCP's own classes and functions (WriteItem, dedup_save_plans, create_default_global_save_plan,
_validate_global_plan, create_read_items_for_chunk_list, pickle of Metadata with FileSystemWriter's
storage_data), no process group. Tensors of one shape and placement have identical chunk lists, so each such
group is measured once at the full rank count on one tensor and scaled by the group's size ("per group"); a full
run of every tensor at a small rank count (--check-ranks) shows how close that estimate is.
"""

from __future__ import annotations

import argparse
import json
import pickle
import time
import tracemalloc
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.default_planner import _validate_global_plan, create_default_global_save_plan
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from benchmarks.scale_moe import ITEMSIZE, Group, Mesh, MoeConfig, MoeState, _shard

Chunk = tuple[int, tuple[int, ...], tuple[int, ...]]  # (rank, offsets, sizes)


def chunks(state: MoeState, mesh: Mesh, group: Group, member: int) -> list[Chunk]:
    """The write item of every rank that has tensor `member` of `group`, as DCP makes them: one per rank of the
    tensor's mesh, empty shards included; a plain (step) tensor on every rank that has it (deduplicated later)."""
    per_rank = state.config.experts // mesh.ep
    expert = int(group.expert[member])
    shape = group.shape
    out: list[Chunk] = []
    for rank in range(mesh.world):
        f, e = mesh.coordinates(rank)
        if expert >= 0 and expert // per_rank != e:
            continue
        if group.placement == "step":
            out.append((rank, (), ()))
        elif group.placement == "grouped":
            lo, hi = _shard(shape[1], mesh.fsdp, f)
            out.append((rank, (e * per_rank, lo, 0), (per_rank, hi - lo, shape[2])))
        else:
            lo, hi = _shard(shape[0], mesh.fsdp if expert >= 0 else mesh.world, f if expert >= 0 else rank)
            out.append((rank, (lo,) + (0,) * (len(shape) - 1), (hi - lo, *shape[1:])))
    return out


def save_plans(world: int, tensors: Sequence[tuple[str, tuple[int, ...], list[Chunk]]]) -> list[SavePlan]:
    """Each rank's SavePlan; every rank's strings are its own objects, as after DCP's gather of the plans."""
    items: list[list[WriteItem]] = [[] for _ in range(world)]
    for name, shape, pieces in tensors:
        size = torch.Size(shape)
        kind = WriteItemType.TENSOR if not shape else WriteItemType.SHARD
        for rank, offsets, sizes in pieces:
            fqn = "".join(list(name))
            chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
            data = TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=torch.float32), size=size)
            items[rank].append(WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=kind, tensor_data=data))
    return [SavePlan(plan) for plan in items]


def storage_data(plans: list[SavePlan], paths: list[str]) -> dict[MetadataIndex, _StorageInfo]:
    """FileSystemWriter.finish's map: every write item's index -> (its rank's file, offset, length)."""
    out: dict[MetadataIndex, _StorageInfo] = {}
    for rank, plan in enumerate(plans):
        position = 0
        for item in plan.items:
            assert item.tensor_data is not None and item.tensor_data.chunk is not None
            length = int(torch.Size(item.tensor_data.chunk.sizes).numel()) * ITEMSIZE
            index = MetadataIndex("".join(list(item.index.fqn)), item.index.offset, item.index.index)
            out[index] = _StorageInfo(paths[rank], position, length)
            position += length
    return out


def dcp_figures(
    world: int, tensors: Sequence[tuple[str, tuple[int, ...], list[Chunk]]], paths: list[str], validate: bool = True
) -> dict:
    """Build DCP's metadata for `tensors` on `world` ranks and time what DCP does with it (its overlap check
    only if `validate`: the check is quadratic for some tensors, and a second member of a group repeats it)."""
    plans = save_plans(world, tensors)
    began = time.process_time()
    deduped = dedup_save_plans(plans, False)
    global_plan, metadata = create_default_global_save_plan(deduped)
    global_seconds = time.process_time() - began
    began = time.process_time()
    errors = _validate_global_plan(global_plan, metadata) if validate else []
    validate_seconds = time.process_time() - began
    if errors:
        raise RuntimeError(f"DCP rejects the simulated plan: {errors[:3]}")
    metadata.storage_data = storage_data(global_plan, paths)
    # flatten_state_dict's map of every flattened key to its path in the nested state dict (get_state_dict's).
    metadata.planner_data = {fqn: _path(fqn) for fqn in metadata.state_dict_metadata}
    # The rank files' names and every class first (in a one-chunk metadata), so that what is counted refers to
    # them as the pickle of a whole metadata does after their first use.
    warm = Metadata(
        {
            "w": TensorStorageMetadata(
                TensorProperties(), torch.Size([1]), [ChunkStorageMetadata(*2 * (torch.Size([1]),))]
            )
        }
    )
    warm.storage_data = {MetadataIndex("w", torch.Size([0]), 0): _StorageInfo(paths[0], 0, 4)}
    baseline = len(pickle.dumps([paths, warm], protocol=pickle.DEFAULT_PROTOCOL))
    began = time.process_time()
    pickled = pickle.dumps([paths, warm, metadata], protocol=pickle.DEFAULT_PROTOCOL)
    dump_seconds = time.process_time() - began
    began = time.process_time()
    pickle.loads(pickled)
    load_seconds = time.process_time() - began
    tracemalloc.start()
    loaded = pickle.loads(pickled)
    memory = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del loaded
    return {
        "items": sum(len(plan.items) for plan in plans),
        "chunks": sum(len(md.chunks) for md in metadata.state_dict_metadata.values()),
        "metadata_bytes": len(pickled) - baseline,
        "global_plan_seconds": global_seconds,
        "validate_seconds": validate_seconds,
        "dump_seconds": dump_seconds,
        "load_seconds": load_seconds,
        "memory_bytes": memory,
        "metadata": metadata,
    }


def _path(fqn: str) -> tuple[str, ...]:
    """{"model": {name: ...}, "optim": {"state": {name: {"exp_avg": ...}}}} as DCP's flattening records it."""
    if fqn.startswith("model."):
        return ("model", fqn[len("model.") :])
    name, _, leaf = fqn[len("optim.state.") :].rpartition(".")
    return ("optim", "state", name, leaf)


def plan_seconds(metadata: Metadata, wanted: Sequence[tuple[str, tuple[int, ...], tuple[int, ...]]]) -> float:
    """One rank's load plan: DCP's resharding step (create_read_items_for_chunk_list) for each wanted box."""
    local = [(name, [ChunkStorageMetadata(torch.Size(o), torch.Size(s))]) for name, o, s in wanted]
    began = time.process_time()
    for name, chunk in local:
        md = metadata.state_dict_metadata[name]
        assert isinstance(md, TensorStorageMetadata)
        create_read_items_for_chunk_list(name, md, chunk)
    return time.process_time() - began


def wanted_by_group(state: MoeState, mesh: Mesh, rank: int) -> dict[int, list[tuple[str, tuple, tuple]]]:
    """The boxes rank `rank` of `mesh` loads, by group (the position of its group in state.groups)."""
    firsts = [group.first for group in state.groups]
    out: dict[int, list[tuple[str, tuple, tuple]]] = {}
    index = {spec.name: number for number, spec in enumerate(state.specs)}
    for name, offsets, shape in state.targets(mesh, rank):
        number = index[name]
        group = max(g for g, first in enumerate(firsts) if first <= number)
        out.setdefault(group, []).append((name, offsets, shape))
    return out


def estimate(state: MoeState, world: int, ep: int) -> dict[str, Any]:
    """DCP's figures for the whole state on `world` ranks, measured one tensor per group, scaled by group size."""
    mesh, target = Mesh(world, ep), Mesh(world * 3 // 4, max(ep // 2, 1))
    paths = [f"__{rank}_0.distcp" for rank in range(world)]
    wanted = wanted_by_group(state, target, target.world // 2)
    total: dict[str, float] = {}
    for number, group in enumerate(state.groups):
        count = int(group.expert.size)
        lengths = [len(state.specs[group.first + m].name) for m in range(count)]
        # Pickled bytes grow linearly with the name's length: the shortest and the longest name give the line.
        short, long = int(np.argmin(lengths)), int(np.argmax(lengths))
        figures = {m: dcp_figures(world, [_tensor(state, mesh, group, m)], paths, m == long) for m in {short, long}}
        spread = max(lengths[long] - lengths[short], 1)
        for key in ("metadata_bytes", "memory_bytes"):
            slope = (figures[long][key] - figures[short][key]) / spread
            total[key] = (
                total.get(key, 0) + figures[short][key] * count + slope * (sum(lengths) - lengths[short] * count)
            )
        for key in ("items", "chunks", "validate_seconds", "dump_seconds", "load_seconds"):
            total[key] = total.get(key, 0) + figures[long][key] * count
        # Building the global plan also visits every rank's plan: in a real save once for all tensors, so a group
        # whose tensors live on a few ranks (experts) is timed on a batch of its tensors at once.
        batch = min(count, 64) if figures[long]["items"] * 4 < world else 1
        if batch > 1:
            members = [_tensor(state, mesh, group, m) for m in range(batch)]
            seconds = dcp_figures(world, members, paths, validate=False)["global_plan_seconds"] / batch
        else:
            seconds = figures[long]["global_plan_seconds"]
        total["global_plan_seconds"] = total.get("global_plan_seconds", 0) + seconds * count
        mine = wanted.get(number, [])
        if mine:
            one = [(state.specs[group.first + long].name, *mine[0][1:])]
            repeats = max(1, 2000 // max(figures[long]["chunks"], 1))
            seconds = plan_seconds(figures[long]["metadata"], one * repeats) / repeats * len(mine)
            total["plan_seconds"] = total.get("plan_seconds", 0) + seconds
    return total


def _tensor(state: MoeState, mesh: Mesh, group: Group, member: int) -> tuple[str, tuple[int, ...], list[Chunk]]:
    return state.specs[group.first + member].name, group.shape, chunks(state, mesh, group, member)


def measure_full(state: MoeState, world: int, ep: int) -> dict[str, Any]:
    """DCP's figures for every tensor of the state on `world` ranks (small world sizes: it all lives in memory)."""
    mesh, target = Mesh(world, ep), Mesh(world * 3 // 4, max(ep // 2, 1))
    tensors = []
    for group in state.groups:
        tensors += [_tensor(state, mesh, group, member) for member in range(group.expert.size)]
    figures = dcp_figures(world, tensors, [f"__{rank}_0.distcp" for rank in range(world)])
    figures["plan_seconds"] = plan_seconds(figures.pop("metadata"), state.targets(target, target.world // 2))
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--layout", nargs="+", choices=("experts", "grouped"), default=["experts", "grouped"])
    parser.add_argument("--ep", type=int, default=64)
    parser.add_argument("--check-ranks", type=int, default=16, help="also run every tensor at this size (0: no)")
    parser.add_argument("--check-ep", type=int, default=8)
    parser.add_argument("--layers", type=int, default=MoeConfig.layers)
    parser.add_argument("--dense-layers", type=int, default=MoeConfig.dense_layers, help="of them, dense FFN")
    parser.add_argument("--experts", type=int, default=MoeConfig.experts)
    parser.add_argument("--json", default="benchmarks/scale_dcp.json")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*torch.distributed.*")
    dense_layers = min(args.dense_layers, args.layers)
    config = MoeConfig(layers=args.layers, dense_layers=dense_layers, experts=args.experts)
    rows = []
    print(f"{'layout':8} {'ranks':>6} {'how':9} {'chunks':>10} {'.metadata':>10} {'validate':>10} {'plan':>8}")
    for layout in args.layout:
        state = MoeState(config, layout)
        runs = [(args.check_ranks, args.check_ep, "full"), (args.check_ranks, args.check_ep, "per group")]
        runs = (runs if args.check_ranks else []) + [(world, args.ep, "per group") for world in args.ranks]
        for world, ep, how in runs:
            figures = measure_full(state, world, ep) if how == "full" else estimate(state, world, ep)
            figures.pop("metadata", None)
            row = {"layout": layout, "ranks": world, "ep": ep, "how": how, **figures}
            rows.append(row)
            validation = row["global_plan_seconds"] + row["validate_seconds"]
            print(
                f"{layout:8} {world:6d} {how:9} {row['chunks']:10.0f} {row['metadata_bytes'] / 2**20:8.1f}Mi "
                f"{validation:9.1f}s {row['plan_seconds']:7.2f}s",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"moe": vars(config), "torch": torch.__version__, "rows": rows}, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
