"""`python -m examples.demo_simulated`: save a sharded state as 4 simulated ranks, commit, restore as 3, inspect.

Shows the whole protocol in one process: per-rank data files, exact-cover commit, elastic resharded reads.
"""

from __future__ import annotations

import argparse
import math
import shutil
import tempfile
import time

import torch

import shardckpt
from shardckpt.cli import main as cli_main
from shardckpt.cli.common import human_bytes
from shardckpt.format.layout import new_attempt


def chunk_bounds(length: int, world: int, rank: int) -> tuple[int, int]:
    """torch.chunk / FSDP2 rule: ceil(length / world) per rank, trailing ranks get fewer or none."""
    size = math.ceil(length / world) if length else 0
    start = min(rank * size, length)
    return start, min(start + size, length)


def build_state(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = {
        "embed.weight": (4003, 256),  # dim 0 not divisible by 4 or 3: uneven shards
        "layers.0.attn.qkv.weight": (768, 256),
        "layers.0.attn.out.weight": (256, 256),
        "layers.0.mlp.up.weight": (1024, 256),
        "layers.0.mlp.down.weight": (256, 1024),
        "norm.weight": (256,),
        "head.bias": (3,),  # fewer rows than ranks: empty shards
    }
    state: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        state[f"model.{name}"] = torch.randn(shape, generator=generator)
        state[f"optim.{name}.exp_avg"] = torch.randn(shape, generator=generator) * 1e-3
        state[f"optim.{name}.exp_avg_sq"] = torch.rand(shape, generator=generator) * 1e-6
    state["optim.step"] = torch.tensor(1234.0)
    return state


def save_as_ranks(state: dict[str, torch.Tensor], url: str, world: int, step: int) -> float:
    """Every simulated rank writes its Shard(0) slice (its flat ZeRO range for the MLP), then rank 0 commits."""
    attempt = new_attempt()
    began = time.perf_counter()
    for rank in range(world):
        writer = shardckpt.ShardWriter(url, rank=rank, world_size=world, attempt=attempt, step=step)
        for name, tensor in state.items():
            if tensor.dim() == 0:
                if rank == 0:
                    writer.add(name, tensor)
                continue
            if ".mlp." in name:  # ZeRO-style flat partition that cuts rows at arbitrary element offsets
                lo, hi = chunk_bounds(tensor.numel(), world, rank)
                writer.add(name, tensor.reshape(-1)[lo:hi], global_shape=tensor.shape, flat_offset=lo)
                continue
            lo, hi = chunk_bounds(tensor.shape[0], world, rank)
            writer.add(name, tensor[lo:hi], global_shape=tensor.shape, offsets=(lo,) + (0,) * (tensor.dim() - 1))
        writer.add_object("rng", {"seed": 1000 + rank}, per_rank=True)
        if rank == 0:
            writer.add_object("trainer", {"step": step, "lr": 3e-4, "data_position": 4096})
        writer.close()
    shardckpt.commit(url, world_size=world, attempt=attempt)
    return time.perf_counter() - began


def restore_as_ranks(state: dict[str, torch.Tensor], url: str, world: int) -> None:
    checkpoint = shardckpt.open(url)
    for rank in range(world):
        items = []
        for name, tensor in state.items():
            if tensor.dim() == 0:
                items.append((name, shardckpt.Box((), ()), torch.empty(())))
                continue
            lo, hi = chunk_bounds(tensor.shape[0], world, rank)
            box = shardckpt.Box((lo,) + (0,) * (tensor.dim() - 1), (hi - lo, *tensor.shape[1:]))
            items.append((name, box, torch.empty(box.shape, dtype=tensor.dtype)))
        stats = checkpoint.read_into(items)
        for name, box, restored in items:
            expected = state[name][tuple(slice(o, o + s) for o, s in zip(box.offsets, box.shape))]
            if not torch.equal(restored, expected):
                raise SystemExit(f"demo: rank {rank} restored {name} incorrectly")
        print(
            f"  rank {rank}/{world}: needs {human_bytes(stats.needed_bytes)}, read {human_bytes(stats.fetched_bytes)} "
            f"in {stats.requests} requests ({stats.fetched_bytes / max(stats.needed_bytes, 1):.3f}x), bit-exact"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", help="where to write the checkpoint (default: a temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    args = parser.parse_args(argv)
    root = args.dir or tempfile.mkdtemp(prefix="shardckpt-demo-")
    url = f"{root}/step-00000100"
    state = build_state()
    total = sum(t.numel() * t.element_size() for t in state.values())
    print(f"demo: {len(state)} tensors, {human_bytes(total)}; saving as 4 ranks to {url}")
    seconds = save_as_ranks(state, url, world=4, step=100)
    print(f"  saved and committed in {seconds:.3f} s")
    print("demo: restoring on 3 ranks (resharded: every rank reads only the byte ranges its slices need)")
    restore_as_ranks(state, url, world=3)
    print(f"demo: latest checkpoint under {root}: {shardckpt.latest(root)}")
    print("demo: shardckpt inspect")
    code = cli_main(["inspect", url])
    print("demo: shardckpt verify")
    code = code or cli_main(["verify", url])
    if not args.keep and not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
