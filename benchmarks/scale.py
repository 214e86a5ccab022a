"""`python -m benchmarks.scale`: manifest size and metadata work for a 92B-parameter model on thousands of ranks.

Simulated (no tensor data): the local manifests every rank would send, then the coordinator's decode + merge +
exact-cover validation, the global manifest, and one target rank's read plan for a W -> 3W/4 resharded load.
The model is the one FIELD-NOTES uses for PyTorch DCP's figures, so the rows compare.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import tracemalloc

import numpy as np

from shardckpt import knobs
from shardckpt.format.local_manifest import (
    LocalManifest,
    LocalPieces,
    TensorSpec,
    decode_local_manifest,
    encode_local_manifest,
)
from shardckpt.format.manifest import FileEntry, GlobalManifest, decode_global_manifest, encode_global_manifest
from shardckpt.planner import Box, Target, plan_reads
from shardckpt.write.merge import merge_tensors

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


def measure(world: int) -> dict[str, float]:
    specs = tensor_specs()
    began = time.perf_counter()
    raws = [local_manifest(specs, rank, world) for rank in range(world)]
    prepare = time.perf_counter() - began
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
    manifest = GlobalManifest("scale", world, BLOCK, files, tensors)
    began = time.process_time()
    encoded = encode_global_manifest(manifest)
    encode = time.process_time() - began
    began = time.process_time()
    decoded = decode_global_manifest(encoded)
    for entry in decoded.tensors:
        entry.pieces.arrays()
    decode_global = time.process_time() - began
    target_world = world * 3 // 4
    rank = target_world // 2
    targets = []
    for entry in decoded.tensors:
        if not entry.shape:
            targets.append(Target(entry.name, Box((), ())))
            continue
        chunk = math.ceil(entry.shape[0] / target_world)
        lo = min(rank * chunk, entry.shape[0])
        hi = min(lo + chunk, entry.shape[0])
        targets.append(Target(entry.name, Box((lo,) + (0,) * (len(entry.shape) - 1), (hi - lo, *entry.shape[1:]))))
    index = decoded.tensor_index()
    began = time.process_time()
    plan = plan_reads(index, targets, block_size=BLOCK, max_gap=knobs.MAX_GAP, max_request=knobs.MAX_REQUEST)
    plan_seconds = time.process_time() - began
    tracemalloc.start()
    plan_reads(index, targets, block_size=BLOCK, max_gap=knobs.MAX_GAP, max_request=knobs.MAX_REQUEST)
    plan_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {
        "ranks": world,
        "pieces": sum(entry.pieces.count for entry in tensors),
        "local_manifest_bytes_each": len(raws[0]),
        "global_manifest_bytes": len(encoded),
        "encode_seconds": encode,
        "decode_seconds": decode_global,
        "validation_seconds": decode + merge,
        "validation_decode_seconds": decode,
        "validation_merge_seconds": merge,
        "plan_seconds": plan_seconds,
        "plan_peak_bytes": plan_peak,
        "plan_requests": len(plan.requests),
        "plan_fetch_ratio": plan.fetch_bytes / max(plan.needed_bytes, 1),
        "prepare_seconds": prepare,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--json", default="benchmarks/scale.json")
    args = parser.parse_args(argv)
    rows = []
    print(
        f"{'ranks':>6} {'pieces':>10} {'manifest':>10} {'encode':>7} {'decode':>7} {'validate':>9} "
        f"{'plan W->3W/4':>12} {'plan peak':>10}"
    )
    for world in args.ranks:
        row = measure(world)
        rows.append(row)
        print(
            f"{world:6d} {row['pieces']:10d} {row['global_manifest_bytes'] / 2**20:8.2f}Mi "
            f"{row['encode_seconds']:6.2f}s {row['decode_seconds']:6.2f}s {row['validation_seconds']:8.2f}s "
            f"{row['plan_seconds']:11.2f}s {row['plan_peak_bytes'] / 2**20:8.1f}Mi",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"model": "92B dense, 2,892 tensors with AdamW state", "rows": rows}, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
