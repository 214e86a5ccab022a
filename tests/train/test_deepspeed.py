"""DeepSpeed ZeRO-3 through shardckpt: resume on other world sizes, equal to ds_to_universal, crossing to FSDP2.

Real DeepSpeed 0.19.8 engines on gloo (see FIELD-NOTES): the first run under torchrun, the others' ranks forked
with torchrun's variables by run_like_torchrun (no agent process, torch imported once); a few short launches.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import deepspeed  # noqa: F401  (the tests need the real package: installed by make test, never skipped)
import pytest
import torch

import shardckpt
from shardckpt.errors import ShardckptUsageError
from shardckpt.ops.verify import verify
from shardckpt.statedict.deepspeed import DeepSpeedZero3
from tests.helpers.launch import run_like_torchrun
from tests.helpers.training import TORCH_EXTENSIONS_DIR, losses, resume, torchrun

STEPS, EVERY = 8, 4
WORKER = str(Path(__file__).resolve().parents[1] / "helpers" / "ds_worker.py")
# Across world sizes only the order of float32 sums changes (gradient reduce-scatter, loss all-reduce); measured
# <= 2e-7 relative after 4 steps, so 1e-4 is far above the noise and far below a real error (as test_train.py).
RELATIVE_TOLERANCE = 1e-4
DEEPSPEED = ("--engine", "deepspeed")


def _checkpoint(root: str | Path, step: int = EVERY) -> str:
    return os.path.join(root, f"step-{step:08d}")


def _run(world: int, *command: str) -> None:
    """`torchrun --nproc-per-node world *command` in effect (DeepSpeed's extension cache as torchrun() has it)."""
    run_like_torchrun(world, *command, env={"TORCH_EXTENSIONS_DIR": TORCH_EXTENSIONS_DIR})


def _train(world: int, *args: str) -> None:
    _run(world, "-m", "shardckpt.train", *args)


def _resume(root: Path, checkpoint: str, world: int, *extra: str) -> dict[int, dict]:
    """training.resume until STEPS, its ranks started like _train's."""
    return resume(root, checkpoint, world, STEPS, EVERY, *extra, launch=_train)


@pytest.fixture(scope="module")
def ds_run(tmp_path_factory) -> tuple[str, dict[int, dict]]:
    """8 uninterrupted DeepSpeed steps on 2 ranks, shardckpt checkpoints at steps 4 and 8."""
    root = tmp_path_factory.mktemp("ds")
    log = str(root / "loss.jsonl")
    torchrun(
        2, *DEEPSPEED, "--ckpt", str(root / "ck"), "--steps", str(STEPS), "--ckpt-every", str(EVERY), "--loss-log", log
    )
    return str(root / "ck"), losses(log)


def _relative(a: dict, b: dict) -> float:
    x, y = float.fromhex(a["loss_hex"]), float.fromhex(b["loss_hex"])
    return abs(x - y) / abs(y)


def test_resume_on_the_same_world_size_is_bit_identical(tmp_path, ds_run) -> None:
    checkpoints, reference = ds_run
    resumed = _resume(tmp_path, _checkpoint(checkpoints), 2, *DEEPSPEED)
    assert sorted(resumed) == list(range(EVERY + 1, STEPS + 1))
    assert all(resumed[s]["loss_hex"] == reference[s]["loss_hex"] for s in resumed), (resumed, reference)


@pytest.mark.parametrize("world", [1, 3])
def test_resume_on_another_world_size_matches_within_reduction_order(tmp_path, ds_run, world) -> None:
    checkpoints, reference = ds_run
    resumed = _resume(tmp_path, _checkpoint(checkpoints), world, *DEEPSPEED)
    assert sorted(resumed) == list(range(EVERY + 1, STEPS + 1))
    worst = max(_relative(resumed[s], reference[s]) for s in resumed)
    assert worst <= RELATIVE_TOLERANCE, (worst, resumed, reference)
    assert all(resumed[s]["world"] == world for s in resumed)


def test_checkpoint_holds_fqn_keyed_global_tensors_and_engine_state(ds_run) -> None:
    checkpoint = shardckpt.open(_checkpoint(ds_run[0], STEPS))
    assert verify(checkpoint.url).ok
    tensors = checkpoint.tensors
    assert tensors["model.embed.weight"].shape == (128, 64)
    assert tensors["optim.state.blocks.1.qkv.weight.exp_avg_sq"].shape == (192, 64)
    assert float(checkpoint.read("optim.state.head.weight.step")) == STEPS
    engine = checkpoint.objects["deepspeed"]
    assert engine["global_steps"] == STEPS and engine["dp_world_size"] == 2
    assert engine["loss_scaler"] == {"cur_scale": 1.0, "dynamic": False}
    (group,) = checkpoint.objects["optim.param_groups"]
    assert group["betas"] == (0.9, 0.95) and "embed.weight" in group["params"]
    assert checkpoint.objects["trainer"]["step"] == STEPS and checkpoint.step == STEPS
    # Each of the 2 ranks wrote its half of every parameter: pieces are flat element ranges.
    assert checkpoint.manifest.world_size == 2


WIDER = ("--d-model", "256", "--steps", "2")  # parameters up to 1 MiB: pieces of many 64 KiB checksum blocks


@pytest.fixture(scope="module")
def both(tmp_path_factory) -> Path:
    """One engine after 2 steps on 2 ranks, saved by shardckpt (both/shardckpt) and by DeepSpeed (both/native)."""
    out = tmp_path_factory.mktemp("both")
    _run(2, WORKER, "native", str(out), "--", *DEEPSPEED, "--ckpt", str(out / "unused"), *WIDER)
    return out


def test_every_tensor_equals_deepspeeds_own_universal_checkpoint(tmp_path, both) -> None:
    """Same engine, same step: shardckpt's tensors == ds_to_universal's output from engine.save_checkpoint."""
    universal = tmp_path / "universal"
    subprocess.run(
        [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal"]
        + ["--input_folder", str(both / "native" / "global_step2"), "--output_folder", str(universal)],
        check=True,
        capture_output=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    checkpoint = shardckpt.open(str(both / "shardckpt"))
    zero = universal / "zero"
    params = sorted(p.name for p in zero.iterdir() if p.is_dir())
    assert len(params) == 29
    for param in params:
        for key, name in (("fp32", f"model.{param}"), ("exp_avg", None), ("exp_avg_sq", None)):
            name = name or f"optim.state.{param}.{key}"
            theirs = torch.load(zero / param / f"{key}.pt", weights_only=True)  # our own test output: trusted
            theirs = theirs["param"] if isinstance(theirs, dict) else theirs
            ours = checkpoint.read(name)
            # ds_to_universal keeps ZeRO-3 tensors flat; the elements must be identical.
            assert theirs.numel() == ours.numel() and torch.equal(theirs.reshape(-1), ours.reshape(-1)), name
            assert float(checkpoint.read(f"optim.state.{param}.step")) == 2
    assert set(checkpoint.tensors) == {f"model.{p}" for p in params} | {
        f"optim.state.{p}.{k}" for p in params for k in ("exp_avg", "exp_avg_sq", "step")
    }


def _engine_tensors(url: str) -> dict[str, torch.Tensor]:
    checkpoint = shardckpt.open(url)
    return {n: checkpoint.read(n) for n in checkpoint.tensors if n.startswith(("model.", "optim.state."))}


def test_deepspeed_to_fsdp2_to_deepspeed_keeps_every_parameter_and_moment(tmp_path, ds_run) -> None:
    """DeepSpeed (2 ranks) -> FSDP2 (3 ranks) -> DeepSpeed (1 rank): each engine loads, then saves what it holds."""
    source = _checkpoint(ds_run[0], STEPS)  # the newest under its root: what the FSDP2 trainer resumes
    fsdp = tmp_path / "fsdp2"
    _run(3, WORKER, "resave", str(fsdp), "--", "--ckpt", os.path.dirname(source), "--steps", "8")
    back = tmp_path / "back"
    _run(1, WORKER, "resave", str(back), "--", *DEEPSPEED, "--ckpt", str(tmp_path), "--steps", "8")
    original, via_fsdp, via_both = _engine_tensors(source), _engine_tensors(str(fsdp)), _engine_tensors(str(back))
    assert set(original) == set(via_fsdp) == set(via_both)
    for name, tensor in original.items():
        assert torch.equal(tensor, via_fsdp[name]), name
        assert torch.equal(tensor, via_both[name]), name
    assert shardckpt.open(str(back)).objects["trainer"]["step"] == STEPS


def test_fsdp2_loop_resumes_a_deepspeed_checkpoint(tmp_path, ds_run) -> None:
    """The FSDP2 loop resumes a DeepSpeed checkpoint (3 ranks) and its losses follow the DeepSpeed run."""
    checkpoints, reference = ds_run
    resumed = _resume(tmp_path, _checkpoint(checkpoints), 3)
    worst = max(_relative(resumed[s], reference[s]) for s in resumed)
    assert sorted(resumed) == list(range(EVERY + 1, STEPS + 1)) and worst <= RELATIVE_TOLERANCE, worst


def test_each_rank_reads_only_its_own_partitions(tmp_path, both) -> None:
    """2 -> 3 ranks, loaded with max_gap=0 (gaps never read through)."""
    source, stats = str(both / "shardckpt"), tmp_path / "stats"
    _run(3, WORKER, "load-stats", str(stats), "--", *DEEPSPEED, "--ckpt", source, *WIDER)
    ranks = [json.loads((stats / f"rank-{r}.json").read_text()) for r in range(3)]
    checkpoint = shardckpt.open(source)
    shapes = [info.shape for n, info in checkpoint.tensors.items() if n.startswith("model.")]
    total = 3 * 4 * sum(math.prod(shape) for shape in shapes)
    # Weights + two moments, each element needed by exactly one rank; every rank needs every 4-byte step.
    assert sum(r["needed"] for r in ranks) == total + 3 * 4 * len(shapes)
    # Loaded with max_gap=0, a rank fetches beyond that only the rest of the 64 KiB checksum blocks at the two
    # ends of each request; over all ranks that stays a small share of the checkpoint.
    assert all(r["needed"] <= r["fetched"] <= r["needed"] + r["requests"] * 2 * (64 << 10) for r in ranks), ranks
    assert sum(r["fetched"] for r in ranks) <= 1.25 * total, (ranks, total)


def test_bf16_engine_saves_fp32_masters_and_loads_them_on_three_ranks(tmp_path) -> None:
    """Mixed precision: bf16 module weights over fp32 masters; after 2 -> 3 ranks DeepSpeed's own full fp32
    parameters and moments equal the checkpoint's, and every gathered bf16 weight is the master rounded."""
    bf16 = (*DEEPSPEED, "--bf16", "--global-batch", "6", "--steps", "2", "--ckpt-every", "2")
    _train(2, *bf16, "--ckpt", str(tmp_path / "ck"))
    source = _checkpoint(tmp_path / "ck", 2)
    assert shardckpt.open(source).tensors["model.embed.weight"].dtype == torch.float32
    _run(3, WORKER, "check-full", str(tmp_path / "check"), "--", *bf16, "--ckpt", source)
    for rank in range(3):
        result = json.loads((tmp_path / "check" / f"rank-{rank}.json").read_text())
        assert result == {"wrong": [], "dtype": "torch.bfloat16", "step": 2}, result


def test_adapter_refuses_engines_it_cannot_save() -> None:
    class NotZero3:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)

    with pytest.raises(ShardckptUsageError, match="not a DeepSpeed ZeRO stage 3 optimizer"):
        DeepSpeedZero3(NotZero3())


def test_benchmark_smoke(tmp_path, capsys, monkeypatch) -> None:
    """`python -m benchmarks.ds_engine` end to end at a tiny size: every row printed, the JSON written. Its main
    runs here, as tests/bench runs the other benchmarks' (the ranks it launches are forked like every test's)."""
    from benchmarks.ds_engine import main

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", TORCH_EXTENSIONS_DIR)  # main would set it for the whole session
    report = tmp_path / "ds_engine.json"
    tiny = ["--d-model", "64", "--layers", "1", "--vocab", "128", "--repeats", "1", "--warm"]
    code = main([*tiny, "--json", str(report), "--dir", str(tmp_path)])
    printed = capsys.readouterr().out
    assert code == 0, printed[-3000:]
    for row in ("durable save, 2 ranks", "load 2 -> 2, warm", "load 2 -> 3, warm (+ds_to_universal)"):
        assert row in printed, printed
    result = json.loads(report.read_text())
    assert result["same_world"]["save"]["shardckpt"] > 0 and result["resharded"]["load_warm"]["universal"] > 0
