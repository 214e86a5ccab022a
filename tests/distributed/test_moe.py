"""Mixture-of-experts state on gloo ranks, resharded on load, bit for bit, reading only the bytes each rank needs.

Per-expert tensors (Hugging Face's layout) under FSDP2 with AdamW: saved on 4 ranks, loaded on 3. 4,040 stored
tensors here (FSDP2's own per-parameter setup and AdamW's step cost ~1 s per 1,000 parameters on 2 cores);
`python -m benchmarks.moe` runs the same model at 20,176. Grouped [experts, ...] tensors (torchtitan's) on a 2-D
mesh, expert parallel Shard(0) x FSDP (Shard(1), and FSDP2's own _StridedShard(0) when it shards the expert dim
too): saved on EP 2 x FSDP 2, loaded on EP 1 x FSDP 3 and on EP 4 x FSDP 1. Two launched jobs: 4 ranks, then 3.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import shardckpt
from tests.helpers.launch import run_ranks

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "moe_worker.py"
# 2 layers x 168 experts x 3 matrices + 2 routers = 1,010 parameters; with exp_avg, exp_avg_sq and step: 4,040.
PER_EXPERT = {"layers": 2, "dim": 8, "ffn": 12, "experts": 168}
# Rows of 384 and 768 bytes and splits in 2, 3 and 4 that all fall on 4 KiB checksum blocks: a rank that reads
# only its own bytes reads exactly what it needs.
GROUPED = {"layers": 2, "dim": 96, "ffn": 192, "experts": 8}
SAVE_LAYOUT = (2, 2)  # (EP, FSDP)


def _values(results: list[dict | None]) -> list[dict]:
    for rank, result in enumerate(results):
        if result is None:
            pytest.fail(f"rank {rank} wrote no result (crashed or timed out)")
        if not result["ok"]:
            pytest.fail(f"rank {rank}: {result.get('error')}\n{result.get('trace')}\n{result.get('output')}")
    return [result["value"] for result in results if result is not None]


def _part(values: list[dict], name: str) -> list[dict]:
    for rank, value in enumerate(values):
        outcome = value.get(name)
        if outcome is None or not outcome["ok"]:
            pytest.fail(f"{name} on rank {rank}: {outcome and outcome['error']}\n{outcome and outcome['trace']}")
    return [value[name] for value in values]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict:
    """The 4-rank job (saves; grouped loads on EP 4 x FSDP 1) and then the 3-rank job (the other loads)."""
    root = tmp_path_factory.mktemp("moe")
    common = {"root": str(root), "per_expert": PER_EXPERT, "grouped": GROUPED, "grouped_save": SAVE_LAYOUT}
    saved = _values(run_ranks("save", 4, {**common, "grouped_loads_here": [(4, 1)]}, timeout=600, worker=WORKER))
    loaded = _values(
        run_ranks("load", 3, {**common, "saved": 4, "grouped_loads_here": [(1, 3)]}, timeout=600, worker=WORKER)
    )
    return {"root": root, "save": saved, "load": loaded}


def test_per_expert_fsdp2_state_resharded_4_to_3_bit_exact(jobs) -> None:
    saves = _part(jobs["save"], "per_expert")
    assert saves[0]["stored"] == 4 * (2 + 2 * 168 * 3)
    loads = _part(jobs["load"], "per_expert")
    for rank, outcome in enumerate(loads):
        assert outcome["mismatched"] == [], f"rank {rank}: tensors differ from the saved values"
        assert outcome["tensors"] == saves[0]["stored"]
        assert outcome["needed"] == outcome["expected_needed"]
        # Each piece here (<= 3,360 bytes) is below one checksum block, so a verified read of part of a piece
        # reads all of it; beyond that nothing: exactly the blocks that hold needed bytes, no coalescing gaps.
        assert outcome["fetched"] == outcome["expected_fetched"], f"rank {rank}"


@pytest.mark.parametrize("variant", ["shard1", "strided"])
@pytest.mark.parametrize("layout", ["4x1", "1x3"])
def test_grouped_experts_on_another_ep_x_fsdp_mesh_read_only_their_experts(jobs, variant: str, layout: str) -> None:
    saves = _part(jobs["save"], f"grouped_{variant}_save")
    # As torchtitan gets them: FSDP over the (fsdp, ep) mesh's first dim, EP's Shard(0) on the second.
    expected = ["S(1)", "S(0)"] if variant == "shard1" else ["_S(0, 2)", "S(0)"]
    for name in ("model.layers.0.experts.w2", "optim.state.layers.1.experts.w1.exp_avg_sq"):
        assert saves[0]["placements"][name] == expected
    job = "save" if layout == "4x1" else "load"
    for rank, outcome in enumerate(_part(jobs[job], f"grouped_{variant}_load_{layout}")):
        assert outcome["mismatched"] == [], f"rank {rank}"
        # Expert rows fall on checksum blocks: a rank reads its experts' bytes and nothing else; the routers'
        # sub-block pieces are read whole. Exactly the blocks that hold needed bytes, counted by hand.
        assert outcome["fetched"] == outcome["expected_fetched"], f"rank {rank}"
        assert outcome["needed"] <= outcome["fetched"] <= 1.05 * outcome["needed"], f"rank {rank}"


def test_the_checkpoints_verify(jobs) -> None:
    from shardckpt.ops.verify import verify

    root = jobs["root"]
    for name in ("per-expert", "grouped-shard1", "grouped-strided"):
        assert verify(str(root / name)).ok, name
    assert shardckpt.open(str(root / "grouped-shard1")).manifest.world_size == 4


def test_strided_shard_is_taken_where_it_leaves_one_box_and_refused_where_it_does_not() -> None:
    """FSDP2's _StridedShard(0) over EP's Shard(0): rank (fsdp f, ep e) holds chunk f of EP chunk e. Alone, a
    strided split gives a rank two runs of rows: no box, so it is refused rather than stored as a wrong one."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from shardckpt.statedict.dtensor import strided_box

    placements = (_StridedShard(0, split_factor=2), Shard(0))
    boxes = {(f, e): strided_box((8, 5), (2, 2), (f, e), placements) for f in range(2) for e in range(2)}
    assert boxes == {
        (0, 0): ((2, 5), (0, 0)),
        (1, 0): ((2, 5), (2, 0)),
        (0, 1): ((2, 5), (4, 0)),
        (1, 1): ((2, 5), (6, 0)),
    }
    assert strided_box((7, 3), (2, 2), (1, 1), placements) == ((1, 3), (6, 0))  # uneven: 7 = 4 + 3, then 2 + 1
    assert strided_box((8, 5), (2, 2), (0, 1), (_StridedShard(0, split_factor=2), Replicate())) is None
