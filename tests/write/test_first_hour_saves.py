"""The first hour, round 2 (issue 26), through shardckpt.save / load / latest and the Checkpointer: DCP Stateful
entries (26.7), a save into a committed URL pointing at the Checkpointer (26.11)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import shardckpt
from shardckpt.errors import AlreadyExistsError
from shardckpt.statedict.step import NoStepWarning

pytestmark = pytest.mark.unit


class AppState:
    """A DCP tutorial's app state: a model and an optimizer behind state_dict() / load_state_dict()."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.loaded: list[dict[str, Any]] = []

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded.append(state)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])


class Counter:
    def __init__(self, position: int) -> None:
        self.position = position

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


def _trained(seed: int) -> AppState:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return AppState(model, optimizer)


def test_stateful_entries_save_and_load_as_dcp_does(tmp_path) -> None:
    saved = _trained(0)
    url = str(tmp_path / "step-00000001")
    shardckpt.save({"app": saved, "data": Counter(17), "epoch": 3}, url, step=1)
    assert "app.model.weight" in shardckpt.open(url).tensors

    target = _trained(1)
    data = Counter(0)
    state = {"app": target, "data": data, "epoch": 0}
    shardckpt.load(state, url)
    assert torch.equal(target.model.weight, saved.model.weight)
    assert torch.equal(
        target.optimizer.state_dict()["state"][0]["exp_avg"], saved.optimizer.state_dict()["state"][0]["exp_avg"]
    )
    assert len(target.loaded) == 1 and data.position == 17
    assert state["app"] is target and state["epoch"] == 3  # plain values beside a Stateful reach the caller's dict


def test_stateful_nested_and_through_the_checkpointer(tmp_path) -> None:
    saved = _trained(0)
    checkpointer = shardckpt.Checkpointer(str(tmp_path / "run"), every_steps=1, async_save=True, preemption_signals=())
    checkpointer.maybe_save(1, {"train": {"app": saved, "data": Counter(5)}})
    checkpointer.close()
    target, data = _trained(1), Counter(0)
    fresh = shardckpt.Checkpointer(str(tmp_path / "run"), preemption_signals=())
    assert fresh.restore_latest({"train": {"app": target, "data": data}}) == 1
    assert torch.equal(target.model.bias, saved.model.bias) and data.position == 5


def test_a_stateful_in_a_dict_of_plain_values_is_loaded(tmp_path) -> None:
    # Found by an outside test: such a dict is stored whole, as one value, and the load replaced it whole; the
    # Stateful then got its own fresh state_dict() back and the plain values beside it stayed: nothing was restored,
    # silently ({"d": {"a": Counter, "n": 4}}, {"lst": [Counter, 6]}).
    url = str(tmp_path / "step-00000001")
    shardckpt.save({"d": {"a": Counter(9), "n": 4}, "lst": [Counter(8), 6], "deep": {"x": {"c": Counter(7)}}}, url)
    state = {"d": {"a": Counter(0), "n": 0}, "lst": [Counter(0), 0], "deep": {"x": {"c": Counter(0)}}}
    inner, listed = state["d"], state["lst"]
    shardckpt.load(state, url)
    assert state["d"]["a"].position == 9 and state["d"]["n"] == 4 and state["d"] is inner
    assert state["lst"][0].position == 8 and state["lst"][1] == 6 and state["lst"] is listed
    assert state["deep"]["x"]["c"].position == 7


def test_saving_twice_into_one_url_points_at_the_checkpointer(tmp_path) -> None:
    url = str(tmp_path / "ckpt")
    shardckpt.save({"w": torch.ones(2)}, url, step=1)
    with pytest.raises(AlreadyExistsError, match=r"save to a new URL .*Checkpointer\(ROOT, every_steps=N\)"):
        shardckpt.save({"w": torch.ones(2)}, url, step=2)


@pytest.mark.parametrize(
    ("state", "name", "step"),
    [
        ({"w": torch.ones(2), "step": 100}, "a", 100),
        ({"w": torch.ones(2), "global_step": torch.tensor(7)}, "b", 7),
        ({"w": torch.ones(2), "iteration": 9}, "c", 9),
        ({"w": torch.ones(2)}, "step_12", 12),
        ({"w": torch.ones(2)}, "global_step13", 13),
        ({"w": torch.ones(2)}, "checkpoint-14", 14),
        ({"w": torch.ones(2), "step": 3.5}, "step-15", 15),  # a float is not a step: the name is
        ({"w": torch.ones(2), "step": True}, "x", None),
        # Beyond int64, as an int beyond it is: not a step, the name is (before: the save failed, "step must be an
        # integer (64-bit)", though no step was given)
        ({"w": torch.ones(2), "step": torch.tensor((1 << 64) - 1, dtype=torch.uint64)}, "step-17", 17),
        ({"w": torch.ones(2), "trainer": {"step": 21, "data_position": 4}}, "d", 21),  # the bundled loop's shape
        ({"w": torch.ones(2), "a": {"step": 1}, "b": {"step": 2}}, "step-22", 22),  # two counters: the name
    ],
)
def test_a_save_without_step_takes_it_from_the_state_or_the_name(tmp_path, state, name, step) -> None:
    url = str(tmp_path / name)
    shardckpt.save(state, url)
    assert shardckpt.open(url).marker.step == step


def test_readme_s3_style_saves_without_step_keep_newest_by_step(tmp_path) -> None:
    """Two saves of the README's shape, the newer step committed first: latest() is the higher step, ls shows it."""
    root = tmp_path / "run"
    shardckpt.save({"w": torch.full((2,), 2.0), "step": 200}, str(root / "b"))
    shardckpt.save({"w": torch.full((2,), 1.0), "step": 100}, str(root / "a"))
    assert shardckpt.latest(str(root)) == str(root / "b")


def test_a_save_with_no_step_to_find_warns_that_it_will_not_be_the_newest(tmp_path) -> None:
    # Found by an outside test: steps found in the names (step-100, step-200) outrank a later save named "final"
    # that has none, so latest() silently stayed on step-200 (before step inference all three sorted by time).
    root = tmp_path / "run"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a save whose step is found does not warn
        for name in ("step-100", "step-200"):
            shardckpt.save({"w": torch.ones(2)}, str(root / name))
    with pytest.warns(NoStepWarning, match=r"final: saved without a step.*pass step="):
        shardckpt.save({"w": torch.ones(2)}, str(root / "final"))
    assert shardckpt.latest(str(root)) == str(root / "step-200")  # as the warning said
