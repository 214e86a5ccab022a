"""`python -m benchmarks.scale`: manifest size and metadata work for a 92B-parameter model on thousands of ranks.

Simulated (no tensor data): the local manifests every rank would send, then the coordinator's decode + merge +
exact-cover validation, the global manifest, and one target rank's read plan for a W -> 3W/4 resharded load.
The model is the one FIELD-NOTES uses for PyTorch DCP's figures, so the rows compare. With format 1.2's piece
index (SPEC 11.1): its encode at commit, and what one loading rank (and one rank of an incremental save opening
its parent) reads and decodes: the head and the blocks of its own tensors.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.scale_moe import Mesh, MoeConfig, MoeState
from shardckpt import knobs
from shardckpt.format.local_manifest import (
    LocalManifest,
    LocalPieces,
    TensorSpec,
    decode_local_manifest,
    encode_local_manifest,
)
from shardckpt.format.manifest import (
    FileEntry,
    GlobalManifest,
    decode_global_manifest,
    decode_index_blocks,
    encode_global_manifest,
    manifest_head_size,
)
from shardckpt.format.piece_index import FIRST_VERSION as INDEX_VERSION
from shardckpt.planner import Box, Target, plan_reads
from shardckpt.write.merge import merge_tensors
from shardckpt.write.parent import holder_ranks

BLOCK = 64 << 10


def model_shapes() -> dict[str, tuple[int, ...]]:
    """723 parameters, 91.5B elements: hidden 10240, 80 layers, vocab 128256, 8 KV heads of 128, FFN 28672."""
    hidden, ffn, kv, vocab = 10240, 28672, 1024, 128256
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (vocab, hidden)}
    for layer in range(80):
        prefix = f"layers.{layer}"
        shapes.update(
            {
                f"{prefix}.attn.wq.weight": (hidden, hidden),
                f"{prefix}.attn.wk.weight": (kv, hidden),
                f"{prefix}.attn.wv.weight": (kv, hidden),
                f"{prefix}.attn.wo.weight": (hidden, hidden),
                f"{prefix}.ffn.w1.weight": (ffn, hidden),
                f"{prefix}.ffn.w2.weight": (hidden, ffn),
                f"{prefix}.ffn.w3.weight": (ffn, hidden),
                f"{prefix}.attn_norm.weight": (hidden,),
                f"{prefix}.ffn_norm.weight": (hidden,),
            }
        )
    shapes.update({"norm.weight": (hidden,), "output.weight": (vocab, hidden)})
    return shapes


def tensor_specs() -> tuple[TensorSpec, ...]:
    specs = []
    for name, shape in model_shapes().items():
        specs.append(TensorSpec(f"model.{name}", "F32", shape, "box"))
        specs.append(TensorSpec(f"optim.state.{name}.exp_avg", "F32", shape, "box"))
        specs.append(TensorSpec(f"optim.state.{name}.exp_avg_sq", "F32", shape, "box"))
        specs.append(TensorSpec(f"optim.state.{name}.step", "F32", (), "box"))
    return tuple(specs)


def local_manifest(specs: tuple[TensorSpec, ...], rank: int, world: int) -> bytes:
    """What FSDP2 Shard(0) gives rank `rank`: ceil(N/W) rows per rank, empty trailing shards; steps on rank 0."""
    tensor, offset, start, length = [], [], [], []
    position = 4096
    for index, spec in enumerate(specs):
        if not spec.shape:
            if rank == index % world:  # replicated 0-d step tensors spread over ranks
                tensor.append(index)
                offset.append(position)
                position += 4
            continue
        rows = spec.shape[0]
        chunk = math.ceil(rows / world)
        lo = min(rank * chunk, rows)
        hi = min(lo + chunk, rows)
        if hi == lo:
            continue
        tensor.append(index)
        offset.append(position)
        start += [lo] + [0] * (len(spec.shape) - 1)
        length += [hi - lo, *spec.shape[1:]]
        position += (hi - lo) * math.prod(spec.shape[1:]) * 4
    pieces = LocalPieces(
        specs, np.array(tensor), np.array(offset), np.array(start, dtype=np.int64), np.array(length, dtype=np.int64)
    )
    crcs = np.zeros(int((-(-pieces.nbytes // BLOCK)).sum()), dtype=np.uint32)
    manifest = LocalManifest(
        "scale", rank, world, f"data/{rank:05d}-scale.safetensors", position, 4096, 0, BLOCK, specs, pieces, crcs
    )
    return encode_local_manifest(manifest)


MODELS = ("dense", "moe-experts", "moe-grouped")
DESCRIPTION = {
    "dense": "92B dense, 2,892 tensors with AdamW state, FSDP2 Shard(0)",
    "moe-experts": "DeepSeek-V3 671B, per-expert tensors (HF names), EP x FSDP",
    "moe-grouped": "DeepSeek-V3 671B, grouped experts [experts, d_in, d_out] (torchtitan), EP x FSDP",
}


def moe_state(model: str, config: MoeConfig) -> MoeState:
    return MoeState(config, "experts" if model == "moe-experts" else "grouped")


def local_manifests(model: str, world: int, ep: int, config: MoeConfig) -> Iterator[bytes]:
    """Every rank's encoded local manifest, in rank order."""
    if model == "dense":
        specs = tensor_specs()
        yield from (local_manifest(specs, rank, world) for rank in range(world))
        return
    state, mesh, tables = moe_state(model, config), Mesh(world, ep), {}
    yield from (state.local_manifest(mesh, rank, tables) for rank in range(world))


