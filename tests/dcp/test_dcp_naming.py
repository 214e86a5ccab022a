"""shardckpt.dcp in one process: one naming for both APIs (SPEC 7 "Names"), plain values only, refusals, and S3.

A checkpoint written by dcp.save loads with shardckpt.load from the same state dict, and one written by
shardckpt.save loads with dcp.load, though DCP flattens tensor-free containers that shardckpt keeps whole.
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

import shardckpt
import shardckpt.dcp
from shardckpt.dcp.naming import dcp_entries, object_names, split_objects, value_at
from shardckpt.format import layout
from shardckpt.statedict.leaves import per_rank_plain

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _state(scale: float) -> dict:
    """A training state with what DCP flattens and shardckpt keeps whole: param groups, tuples, bytes, nesting."""
    return {
        "model": {"w": torch.arange(12.0).reshape(3, 4) * scale, "n": torch.tensor([1, 2]) * int(scale)},
        "optim": {
            "state": {"w": {"step": torch.tensor(3.0 * scale), "exp_avg": torch.full((3, 4), scale)}},
            "param_groups": [
                {"lr": 0.1 * scale, "betas": (0.9, 0.99 * scale), "params": ["w"], "sched": {"warmup": [1, 2]}},
                {"lr": 0.2 * scale, "betas": (0.8, 0.9), "params": [], "sched": {"warmup": []}},
            ],
        },
        "loader": {"position": int(scale * 10), "blob": bytes([int(scale)] * 3), "shards": [{"a": scale}, [1, 2]]},
        "epoch": int(scale),
    }


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_dcp_entries_are_the_names_and_values_dcp_flattens_a_plain_value_into() -> None:
    value = _state(2.0)["optim"]["param_groups"] + [{"empty": {}, 1: "int key"}, ("a", {"b": 1}), [[{"c": 1}], [2]]]
    flattened, _ = flatten_state_dict({"optim": {"param_groups": value}})
    entries = dcp_entries("optim.param_groups", value)
    assert [name for name, _ in entries] == list(flattened)
    for name, path in entries:
        assert value_at(value, path, "test") == flattened[name]


def test_a_dcp_save_loads_with_shardckpt_load_and_a_shardckpt_save_with_dcp_load(tmp_path) -> None:
    saved = _state(2.0)
    dcp.save(copy.deepcopy(saved), storage_writer=shardckpt.dcp.StorageWriter(str(tmp_path / "by-dcp"), step=4))
    shardckpt.save(copy.deepcopy(saved), str(tmp_path / "by-shardckpt"), step=4)
    # The same objects either way: a tensor-free container is one object (SPEC 7 "Names").
    by_dcp, by_us = shardckpt.open(str(tmp_path / "by-dcp")), shardckpt.open(str(tmp_path / "by-shardckpt"))
    assert by_dcp.objects == by_us.objects
    assert sorted(by_dcp.objects) == ["epoch", "loader", "optim.param_groups"]
    for url in (tmp_path / "by-dcp", tmp_path / "by-shardckpt"):
        into_shardckpt, into_dcp = _state(5.0), _state(5.0)
        shardckpt.load(into_shardckpt, str(url))
        dcp.load(into_dcp, storage_reader=shardckpt.dcp.StorageReader(str(url)))
        if not _equal(into_shardckpt, saved) or not _equal(into_dcp, saved):
            pytest.fail(f"{url.name}: shardckpt.load gave {into_shardckpt}, dcp.load gave {into_dcp}")


def test_a_value_that_is_not_plain_fails_the_save_naming_its_entry_and_type(tmp_path) -> None:
    url = str(tmp_path / "ck")
    state = {"w": torch.ones(2), "config": {"schedule": {"fn": object()}}}
    with pytest.raises(CheckpointException) as raised:
        dcp.save(state, storage_writer=shardckpt.dcp.StorageWriter(url))
    cause = raised.value.failures[0][0]
    assert isinstance(cause, shardckpt.ShardckptError)
    assert "'config.schedule.fn'" in str(cause) and "type object" in str(cause)
    assert not os.path.exists(os.path.join(url, "COMMITTED"))


def test_dcp_load_casts_dtypes_as_dcp_does(tmp_path) -> None:
    url = str(tmp_path / "ck")
    dcp.save({"f": torch.linspace(-2, 2, 9), "i": torch.arange(5)}, storage_writer=shardckpt.dcp.StorageWriter(url))
    into = {"f": torch.zeros(9, dtype=torch.bfloat16), "i": torch.zeros(5, dtype=torch.int32)}
    dcp.load(into, storage_reader=shardckpt.dcp.StorageReader(url))
    assert torch.equal(into["f"], torch.linspace(-2, 2, 9).to(torch.bfloat16))
    assert torch.equal(into["i"], torch.arange(5, dtype=torch.int32))


def test_plan_caching_is_refused_with_a_clear_error_at_the_first_save(tmp_path) -> None:
    """Refused before anything is written, at the first save already (a second, cached save would otherwise be the
    first to fail, maybe hours into a run); a cached save that still came through is refused as well."""
    state = {"w": torch.ones(3)}
    for label in ("a", "b"):
        planner = DefaultSavePlanner(enable_plan_caching=True)
        with pytest.raises(CheckpointException) as raised:
            dcp.save(state, storage_writer=shardckpt.dcp.StorageWriter(str(tmp_path / label)), planner=planner)
        assert "enable_plan_caching" in str(raised.value.failures[0][0])
        assert not os.path.exists(tmp_path / label)


def test_dcp_save_and_load_through_s3(s3_url) -> None:
    saved = _state(3.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(copy.deepcopy(saved), storage_writer=shardckpt.dcp.StorageWriter(f"{s3_url}/ck", step=1))
        into = _state(7.0)
        reader = shardckpt.dcp.StorageReader(f"{s3_url}/ck")
        dcp.load(into, storage_reader=reader)
    if not _equal(into, saved):
        pytest.fail(f"loaded from S3: {into}")
    assert shardckpt.open(f"{s3_url}/ck").step == 1
    assert reader.stats.fetched_bytes == reader.stats.needed_bytes  # whole small pieces: nothing beyond them


def test_a_container_whose_parts_ranks_hold_differently_is_stored_as_its_parts() -> None:
    """torchtitan keys each data loader's state by rank: no rank holds all of `dataloader`, so each part held
    whole by its ranks is an object; containers every holder holds whole stay one object."""
    paths = {
        "dataloader.dp_rank_0": ("dataloader", "dp_rank_0"),
        "dataloader.dp_rank_1": ("dataloader", "dp_rank_1"),
        "train.step": ("train", "step"),
        "train.loss": ("train", "loss"),
        "mixed.shared.a": ("mixed", "shared", "a"),
        "mixed.shared.b": ("mixed", "shared", "b"),
        "mixed.only0": ("mixed", "only0"),
    }
    held = [
        ["dataloader.dp_rank_0", "train.step", "train.loss", "mixed.shared.a", "mixed.shared.b", "mixed.only0"],
        ["dataloader.dp_rank_1", "train.step", "train.loss", "mixed.shared.a", "mixed.shared.b"],
    ]
    owners = object_names(paths, (), sorted(paths))
    assert split_objects(owners, held, paths) == {
        "dataloader.dp_rank_0": ("dataloader", "dp_rank_0"),
        "dataloader.dp_rank_1": ("dataloader", "dp_rank_1"),
        "train.step": ("train",),
        "train.loss": ("train",),
        "mixed.shared.a": ("mixed", "shared"),
        "mixed.shared.b": ("mixed", "shared"),
        "mixed.only0": ("mixed", "only0"),
    }


class _ReaderAs(shardckpt.dcp.StorageReader):
    """The reader as rank `rank` of a group sees it (dcp.load in one process is rank 0)."""

    rank = 0

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, rank=self.rank)


def test_dcp_load_gives_each_rank_its_own_per_rank_value_and_keeps_it_where_none_was_saved(tmp_path) -> None:
    url = str(tmp_path / "per-rank")
    attempt = layout.new_attempt()
    for rank in (0, 1):  # what shardckpt.save with a PerRank value writes on 2 ranks
        writer = shardckpt.ShardWriter(url, rank=rank, world_size=2, attempt=attempt)
        writer.add("w", torch.full((2,), float(rank)), global_shape=(4,), offsets=(2 * rank,))
        rng = {"seed": 10 + rank, "state": torch.arange(4, dtype=torch.uint8) + rank, "tags": [rank]}
        writer.add_object("rng", per_rank_plain(rng), per_rank=True)
        writer.add_object("step", 7)
        writer.close()
    shardckpt.commit(url, world_size=2, attempt=attempt)
    for rank in (0, 1, 2):
        into = {"w": torch.zeros(4), "rng": {"seed": -1, "state": torch.zeros(4, dtype=torch.uint8), "tags": [9]}}
        into["step"] = 0
        reader = type("Reader", (_ReaderAs,), {"rank": rank})(url)
        dcp.load(into, storage_reader=reader)
        assert torch.equal(into["w"], torch.tensor([0.0, 0.0, 1.0, 1.0])) and into["step"] == 7
        if rank == 2:  # saved on 2 ranks: the destination keeps its value, as shardckpt.load's PerRank default
            expected = {"seed": -1, "state": torch.zeros(4, dtype=torch.uint8), "tags": [9]}
        else:
            expected = {"seed": 10 + rank, "state": torch.arange(4, dtype=torch.uint8) + rank, "tags": [rank]}
        if not _equal(into["rng"], expected):
            pytest.fail(f"rank {rank} got {into['rng']}, expected {expected}", pytrace=False)


def test_shardckpt_load_of_the_state_dcp_saved_with_one_key_per_rank_fills_each_ranks_key(tmp_path) -> None:
    """torchtitan keys its data loader's state by rank: rank r saves {"dataloader": {"dp_rank_<r>": ...}}, which
    StorageWriter stores as the objects dataloader.dp_rank_0 and dataloader.dp_rank_1 (SPEC 7 "Names"). The same
    state dict loads back with shardckpt.load as with dcp.load (it failed: 'lacks 1 entries ... dataloader')."""
    from shardckpt.format.layout import new_attempt
    from shardckpt.write.commit import commit

    url, attempt = str(tmp_path / "ck"), new_attempt()
    for rank in (0, 1):  # what write_data does on each rank of a 2-rank dcp.save
        writer = shardckpt.ShardWriter(url, rank=rank, world_size=2, attempt=attempt)
        writer.add("w", torch.full((1, 4), float(rank)), global_shape=(2, 4), offsets=(rank, 0))
        writer.add_object(f"dataloader.dp_rank_{rank}", {"position": rank * 10, "blob": bytes([rank])})
        writer.close()
    commit(url, world_size=2, attempt=attempt)
    state = {"w": torch.zeros(2, 4), "dataloader": {"dp_rank_0": {"position": -1, "blob": b""}}}
    shardckpt.load(state, url)
    assert state["dataloader"] == {"dp_rank_0": {"position": 0, "blob": b"\x00"}}
    assert torch.equal(state["w"], torch.tensor([[0.0] * 4, [1.0] * 4]))
    # A key no rank saved is missing, named as the part it would have been.
    with pytest.raises(shardckpt.ShardckptUsageError, match=r"lacks 1 entries.*'dataloader\.dp_rank_2'"):
        shardckpt.load({"dataloader": {"dp_rank_2": {}}}, url)
    relaxed = {"dataloader": {"dp_rank_1": None, "dp_rank_2": "mine"}}
    shardckpt.load(relaxed, url, strict=False)
    assert relaxed["dataloader"] == {"dp_rank_1": {"position": 10, "blob": b"\x01"}, "dp_rank_2": "mine"}


def test_a_full_load_without_a_state_dict_comes_back_nested_as_dcp_saved_it(tmp_path) -> None:
    """dcp_to_torch_save's planner (_EmptyStateDictLoadPlanner) nests by Metadata.planner_data, which the reader
    gave as None: every entry came back flat ('optim.state.w.exp_avg'). Keys with dots stay one key."""
    saved = _state(2.0)
    saved["model"]["layers.0.weight"] = torch.ones(2)  # a module FQN: one key, not three
    saved["optim"]["state"]["layers.0.weight"] = {"exp_avg": torch.zeros(2)}
    url = str(tmp_path / "ck")
    dcp.save(copy.deepcopy(saved), storage_writer=shardckpt.dcp.StorageWriter(url))
    full = shardckpt.dcp.full_state_dict(url)
    expected = copy.deepcopy(saved)
    expected["optim"]["param_groups"][1].pop("params")  # DCP drops an empty list
    expected["optim"]["param_groups"][1]["sched"].pop("warmup")
    assert set(full) == set(expected) and set(full["optim"]["state"]) == {"w", "layers.0.weight"}
    assert torch.equal(full["model"]["layers.0.weight"], torch.ones(2))
    assert torch.equal(full["optim"]["state"]["w"]["exp_avg"], saved["optim"]["state"]["w"]["exp_avg"])
    assert full["loader"]["blob"] == saved["loader"]["blob"] and full["epoch"] == 2
    assert full["optim"]["param_groups"][0]["lr"] == saved["optim"]["param_groups"][0]["lr"]
    assert "model.w" not in full and "optim.state.w.exp_avg" not in full


def test_recorded_key_paths_that_cannot_nest_are_a_format_error_not_a_torch_crash(tmp_path) -> None:
    from shardckpt.write.commit import commit

    url, attempt = str(tmp_path / "ck"), "a1"
    writer = shardckpt.ShardWriter(url, rank=0, world_size=1, attempt=attempt)
    writer.add("a", torch.ones(1), global_shape=(1,), offsets=(0,))
    writer.add("b", torch.ones(1), global_shape=(1,), offsets=(0,))
    writer.close()
    commit(url, world_size=1, attempt=attempt, metadata={"dcp_paths": {"a": ["x"], "b": ["x", "y"]}})
    with pytest.raises(shardckpt.FormatError, match="entries 'a' and 'b' nest at once"):
        shardckpt.dcp.full_state_dict(url)
