"""The last step is always saved (issue 26.2): Checkpointer(total_steps=) and close(step, state), with a cadence
("auto" or fixed) that does not fall on the final step."""

from __future__ import annotations

import pytest
import torch

import shardckpt
from shardckpt.errors import ShardckptUsageError

pytestmark = pytest.mark.unit


def _run(checkpointer: shardckpt.Checkpointer, steps: int) -> dict[str, torch.Tensor]:
    state = {"w": torch.zeros(2)}
    for step in range(1, steps + 1):
        state["w"].fill_(step)
        checkpointer.maybe_save(step, state)
    return state


@pytest.mark.parametrize("every", [7, "auto"])
def test_total_steps_saves_the_final_step(tmp_path, every) -> None:
    root = str(tmp_path / "run")
    checkpointer = shardckpt.Checkpointer(root, every_steps=every, total_steps=20, preemption_signals=())
    _run(checkpointer, 20)
    checkpointer.close()
    assert shardckpt.latest(root) == f"{root}/step-00000020"
    assert [record.step for record in checkpointer.records][-1] == 20


def test_close_with_the_final_state_saves_it_once(tmp_path) -> None:
    root = str(tmp_path / "run")
    checkpointer = shardckpt.Checkpointer(root, every_steps=7, async_save=True, preemption_signals=())
    state = _run(checkpointer, 20)
    checkpointer.close(20, state)
    assert shardckpt.latest(root) == f"{root}/step-00000020"
    restored = {"w": torch.zeros(2)}
    assert shardckpt.Checkpointer(root, preemption_signals=()).restore_latest(restored) == 20
    assert torch.equal(restored["w"], torch.full((2,), 20.0))
    # A final step the cadence already saved is not saved again (that would refuse: the URL is committed).
    again = shardckpt.Checkpointer(str(tmp_path / "other"), every_steps=10, preemption_signals=())
    again.close(20, _run(again, 20))
    assert [record.step for record in again.records] == [10, 20]


def test_close_with_half_the_final_state_is_refused(tmp_path) -> None:
    checkpointer = shardckpt.Checkpointer(str(tmp_path / "run"), preemption_signals=())
    with pytest.raises(ShardckptUsageError, match="pass both"):
        checkpointer.close(20)


@pytest.mark.parametrize("step", ["5", 5.0, None, True])
@pytest.mark.parametrize("call", ["maybe_save", "save", "close"])
def test_a_step_that_is_not_an_int_is_a_usage_error(tmp_path, step, call) -> None:
    # Found by an outside test: close("5", state) and save(5.0, ...) died of "Unknown format code 'd'", maybe_save
    # of "not all arguments converted", save(None) of a NoneType format error: untyped, naming no step.
    checkpointer = shardckpt.Checkpointer(str(tmp_path / "run"), every_steps=10, preemption_signals=())
    state = {"w": torch.zeros(2)}
    with pytest.raises(ShardckptUsageError, match="step"):
        getattr(checkpointer, call)(step, state)
    assert shardckpt.latest(str(tmp_path / "run")) is None
