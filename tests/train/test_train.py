"""The bundled training loop under torchrun: bit-identical resume on the same world size, close on others, kill -9."""

from __future__ import annotations

import math
import os
import signal
import time

import pytest

import shardckpt
from shardckpt.ops.verify import verify
from tests.helpers.training import logged_step, losses, resume, torchrun

STEPS, EVERY = 8, 4
# Resuming on another world size changes only the order of float32 sums (reduce-scatter of gradients over
# W ranks, the loss all-reduce): a few ulps per step, compounded over 4 steps of AdamW on a tiny model.
# 1e-4 relative is two orders of magnitude above what we measure (<= 1e-6) and far below a real error.
RELATIVE_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[str, dict[int, dict]]:
    """8 steps on 4 ranks, checkpoints at steps 4 and 8."""
    root = tmp_path_factory.mktemp("train")
    log = str(root / "loss.jsonl")
    torchrun(4, "--ckpt", str(root / "ck"), "--steps", str(STEPS), "--ckpt-every", str(EVERY), "--loss-log", log)
    return str(root / "ck"), losses(log)


def _resume(tmp_path, checkpoints: str, world: int) -> dict[int, dict]:
    checkpoint = os.path.join(checkpoints, f"step-{EVERY:08d}")
    return resume(tmp_path / f"resume{world}", checkpoint, world, STEPS, EVERY)


def test_resume_on_the_same_world_size_is_bit_identical(tmp_path, uninterrupted) -> None:
    checkpoints, reference = uninterrupted
    resumed = _resume(tmp_path, checkpoints, 4)
    assert sorted(resumed) == list(range(EVERY + 1, STEPS + 1))
    for step, row in resumed.items():
        assert row["loss_hex"] == reference[step]["loss_hex"], (step, row["loss"], reference[step]["loss"])


@pytest.mark.parametrize("world", [3, 2])
def test_resume_on_fewer_ranks_matches_within_reduction_order_tolerance(tmp_path, uninterrupted, world) -> None:
    checkpoints, reference = uninterrupted
    resumed = _resume(tmp_path, checkpoints, world)
    assert sorted(resumed) == list(range(EVERY + 1, STEPS + 1))
    for step, row in resumed.items():
        assert row["world"] == world
        assert math.isclose(row["loss"], reference[step]["loss"], rel_tol=RELATIVE_TOLERANCE), step


def test_checkpoints_hold_everything_to_continue(uninterrupted) -> None:
    checkpoints, _ = uninterrupted
    latest = shardckpt.latest(checkpoints)
    assert latest is not None and latest.endswith(f"step-{STEPS:08d}")
    checkpoint = shardckpt.open(latest)
    assert checkpoint.objects["trainer"] == {"step": STEPS, "data_position": STEPS * 12}
    assert checkpoint.objects["scheduler"]["last_epoch"] == STEPS
    assert set(checkpoint.rank_objects(3)["rng"]) == {"torch", "python"}
    names = set(checkpoint.tensors)
    assert "model.blocks.0.qkv.weight" in names and "optim.state.blocks.0.qkv.weight.exp_avg_sq" in names
    assert verify(latest).ok


def test_kill_minus_nine_then_resume_on_three_ranks(tmp_path) -> None:
    root, pids, log = tmp_path / "ck", tmp_path / "pids", str(tmp_path / "loss.jsonl")
    common = ["--ckpt", str(root), "--steps", "12", "--ckpt-every", "3", "--keep-last", "2"]
    job = torchrun(4, *common, "--pid-dir", str(pids), "--loss-log", log, wait=False)
    deadline = time.monotonic() + 240
    while logged_step(log) < 7:
        assert job.poll() is None, job.communicate()[0].decode(errors="replace")[-4000:]
        assert time.monotonic() < deadline, "the 4-rank job did not reach step 7"
        time.sleep(0.05)
    os.kill(int((pids / "rank-1.pid").read_text()), signal.SIGKILL)
    job.communicate(timeout=120)
    assert job.returncode != 0
    survivor = shardckpt.latest(str(root))
    assert survivor is not None and verify(survivor).ok
    step = shardckpt.open(survivor).step
    assert step is not None and 6 <= step < 12
    torchrun(3, *common, "--resume", "--loss-log", str(tmp_path / "resumed.jsonl"))
    final = shardckpt.latest(str(root))
    assert final is not None and shardckpt.open(final).step == 12
    assert sorted(losses(str(tmp_path / "resumed.jsonl"))) == list(range(step + 1, 13))


def test_sigterm_writes_a_last_checkpoint_and_the_job_resumes(tmp_path) -> None:
    """Preemption: SIGTERM to torchrun reaches every rank; they checkpoint the current step, exit, and resume."""
    root, log = tmp_path / "ck", str(tmp_path / "loss.jsonl")
    common = ["--ckpt", str(root), "--steps", "200", "--ckpt-every", "100"]
    job = torchrun(3, *common, "--loss-log", log, wait=False)
    deadline = time.monotonic() + 240
    while logged_step(log) < 5:
        assert job.poll() is None, job.communicate()[0].decode(errors="replace")[-4000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    job.send_signal(signal.SIGTERM)
    out = job.communicate(timeout=120)[0].decode(errors="replace")
    assert "preempted: checkpoint of step" in out, out[-4000:]
    survivor = shardckpt.latest(str(root))
    assert survivor is not None and verify(survivor).ok
    step = shardckpt.open(survivor).step
    assert step is not None and step >= 5 and step % 100 != 0  # written because of the signal, not the cadence
    torchrun(
        2,
        "--ckpt",
        str(root),
        "--steps",
        str(step + 2),
        "--ckpt-every",
        "100",
        "--resume",
        "--loss-log",
        str(tmp_path / "resumed.jsonl"),
    )
    assert sorted(losses(str(tmp_path / "resumed.jsonl"))) == [step + 1, step + 2]


def test_resume_with_more_steps_keeps_the_schedule_length(tmp_path, uninterrupted) -> None:
    """The schedule's length is saved with the scheduler: resuming the 8-step run with --steps 10 follows the same
    lr to step 8 and the final lr after it (it used to re-stretch the decay over 10 steps, raising the lr)."""
    checkpoints, reference = uninterrupted
    checkpoint = os.path.join(checkpoints, f"step-{EVERY:08d}")
    resumed = resume(tmp_path / "longer", checkpoint, 2, STEPS + 2, EVERY)
    for step in range(EVERY + 1, STEPS + 1):
        assert resumed[step]["lr"] == reference[step]["lr"], (step, resumed[step]["lr"], reference[step]["lr"])
    final = reference[STEPS]["lr"]
    assert resumed[STEPS + 1]["lr"] == resumed[STEPS + 2]["lr"] == final
    stretched = resume(tmp_path / "stretched", checkpoint, 2, STEPS + 2, EVERY, "--schedule-steps", str(STEPS + 2))
    assert stretched[STEPS]["lr"] > reference[STEPS]["lr"]  # asked for: the decay now ends at step 10
