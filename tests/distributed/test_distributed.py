"""Multi-process saves and loads with gloo: FSDP2 state on W ranks restored on W' ranks (1..4), bit for bit."""

from __future__ import annotations

import os

import pytest
import torch

import shardckpt
from tests.helpers.launch import run_ranks

WORLDS = (1, 2, 3, 4)


def _values(results: list[dict | None]) -> list:
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} wrote no result (crashed or timed out)"
        assert result["ok"], f"rank {rank}: {result.get('error')}\n{result.get('trace')}\n{result.get('output')}"
    return [result["value"] for result in results if result is not None]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[int, tuple[str, str]]:
    """An FSDP2 model + AdamW state after one step, saved on 1, 2, 3 and 4 ranks."""
    root = tmp_path_factory.mktemp("dist")
    checkpoints = {}
    for world in WORLDS:
        url, reference = str(root / f"w{world}"), str(root / f"ref{world}.safetensors")
        values = _values(run_ranks("save", world, {"url": url, "reference": reference}))
        assert len({v["attempt"] for v in values}) == 1  # every rank got the same outcome
        checkpoints[world] = (url, reference)
    return checkpoints


@pytest.mark.parametrize("readers", WORLDS)
def test_fsdp2_state_restores_on_any_world_size(saved, readers: int) -> None:
    urls = [saved[w][0] for w in WORLDS]
    references = [saved[w][1] for w in WORLDS]
    values = _values(run_ranks("load", readers, {"urls": urls, "references": references}))
    for url in urls:
        for rank, value in enumerate(values):
            outcome = value[url]
            assert outcome["mismatched"] == [], (url, rank)
            assert outcome["epoch"] == 3
            saved_world = int(os.path.basename(url)[1:])
            assert outcome["rng"] == ({"rank": rank} if rank < saved_world else None)
            # Each rank reads its own bytes: the planned bytes are its shards plus bounded block rounding.
            assert outcome["needed"] <= outcome["fetched"] <= outcome["needed"] + 64 * 1024 * 40


def test_every_checkpoint_is_complete_and_verifies(saved) -> None:
    from shardckpt.ops.verify import verify

    for world in WORLDS:
        checkpoint = shardckpt.open(saved[world][0])
        assert checkpoint.manifest.world_size == world
        names = set(checkpoint.tensors)
        assert "model.1.weight" in names and "optim.state.1.weight.exp_avg" in names
        assert "optim.state.1.weight.step" in names  # AdamW step: a replicated 0-d tensor, stored once
        assert checkpoint.manifest.tensor("optim.state.1.weight.step").pieces.count == 1
        assert verify(saved[world][0]).ok


@pytest.mark.parametrize("world", [2, 4])
def test_shard1_replicate_and_2d_mesh_layouts(tmp_path, world: int) -> None:
    url, reference = str(tmp_path / "ck"), str(tmp_path / "ref.safetensors")
    for value in _values(run_ranks("layouts", world, {"url": url, "reference": reference})):
        assert all(value["equal"].values()), value
    from safetensors.torch import load_file

    full = load_file(reference)
    checkpoint = shardckpt.open(url)
    assert torch.equal(checkpoint.read("col"), full["col"])
    assert torch.equal(checkpoint.read("rep"), full["rep"])
    assert checkpoint.manifest.tensor("rep").pieces.count == 1  # replicated: written by one rank only
    if world == 4:
        assert torch.equal(checkpoint.read("grid"), full["grid"])
        assert checkpoint.manifest.tensor("grid").pieces.count == 4
        assert torch.equal(checkpoint.read("grid_rep"), full["grid_rep"])
        assert checkpoint.manifest.tensor("grid_rep").pieces.count == 2


@pytest.mark.parametrize("world", [3])
def test_flat_zero_partitions_into_fsdp2_and_back(tmp_path, world: int) -> None:
    args = {"flat_url": str(tmp_path / "flat"), "box_url": str(tmp_path / "box")}
    for value in _values(run_ranks("flat_to_fsdp", world, args)):
        assert value == {"into_fsdp": True, "back_to_flat": True}
    assert {e.layout for e in shardckpt.open(args["flat_url"]).manifest.tensors} == {"flat"}
    assert {e.layout for e in shardckpt.open(args["box_url"]).manifest.tensors} == {"box"}


def test_a_rank_that_raises_fails_the_save_everywhere(tmp_path) -> None:
    url = str(tmp_path / "ck")
    values = _values(run_ranks("fail", 3, {"url": url, "bad_rank": 1}))
    for value in values:
        assert value["raised"] == "DistributedError"
        assert list(value["failures"]) == ["1"] and "FormatError" in value["failures"]["1"]
    assert not os.path.exists(os.path.join(url, "COMMITTED"))


def test_a_rank_that_dies_fails_the_save_without_hanging(tmp_path) -> None:
    """Rank 1 is killed before it writes: the others raise within the 20 s group timeout, nothing commits."""
    url = str(tmp_path / "ck")
    results = run_ranks("fail", 3, {"url": url, "bad_rank": 1, "die": True, "timeout": 20}, timeout=120)
    assert results[1] is None
    for rank in (0, 2):
        assert results[rank] is not None and results[rank]["ok"], results[rank]
        assert results[rank]["value"]["raised"] == "DistributedError"
    assert not os.path.exists(os.path.join(url, "COMMITTED"))


def test_fsdp2_state_saved_on_four_ranks_to_s3_loads_on_three(tmp_path, s3_env, s3_url) -> None:
    """The distributed protocol against the real S3 server: 4-rank save, 4 -> 3 elastic load, bit for bit."""
    url, reference = f"{s3_url}/w4", str(tmp_path / "reference.safetensors")
    _values(run_ranks("save", 4, {"url": url, "reference": reference}))
    values = _values(run_ranks("load", 3, {"urls": [url], "references": [reference]}))
    for value in values:
        assert value[url]["mismatched"] == []
        assert value[url]["needed"] <= value[url]["fetched"]
    assert shardckpt.open(url).manifest.world_size == 4


def test_a_checkpoint_with_a_piece_index_restores_on_another_world_size(tmp_path, monkeypatch) -> None:
    """Format 1.2 (SPEC 11.1): the coordinator broadcasts the manifest's head, every rank range-reads its blocks."""
    monkeypatch.setenv("SHARDCKPT_PIECE_INDEX_MIN_TENSORS", "0")
    monkeypatch.setenv("SHARDCKPT_PIECE_INDEX_BLOCK", "200")  # several blocks even for this small model
    url, reference = str(tmp_path / "ck"), str(tmp_path / "ref.safetensors")
    _values(run_ranks("save", 2, {"url": url, "reference": reference}))
    opened = shardckpt.open(url)
    assert opened.manifest.piece_index is not None and opened.manifest.piece_index.blocks > 2
    for value in _values(run_ranks("load", 3, {"urls": [url], "references": [reference]})):
        assert value[url]["mismatched"] == [] and value[url]["epoch"] == 3
