"""Small mixture-of-experts models for the MoE tests and benchmark: one tensor per expert matrix (Hugging Face's
layout) under FSDP2, and grouped [experts, ...] tensors (torchtitan's) under expert parallelism x FSDP2.

Also the reference arithmetic the tests check a load against: torch.chunk's split and the bytes a verified read
must fetch (every checksum block that holds a needed byte), computed by hand rather than by the library.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape)


class Expert(nn.Module):
    """One SwiGLU expert with its three matrices as separate tensors (gate_proj, up_proj: [ffn, dim])."""

    def __init__(self, dim: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, ffn, bias=False)
        self.up_proj = nn.Linear(dim, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, dim, bias=False)


class PerExpertLayer(nn.Module):
    """A router and `experts` experts; every expert sees every token (dense routing) so each gets a gradient."""

    def __init__(self, dim: int, ffn: int, experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim, ffn) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Stacked into one batched product: thousands of tiny matmuls would dominate the test's time.
        w1 = torch.stack([e.gate_proj.weight for e in self.experts])
        w3 = torch.stack([e.up_proj.weight for e in self.experts])
        w2 = torch.stack([e.down_proj.weight for e in self.experts])
        hidden = F.silu(torch.einsum("td,efd->etf", x, w1)) * torch.einsum("td,efd->etf", x, w3)
        out = torch.einsum("etf,edf->etd", hidden, w2)
        return x + torch.einsum("te,etd->td", self.gate(x).softmax(-1), out)


class PerExpertMoE(nn.Module):
    def __init__(self, layers: int, dim: int, ffn: int, experts: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(PerExpertLayer(dim, ffn, experts) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def per_expert_model(
    seed: int, world: int, *, layers: int, dim: int, ffn: int, experts: int
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The per-expert MoE fully_shard'ed layer by layer over all `world` ranks (FSDP2, Shard(0)), with AdamW."""
    torch.manual_seed(seed)
    model = PerExpertMoE(layers, dim, ffn, experts)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


class GroupedExperts(nn.Module):
    """torchtitan's GroupedExperts: w1, w3 [experts, ffn, dim] and w2 [experts, dim, ffn]; under expert
    parallelism each rank holds and runs its own experts (the token all-to-all is left out: it stores nothing)."""

    def __init__(self, experts: int, dim: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, ffn, dim) * 0.1)
        self.w2 = nn.Parameter(torch.randn(experts, dim, ffn) * 0.1)
        self.w3 = nn.Parameter(torch.randn(experts, ffn, dim) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        hidden = F.silu(torch.einsum("td,efd->etf", x, w1)) * torch.einsum("td,efd->etf", x, w3)
        return torch.einsum("etf,edf->etd", hidden, w2).sum(0)


class GroupedLayer(nn.Module):
    def __init__(self, dim: int, ffn: int, experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = GroupedExperts(experts, dim, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.experts(x) * torch.sigmoid(self.gate(x)).mean(-1, keepdim=True)


class GroupedMoE(nn.Module):
    def __init__(self, layers: int, dim: int, ffn: int, experts: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(GroupedLayer(dim, ffn, experts) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def grouped_model(
    seed: int, ep: int, fsdp: int, fsdp_dim: int, *, layers: int, dim: int, ffn: int, experts: int
) -> tuple[nn.Module, torch.optim.Optimizer, DeviceMesh]:
    """The grouped MoE as torchtitan shards it: experts Shard(0) over the EP mesh dimension, then fully_shard over
    the FSDP dimension on tensor dim `fsdp_dim` (1: Shard(1); 0: FSDP2 makes it _StridedShard(0)); the routers
    fully_shard'ed over all ranks. Returns the model, AdamW and the 2-D (fsdp, ep) mesh."""
    torch.manual_seed(seed)
    model = GroupedMoE(layers, dim, ffn, experts)
    mesh = init_device_mesh("cpu", (fsdp, ep), mesh_dim_names=("fsdp", "ep"))
    world_mesh = init_device_mesh("cpu", (fsdp * ep,))
    for layer in model.layers:
        grouped = layer.experts
        for name in ("w1", "w2", "w3"):
            full = getattr(grouped, name).detach()
            setattr(grouped, name, nn.Parameter(distribute_tensor(full, mesh["ep"], [Shard(0)], src_data_rank=None)))
        fully_shard(grouped, mesh=mesh["fsdp"], shard_placement_fn=lambda _param: Shard(fsdp_dim))
        fully_shard(layer, mesh=world_mesh)
    fully_shard(model, mesh=world_mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01), mesh


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, dim: int, rank: int) -> None:
    """One AdamW step on rank-specific tokens: every parameter gets exp_avg, exp_avg_sq and step."""
    generator = torch.Generator().manual_seed(100 + rank)
    model(torch.randn(4, dim, generator=generator)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def chunk(length: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part `index` when torch.chunk splits `length` into `parts` (the last ones may be short)."""
    size = -(-length // parts)
    start = min(index * size, length)
    return start, min(start + size, length)


def grid_boxes(shape: Sequence[int], splits: dict[int, int]) -> list[Box]:
    """Every box of `shape` split by torch.chunk on each dim `d` into `splits[d]` parts (empty boxes left out)."""
    ranges = [[chunk(n, splits.get(d, 1), i) for i in range(splits.get(d, 1))] for d, n in enumerate(shape)]
    boxes = []
    for corner in np.ndindex(*(len(r) for r in ranges)):
        spans = [ranges[d][i] for d, i in enumerate(corner)]
        if all(stop > start for start, stop in spans):
            boxes.append((tuple(s for s, _ in spans), tuple(e - s for s, e in spans)))
    return boxes


def verified_read_bytes(stored: Sequence[Box], wanted: Box, itemsize: int, block: int) -> int:
    """Bytes a reader that verifies what it reads must fetch to fill `wanted`: within each stored piece (row-major,
    checksummed in blocks of `block` bytes from its start), every block that holds a needed byte."""
    total = 0
    for offsets, shape in stored:
        lo = [max(o, w) for o, w in zip(offsets, wanted[0])]
        hi = [min(o + n, w + m) for o, n, w, m in zip(offsets, shape, wanted[0], wanted[1])]
        if any(h <= low for low, h in zip(lo, hi)):
            continue
        mask = np.zeros(shape, dtype=bool)
        mask[tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, offsets))] = True
        size = math.prod(shape) * itemsize
        blocks = np.unique(np.flatnonzero(mask.reshape(-1)) * itemsize // block)
        total += int(np.minimum(block, size - blocks * block).sum())
    return total