def load_targets(
    model: str, world: int, ep: int, config: MoeConfig, manifest: GlobalManifest | None = None
) -> list[Target]:
    """What one rank of a job on 3W/4 ranks loads: FSDP Shard(0) over 3W/4 ranks; experts on EP/2 x 3W/(2 EP)."""
    target_world = world * 3 // 4
    rank = target_world // 2
    if model != "dense":
        state = moe_state(model, config)
        mesh = Mesh(target_world, max(ep // 2, 1))
        return [Target(name, Box(offsets, shape)) for name, offsets, shape in state.targets(mesh, rank)]
    targets = []
    for entry in tensor_specs():  # the manifest's tensors (a 1.2 rank knows them from its own state dict)
        if not entry.shape:
            targets.append(Target(entry.name, Box((), ())))
            continue
        chunk = math.ceil(entry.shape[0] / target_world)
        lo = min(rank * chunk, entry.shape[0])
        hi = min(lo + chunk, entry.shape[0])
        targets.append(Target(entry.name, Box((lo,) + (0,) * (len(entry.shape) - 1), (hi - lo, *entry.shape[1:]))))
    return targets


def saving_names(model: str, world: int, ep: int, config: MoeConfig) -> list[str]:
    """The tensors one rank of an incremental save on the saving mesh holds, whose parent entries it opens."""
    if model == "dense":
        return [spec.name for spec in tensor_specs()]
    state = moe_state(model, config)
    declared, _, _, _ = state.boxes(Mesh(world, ep), world // 2)
    return [state.specs[i].name for i in declared.tolist()]


def saving_boxes(model: str, world: int, ep: int, config: MoeConfig) -> dict[str, set[tuple[tuple[int, ...], ...]]]:
    """The (start, length) of each piece that rank of saving_names writes (its parent pieces of the same mesh)."""
    if model == "dense":
        boxes: dict[str, set[tuple[tuple[int, ...], ...]]] = {}
        rank = world // 2
        for index, spec in enumerate(tensor_specs()):
            if not spec.shape:
                if rank == index % world:
                    boxes[spec.name] = {((), ())}
                continue
            chunk = math.ceil(spec.shape[0] / world)
            lo = min(rank * chunk, spec.shape[0])
            hi = min(lo + chunk, spec.shape[0])
            if hi > lo:
                boxes[spec.name] = {((lo,) + (0,) * (len(spec.shape) - 1), (hi - lo, *spec.shape[1:]))}
        return boxes
    state = moe_state(model, config)
    _, owners, starts, lengths = state.boxes(Mesh(world, ep), world // 2)
    boxes = {}
    ids = owners.tolist()
    rows = [row for start, length in zip(starts, lengths) for row in zip(start.tolist(), length.tolist())]
    for tensor, (start, length) in zip(ids, rows):
        boxes.setdefault(state.specs[tensor].name, set()).add((tuple(start), tuple(length)))
    return boxes


def write_indexed(scratch: Path, manifest: GlobalManifest) -> dict[str, Any]:
    """The commit's encode of the manifest with a piece index, written beside the plain one."""
    indexed = dataclasses.replace(manifest, version=INDEX_VERSION, index_block=max(1, knobs.PIECE_INDEX_BLOCK))
    began = time.process_time()
    encoded = encode_global_manifest(indexed)
    seconds = time.process_time() - began
    head = manifest_head_size(encoded)
    (scratch / "indexed.msgpack").write_bytes(encoded)
    (scratch / "indexed.json").write_text(json.dumps({"head": head}))
    assert indexed.piece_index is None  # the encoder built the fence; the manifest object keeps none
    return {
        "index_manifest_bytes": len(encoded),
        "index_head_bytes": head,
        "index_encode_seconds": seconds,
    }


def validate_phase(scratch: Path) -> dict[str, float]:
    """The coordinator's commit work on the gathered local manifests: decode, merge + cover, encode."""
    data = (scratch / "locals.bin").read_bytes()
    bounds = np.load(scratch / "locals.npy").tolist()
    raws = [data[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]
    del data
    began = time.process_time()
    locals_ = [decode_local_manifest(raw, f"rank {rank}") for rank, raw in enumerate(raws)]
    decode = time.process_time() - began
    began = time.process_time()
    tensors = merge_tensors(locals_)
    merge = time.process_time() - began
    files = tuple(
        FileEntry(m.rank, m.data, m.data_size, f"ranks/{m.rank:05d}-scale.msgpack", len(raw), 0)
        for m, raw in zip(locals_, raws)
    )
    manifest = GlobalManifest("scale", len(raws), BLOCK, files, tensors)
    began = time.process_time()
    encoded = encode_global_manifest(manifest)
    encode = time.process_time() - began
    (scratch / "global.msgpack").write_bytes(encoded)
    indexed = write_indexed(scratch, manifest)
    return {
        **indexed,
        "pieces": sum(entry.pieces.count for entry in tensors),
        "tensors": len(tensors),
        "local_manifest_bytes_each": len(raws[0]),
        "local_manifest_bytes_total": len(bounds) and bounds[-1],
        "global_manifest_bytes": len(encoded),
        "validation_seconds": decode + merge,
        "validation_decode_seconds": decode,
        "validation_merge_seconds": merge,
        "encode_seconds": encode,
        "validation_peak_rss": peak_rss(),
    }


def direct_phase(scratch: Path, model: str, world: int, ep: int, config: MoeConfig) -> dict[str, Any]:
    """The global manifest from local manifests made in memory (no local-manifest codec, tables shared between
    ranks): for a job whose validation does not fit in this machine's memory, its manifest and plan rows."""
    state, mesh, tables = moe_state(model, config), Mesh(world, ep), {}
    locals_ = [state.local(mesh, rank, tables) for rank in range(world)]
    tensors = merge_tensors(locals_)
    files = tuple(FileEntry(m.rank, m.data, m.data_size, f"ranks/{m.rank:05d}-scale.msgpack", 1, 0) for m in locals_)
    manifest = GlobalManifest("scale", world, BLOCK, files, tensors)
    encoded = encode_global_manifest(manifest)
    (scratch / "global.msgpack").write_bytes(encoded)
    pieces = sum(entry.pieces.count for entry in tensors)
    indexed = write_indexed(scratch, manifest)
    return {"pieces": pieces, "tensors": len(tensors), "global_manifest_bytes": len(encoded), "direct": True, **indexed}


def plan_phase(scratch: Path, model: str, world: int, ep: int, config: MoeConfig) -> dict[str, float]:
    """One rank of the resharded job: decode the global manifest, plan its reads."""
    encoded = (scratch / "global.msgpack").read_bytes()
    began = time.process_time()
    decoded = decode_global_manifest(encoded)
    for entry in decoded.tensors:
        entry.pieces.arrays()
    decode = time.process_time() - began
    targets = load_targets(model, world, ep, config, decoded)
    index = decoded.tensor_index()
    began = time.process_time()
    plan = plan_reads(index, targets, block_size=BLOCK, max_gap=knobs.MAX_GAP, max_request=knobs.MAX_REQUEST)
    plan_seconds = time.process_time() - began
    return {
        "decode_seconds": decode,
        "plan_seconds": plan_seconds,
        "plan_targets": len(targets),
        "plan_requests": len(plan.requests),
        "plan_fetch_ratio": plan.fetch_bytes / max(plan.needed_bytes, 1),
        "plan_peak_rss": peak_rss(),
    }


def index_phase(scratch: Path, model: str, world: int, ep: int, config: MoeConfig, parent: bool) -> dict[str, Any]:
    """One rank reading a manifest with a piece index as a load does (the resharded load's target rank) or as an
    incremental save opening its parent does (`parent`: a rank of the saving mesh): the head (its size from
    COMMITTED), then one range read per run of the blocks of its tensors; decode; for a load, plan."""
    head_size = json.loads((scratch / "indexed.json").read_text())["head"]
    targets = [] if parent else load_targets(model, world, ep, config, None)
    names = saving_names(model, world, ep, config) if parent else [target.name for target in targets]
    boxes = saving_boxes(model, world, ep, config) if parent else {}
    reset_peak_rss()
    before = current_rss()
    began = time.process_time()
    with open(scratch / "indexed.msgpack", "rb") as handle:
        head = handle.read(head_size)
        manifest = decode_global_manifest(head, head_only=True)
        assert manifest.piece_index is not None
        index = manifest.piece_index
        blocks: dict[int, bytes] = {}
        offsets = index.offsets()
        runs = index.runs(index.blocks_for(names))
        for begin, end, at, size in runs:
            handle.seek(head_size + at)
            run = handle.read(size)
            for number in range(begin, end):
                blocks[number] = run[offsets[number] - at : offsets[number] - at + index.size[number]]
    manifest = decode_index_blocks(manifest, blocks, "indexed")
    holders = 0
    if parent:  # open_parent then finds the pieces of the rank's own boxes, and whose local manifests hold them
        holders = len(holder_ranks(manifest, set(names), boxes))
    # A load's plan decodes the piece columns of its own tensors when it first uses them: counted in the plan, as a
    # block's other entries stay undecoded.
    decode = time.process_time() - began
    plan_seconds, requests = 0.0, 0
    if not parent:
        began = time.process_time()
        plan = plan_reads(
            manifest.tensor_index(), targets, block_size=BLOCK, max_gap=knobs.MAX_GAP, max_request=knobs.MAX_REQUEST
        )
        plan_seconds, requests = time.process_time() - began, len(plan.requests)
    prefix = "parent" if parent else "index"
    return {
        f"{prefix}_bytes_read": head_size + sum(size for _, _, _, size in runs),
        f"{prefix}_reads": 1 + len(runs),
        f"{prefix}_blocks_read": len(blocks),
        f"{prefix}_blocks": index.blocks,
        f"{prefix}_tensors_decoded": len(manifest.tensors),
        f"{prefix}_decode_seconds": decode,
        f"{prefix}_plan_seconds": plan_seconds,
        f"{prefix}_plan_requests": requests,
        f"{prefix}_rss_delta": peak_rss() - before,
        **({"parent_local_manifests": holders} if parent else {}),
    }


def reset_peak_rss() -> None:
    """Make VmHWM this process's resident memory now (Linux: 5 to /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def current_rss() -> int:
    """This process's resident memory now (VmRSS), bytes."""
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) * 1024 for line in handle if line.startswith("VmRSS:"))


def peak_rss() -> int:
    """This process's peak resident memory (VmHWM), bytes."""
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) * 1024 for line in handle if line.startswith("VmHWM:"))


def measure(model: str, world: int, ep: int, config: MoeConfig, scratch: Path, direct: bool) -> dict[str, Any]:
    """One row: local manifests written to `scratch`, then validation and one rank's plan, each in a fresh
    process so that its peak RSS is its own. `direct`: no validation row (see direct_phase)."""
    row: dict[str, Any] = {"model": model, "ranks": world, "ep": ep if model != "dense" else None}
    common = ["--model", model, "--ranks", str(world), "--ep", str(ep), "--scratch", str(scratch)]
    common += ["--layers", str(config.layers), "--dense-layers", str(config.dense_layers)]
    common += ["--experts", str(config.experts)]
    if direct:
        row.update(_child([*common, "--phase", "direct"]))
    else:
        began = time.perf_counter()
        bounds = [0]
        with open(scratch / "locals.bin", "wb") as handle:
            for raw in local_manifests(model, world, ep, config):
                handle.write(raw)
                bounds.append(bounds[-1] + len(raw))
        np.save(scratch / "locals.npy", np.array(bounds, dtype=np.int64))
        row["prepare_seconds"] = time.perf_counter() - began
        row.update(_child([*common, "--phase", "validate"]))
    row.update(_child([*common, "--phase", "plan"]))
    row.update(_child([*common, "--phase", "index"]))
    for name in ("locals.bin", "locals.npy", "global.msgpack", "indexed.msgpack", "indexed.json"):
        (scratch / name).unlink(missing_ok=True)
    return row


def _child(argv: list[str]) -> dict[str, Any]:
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.scale", *argv], cwd=root, env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"benchmarks.scale {' '.join(argv)} failed (exit {done.returncode}):\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--model", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--ep", type=int, default=64, help="expert-parallel degree of the saving job (MoE)")
    parser.add_argument("--layers", type=int, default=MoeConfig.layers, help="MoE layers (smaller: a smoke run)")
    parser.add_argument("--dense-layers", type=int, default=MoeConfig.dense_layers, help="of them, dense FFN")
    parser.add_argument("--experts", type=int, default=MoeConfig.experts, help="routed experts (smaller: smoke)")
    parser.add_argument("--json", default="benchmarks/scale.json")
    parser.add_argument("--scratch", default=None, help="folder for the simulated manifests (default: a temp dir)")
    parser.add_argument(
        "--direct-from",
        type=int,
        default=0,
        help="per-expert rows on this many ranks or more skip the local-manifest codec and validation (for "
        "machines with less than ~10 GiB free: validation at 4,096 ranks peaks at 8.7 GiB); 0: none",
    )
    parser.add_argument("--phase", choices=("validate", "plan", "direct", "index", "parent"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    config = MoeConfig(layers=args.layers, dense_layers=min(args.dense_layers, args.layers), experts=args.experts)
    if args.phase:
        scratch = Path(args.scratch)
        if args.phase == "validate":
            result = validate_phase(scratch)
        elif args.phase == "direct":
            result = direct_phase(scratch, args.model[0], args.ranks[0], args.ep, config)
        elif args.phase == "index":  # one process for both: its peak is reset in between
            result = index_phase(scratch, args.model[0], args.ranks[0], args.ep, config, False)
            result.update(index_phase(scratch, args.model[0], args.ranks[0], args.ep, config, True))
        elif args.phase == "parent":
            result = index_phase(scratch, args.model[0], args.ranks[0], args.ep, config, True)
        else:
            result = plan_phase(scratch, args.model[0], args.ranks[0], args.ep, config)
        print(json.dumps(result))
        return 0
    rows = []
    print(
        f"{'model':12} {'ranks':>6} {'pieces':>10} {'manifest':>10} {'validate':>9} {'peak':>8} "
        f"{'decode':>7} {'plan W->3W/4':>12} {'peak':>8}"
    )
    with tempfile.TemporaryDirectory(dir=args.scratch) as scratch:
        for model in args.model:
            for world in args.ranks:
                direct = model == "moe-experts" and 0 < args.direct_from <= world
                row = measure(model, world, args.ep, config, Path(scratch), direct)
                rows.append(row)
                validation = (
                    f"{row['validation_seconds']:8.2f}s {row['validation_peak_rss'] / 2**30:6.2f}Gi"
                    if "validation_seconds" in row
                    else f"{'-':>9} {'-':>8}"
                )
                print(
                    f"{model:12} {world:6d} {row['pieces']:10d} {row['global_manifest_bytes'] / 2**20:8.2f}Mi "
                    f"{validation} {row['decode_seconds']:6.2f}s {row['plan_seconds']:11.2f}s "
                    f"{row['plan_peak_rss'] / 2**30:6.2f}Gi",
                    flush=True,
                )
                print(
                    f"{'':12} piece index: manifest {row['index_manifest_bytes'] / 2**20:.2f}Mi (head "
                    f"{row['index_head_bytes'] / 2**20:.2f}Mi, encode {row['index_encode_seconds']:.2f}s); one loading "
                    f"rank reads {row['index_bytes_read'] / 2**20:.2f}Mi in {row['index_reads']} reads "
                    f"({row['index_blocks_read']} of {row['index_blocks']} blocks), decode "
                    f"{row['index_decode_seconds']:.2f}s + plan {row['index_plan_seconds']:.2f}s, RSS "
                    f"+{row['index_rss_delta'] / 2**20:.0f}Mi; a parent open reads "
                    f"{row['parent_bytes_read'] / 2**20:.2f}Mi and {row['parent_local_manifests']} local manifest(s), "
                    f"decode {row['parent_decode_seconds']:.2f}s, RSS "
                    f"+{row['parent_rss_delta'] / 2**20:.0f}Mi",
                    flush=True,
                )
    if args.json:
        report = {"models": {model: DESCRIPTION[model] for model in args.model}, "moe": vars(config), "rows": rows}
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
