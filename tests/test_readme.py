"""Every Python snippet of README.md runs as written: extracted from the README itself, so they cannot drift.

Each runs in a fresh interpreter (under torchrun where the README says so), with only its /tmp root (or S3 bucket)
moved to a fresh place, so that parallel runs do not share one. A new snippet fails here until it has a runner.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.checkpoints import S3_BUCKET
from tests.helpers.training import TORCH_EXTENSIONS_DIR

README = Path(__file__).resolve().parents[1] / "README.md"
SNIPPETS = re.findall(r"^```python\n(.*?)^```$", README.read_text(), flags=re.DOTALL | re.MULTILINE)


def snippet(marker: str) -> str:
    """The one README snippet that contains `marker`."""
    found = [text for text in SNIPPETS if marker in text]
    assert len(found) == 1, f"{len(found)} README snippets contain {marker!r}"
    return found[0]


# The phrase that identifies each snippet; every snippet must have exactly one (and so a test below).
MARKERS = {
    "training loop": 'shardckpt.latest("/tmp/ckpts")',
    "checkpointer": "shardckpt.Checkpointer(",
    "deepspeed": "deepspeed.initialize(",
    "direct read": 'shardckpt.latest("/tmp/run")',
    "s3": '"s3://bucket/run',
    "dcp": 'shardckpt.dcp.StorageWriter("/tmp/dcp-run',
}


FINISHED = "README-SNIPPET-FINISHED"


def run(code: str, tmp_path: Path, *, ranks: int = 0, timeout: float = 300) -> str:
    """Run `code` as a script (under torchrun with `ranks` ranks when ranks > 0); its output, exit 0 checked."""
    script = tmp_path / "snippet.py"
    # Each process says it reached the end of the snippet; the verdict is taken from that, because gloo with DTensor
    # can abort at interpreter exit after a clean run (FIELD-NOTES: "terminate called without an active exception").
    script.write_text(code + f'\nprint("{FINISHED}", flush=True)\n')
    command = [sys.executable, str(script)]
    if ranks:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={ranks}",
            str(script),
        ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TORCH_EXTENSIONS_DIR": TORCH_EXTENSIONS_DIR,
        "PYTHONWARNINGS": "ignore",
    }
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    finished = output.count(FINISHED) == max(ranks, 1)
    exit_abort = "terminate called without an active exception" in output
    assert done.returncode == 0 or (finished and exit_abort), output[-6000:]
    if not finished:
        pytest.fail(f"not every process reached the end of the snippet:\n{output[-6000:]}")
    return output


def test_every_python_snippet_has_a_runner() -> None:
    covered = [name for text in SNIPPETS for name, marker in MARKERS.items() if marker in text]
    assert len(SNIPPETS) == len(MARKERS) and sorted(covered) == sorted(MARKERS), (len(SNIPPETS), covered)


@pytest.mark.dist
def test_training_loop_snippet_saves_and_resumes_on_another_world_size(tmp_path) -> None:
    import shardckpt

    root = tmp_path / "ckpts"
    code = snippet(MARKERS["training loop"]).replace("/tmp/ckpts", str(root))
    run(code, tmp_path, ranks=2)
    assert shardckpt.latest(str(root)).endswith("step-00000010")
    run(code, tmp_path, ranks=3)  # continues from step 10 on 3 ranks: the third rank keeps its own RNG state
    latest = shardckpt.latest(str(root))
    assert latest.endswith("step-00000020") and shardckpt.open(latest).manifest.world_size == 3


def test_checkpointer_snippet_saves_then_resumes(tmp_path) -> None:
    root = tmp_path / "managed"
    code = snippet(MARKERS["checkpointer"]).replace("/tmp/managed", str(root))
    assert "trained to step 30" in run(code, tmp_path)
    assert sorted(os.listdir(root)) == ["step-00000020", "step-00000030"]
    assert "trained to step 60" in run(code, tmp_path)  # restore_latest found step 30
    assert sorted(os.listdir(root)) == ["step-00000050", "step-00000060"]


@pytest.mark.dist
@pytest.mark.deepspeed
def test_deepspeed_snippet_saves_and_resumes_with_its_client_state(tmp_path) -> None:
    import shardckpt

    root = tmp_path / "ds"
    code = snippet(MARKERS["deepspeed"]).replace("/tmp/ds-ckpts", str(root))
    assert "step 5, data position 40" in run(code, tmp_path, ranks=2, timeout=600)
    # The second run on one rank (a whole DeepSpeed start-up less): it resumes on another world size, as the README
    # says load_deepspeed does, and its client state comes back with the engine's.
    assert "step 10, data position 80" in run(code, tmp_path, ranks=1, timeout=600)
    worlds = [shardckpt.open(str(root / f"step-{step:08d}")).manifest.world_size for step in (5, 10)]
    assert worlds == [2, 1], worlds


@pytest.mark.dist
def test_direct_read_snippet_fits_the_bundled_model(tmp_path) -> None:
    root = tmp_path / "run"
    train = [sys.executable, "-m", "shardckpt.train", "--ckpt", str(root), "--steps", "2", "--ckpt-every", "2"]
    done = subprocess.run(
        train, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    output = run(snippet(MARKERS["direct read"]).replace("/tmp/run", str(root)), tmp_path)
    assert "torch.Size([32, 64])" in output


def test_s3_snippet_saves_to_the_bucket(tmp_path, s3_url) -> None:
    import shardckpt

    code = snippet(MARKERS["s3"]).replace("s3://bucket/run", s3_url)
    output = run(code, tmp_path)
    assert f"{s3_url}/step-00000100" in output
    assert shardckpt.open(f"{s3_url}/step-00000100").read("w").tolist() == list(range(8))
    assert s3_url.startswith(f"s3://{S3_BUCKET}/")


@pytest.mark.dist
def test_dcp_snippet_saves_and_loads_through_the_dcp_backend(tmp_path) -> None:
    import shardckpt

    root = tmp_path / "dcp-run"
    run(snippet(MARKERS["dcp"]).replace("/tmp/dcp-run", str(root)), tmp_path, ranks=2)
    checkpoint = shardckpt.open(str(root / "step-1"))
    assert (checkpoint.step, checkpoint.manifest.world_size, checkpoint.objects["step"]) == (1, 2, 1)
