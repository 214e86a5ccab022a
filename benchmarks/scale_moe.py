"""A DeepSeek-V3-shaped mixture-of-experts model with AdamW state, sharded EP x FSDP on W simulated ranks.

Every rank's pieces come out of numpy at once per group of same-shaped, same-placed tensors, so the local
manifests of 4,096 ranks of a 180,000-tensor state are built in minutes; benchmarks.scale measures the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from shardckpt.format.local_manifest import LocalManifest, LocalPieces, TensorSpec, encode_local_manifest

BLOCK = 64 << 10
HEADER = 4096  # bytes of safetensors header before the first piece of every simulated data file
ITEMSIZE = 4  # F32 parameters (FSDP2's sharded fp32 master copy) and AdamW state
LAYOUTS = ("experts", "grouped")


@dataclass(frozen=True)
class MoeConfig:
    """DeepSeek-V3 (config.json of deepseek-ai/DeepSeek-V3): the first `dense_layers` layers have a dense FFN."""

    layers: int = 61
    dense_layers: int = 3
    hidden: int = 7168
    experts: int = 256
    expert_ffn: int = 2048
    dense_ffn: int = 18432
    vocab: int = 129280
    heads: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128


@dataclass(frozen=True)
class Mesh:
    """W = EP x FSDP ranks, EP innermost as torchtitan builds it (dp_shard_mod_ep outer, ep inner)."""

    world: int
    ep: int

    @property
    def fsdp(self) -> int:
        return self.world // self.ep

    def coordinates(self, rank: int) -> tuple[int, int]:
        """(fsdp index, ep index) of `rank`."""
        return divmod(rank, self.ep)


@dataclass(frozen=True)
class Group:
    """Tensors of one shape and one placement: "fsdp" (Shard(0) over all ranks), "expert" (one expert's
    matrix, Shard(0) over the FSDP ranks of its EP index), "grouped" ([experts, d_in, d_out]: EP Shard(0) x
    FSDP Shard(1)), "step" (AdamW's 0-d step, one stored copy). `expert`: the expert of each tensor or -1."""

    placement: str
    shape: tuple[int, ...]
    first: int  # global index of the group's first tensor; the group's tensors are numbered consecutively
    expert: np.ndarray


def parameters(config: MoeConfig, layout: str) -> list[tuple[str, tuple[int, ...], int, bool]]:
    """(name, shape, expert or -1, has AdamW state) of every entry of the model's state dict, HF names."""
    c = config
    h, q_head = c.hidden, c.qk_nope_head_dim + c.qk_rope_head_dim
    out: list[tuple[str, tuple[int, ...], int, bool]] = [("model.embed_tokens.weight", (c.vocab, h), -1, True)]
    for layer in range(c.layers):
        p = f"model.layers.{layer}"
        attention = {
            "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
            "self_attn.q_a_proj.weight": (c.q_lora_rank, h),
            "self_attn.q_a_layernorm.weight": (c.q_lora_rank,),
            "self_attn.q_b_proj.weight": (c.heads * q_head, c.q_lora_rank),
            "self_attn.kv_a_proj_with_mqa.weight": (c.kv_lora_rank + c.qk_rope_head_dim, h),
            "self_attn.kv_a_layernorm.weight": (c.kv_lora_rank,),
            "self_attn.kv_b_proj.weight": (c.heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
            "self_attn.o_proj.weight": (h, c.heads * c.v_head_dim),
        }
        out += [(f"{p}.{name}", shape, -1, True) for name, shape in attention.items()]
        if layer < c.dense_layers:
            out += _ffn(f"{p}.mlp", h, c.dense_ffn, -1)
            continue
        out.append((f"{p}.mlp.gate.weight", (c.experts, h), -1, True))
        out.append((f"{p}.mlp.gate.e_score_correction_bias", (c.experts,), -1, False))  # a buffer: no optimizer
        out += _ffn(f"{p}.mlp.shared_experts", h, c.expert_ffn, -1)
        if layout == "grouped":  # torchtitan's GroupedExperts: one [experts, d_in, d_out] tensor per matrix
            out += [
                (f"{p}.mlp.experts.gate_proj.weight", (c.experts, h, c.expert_ffn), -2, True),
                (f"{p}.mlp.experts.up_proj.weight", (c.experts, h, c.expert_ffn), -2, True),
                (f"{p}.mlp.experts.down_proj.weight", (c.experts, c.expert_ffn, h), -2, True),
            ]
        else:
            for expert in range(c.experts):
                out += _ffn(f"{p}.mlp.experts.{expert}", h, c.expert_ffn, expert)
    out += [("model.norm.weight", (h,), -1, True), ("lm_head.weight", (c.vocab, h), -1, True)]
    return out


def _ffn(prefix: str, hidden: int, ffn: int, expert: int) -> list[tuple[str, tuple[int, ...], int, bool]]:
    return [
        (f"{prefix}.gate_proj.weight", (ffn, hidden), expert, True),
        (f"{prefix}.up_proj.weight", (ffn, hidden), expert, True),
        (f"{prefix}.down_proj.weight", (hidden, ffn), expert, True),
    ]


class MoeState:
    """The model's state dict as stored tensors (parameters, AdamW exp_avg / exp_avg_sq / step), in groups."""

    def __init__(self, config: MoeConfig, layout: str) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")
        self.config, self.layout = config, layout
        # Steps of expert parameters are a group of their own: their copies live on the experts' ranks only.
        rows: dict[tuple[str, tuple[int, ...], bool], list[tuple[str, int]]] = {}
        for name, shape, expert, trained in parameters(config, layout):
            placement = "grouped" if expert == -2 else "expert" if expert >= 0 else "fsdp"
            stored = [f"model.{name}"]
            if trained:
                stored += [f"optim.state.{name}.exp_avg", f"optim.state.{name}.exp_avg_sq"]
                rows.setdefault(("step", (), expert >= 0), []).append((f"optim.state.{name}.step", max(expert, -1)))
            rows.setdefault((placement, shape, False), []).extend((entry, expert) for entry in stored)
        specs: list[TensorSpec] = []
        groups: list[Group] = []
        for (placement, shape, _), members in rows.items():
            groups.append(Group(placement, shape, len(specs), np.array([e for _, e in members], dtype=np.int64)))
            specs += [TensorSpec(name, "F32", shape, "box") for name, _ in members]
        self.specs = tuple(specs)
        self.groups = tuple(groups)

    @property
    def numel(self) -> int:
        return sum(spec.numel for spec in self.specs)

    def boxes(
        self, mesh: Mesh, rank: int, *, loading: bool = False
    ) -> tuple[np.ndarray, np.ndarray, list[np.ndarray], list[np.ndarray]]:
        """What rank `rank` of `mesh` holds: (declared tensors, piece tensors, per group (n, k) starts, lengths).

        Declared: every tensor in the rank's state dict (FSDP2 gives every rank every DTensor, possibly empty;
        an EP rank has only its own experts). Pieces where its shard holds elements; a step is stored by one
        rank of those that hold its parameter, and loaded (`loading`) by all of them."""
        f, e = mesh.coordinates(rank)
        per_rank = self.config.experts // mesh.ep
        declared, owners, starts, lengths = [], [], [], []
        for group in self.groups:
            ids = np.arange(group.expert.size, dtype=np.int64) + group.first
            expert = group.expert
            if group.placement in ("expert", "step"):
                mine = (expert < 0) | (expert // per_rank == e)
                ids, expert = ids[mine], expert[mine]
            declared.append(ids)
            shape = np.array(group.shape, dtype=np.int64)
            if group.placement == "step":
                if not loading:
                    position = ids - group.first
                    ids = ids[np.where(expert >= 0, position % mesh.fsdp == f, position % mesh.world == rank)]
                start = length = np.zeros((ids.size, 0), dtype=np.int64)
            elif group.placement == "grouped":
                lo, hi = _shard(int(shape[1]), mesh.fsdp, f)
                start = np.tile(np.array([e * per_rank, lo, 0], dtype=np.int64), (ids.size, 1))
                length = np.tile(np.array([per_rank, hi - lo, shape[2]], dtype=np.int64), (ids.size, 1))
            else:
                ways, index = (mesh.fsdp, f) if group.placement == "expert" else (mesh.world, rank)
                lo, hi = _shard(int(shape[0]), ways, index)
                start = np.zeros((ids.size, shape.size), dtype=np.int64)
                start[:, 0] = lo
                length = np.tile(shape, (ids.size, 1))
                length[:, 0] = hi - lo
            if length.size and not length.all():  # an empty shard: declared, nothing stored
                continue
            owners.append(ids)
            starts.append(start)
            lengths.append(length)
        return np.concatenate(declared), _concat(owners), starts, lengths

    def local_manifest(self, mesh: Mesh, rank: int, tables: dict[bytes, tuple[TensorSpec, ...]]) -> bytes:
        """The encoded local manifest rank `rank` sends; `tables` shares identical tensor tables between ranks."""
        return encode_local_manifest(self.local(mesh, rank, tables))

    def local(self, mesh: Mesh, rank: int, tables: dict[bytes, tuple[TensorSpec, ...]]) -> LocalManifest:
        """Rank `rank`'s local manifest as the coordinator holds it once decoded."""
        declared, owners, starts, lengths = self.boxes(mesh, rank)
        key = declared.tobytes()
        specs = tables.get(key)
        if specs is None:
            specs = tables[key] = tuple(self.specs[i] for i in declared.tolist())
        local = np.searchsorted(declared, owners)
        nbytes = _concat([np.prod(s, axis=1, dtype=np.int64) for s in lengths]) * ITEMSIZE
        offset = HEADER + np.concatenate([[0], np.cumsum(nbytes)[:-1]]).astype(np.int64)
        start, length = _concat([s.reshape(-1) for s in starts]), _concat([s.reshape(-1) for s in lengths])
        pieces = LocalPieces(specs, local, offset, start, length)
        crcs = np.zeros(int((-(-nbytes // BLOCK)).sum()), dtype=np.uint32)
        size = HEADER + int(nbytes.sum())
        data = f"data/{rank:05d}-scale.safetensors"
        return LocalManifest("scale", rank, mesh.world, data, size, HEADER, 0, BLOCK, specs, pieces, crcs)

    def targets(self, mesh: Mesh, rank: int) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
        """(name, offsets, shape) of every box rank `rank` of `mesh` loads: its shards and its steps."""
        _, owners, starts, lengths = self.boxes(mesh, rank, loading=True)
        offsets = [tuple(row) for start in starts for row in start.tolist()]
        shapes = [tuple(row) for length in lengths for row in length.tolist()]
        return [(self.specs[i].name, o, s) for i, o, s in zip(owners.tolist(), offsets, shapes)]


def _concat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays).astype(np.int64) if arrays else np.zeros(0, np.int64)


def _shard(rows: int, ways: int, index: int) -> tuple[int, int]:
    """FSDP2 / torch.chunk rows of shard `index` of `ways`: ceil(rows / ways) each, trailing shards short or empty."""
    chunk = math.ceil(rows / ways)
    lo = min(index * chunk, rows)
    return lo, min(lo + chunk, rows)
