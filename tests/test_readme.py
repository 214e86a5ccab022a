"""Every Python snippet of README.md and of the documentation site (docs/) runs as written: extracted from the pages
themselves, so they cannot drift.

Each runs in a fresh interpreter (under torchrun where the page says so), with only its /tmp root (or S3 bucket)
moved to a fresh place, so that parallel runs do not share one. A new snippet fails here until it has a runner; a
snippet shown on several pages (the README's quickstart is the training-loop page's) must be the same everywhere,
and runs once.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.helpers.training import TORCH_EXTENSIONS_DIR

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
SNIPPETS = [
    (page.relative_to(REPO).as_posix(), text)
    for page in PAGES
    for text in re.findall(r"^```python\n(.*?)^```$", page.read_text(), flags=re.DOTALL | re.MULTILINE)
]


def snippet(marker: str) -> str:
    """The snippet that contains `marker` (the same text on every page that shows it)."""
    found = {text for _, text in SNIPPETS if marker in text}
    where = [page for page, text in SNIPPETS if marker in text]
    assert len(found) == 1, f"{len(found)} different snippets contain {marker!r} (in {where})"
    return found.pop()


# The phrase that identifies each snippet; every snippet must have exactly one (and so a test below).
MARKERS = {
    "training loop": 'shardckpt.latest("/tmp/ckpts")',
    "checkpointer": '"/tmp/managed",',
    "deepspeed": "deepspeed.initialize(",
    "direct read": 'shardckpt.latest("/tmp/run")',
    "s3": '"s3://bucket/run',
    "dcp": 'shardckpt.latest("/tmp/dcp-run")',
    "incremental checkpointer": "incremental=True,",
    "save parent": 'parent=f"{root}/step-00000001"',
    "torch_checkpointing": 'ShardckptStorageConfig(root="/tmp/tc-run")',
    "compression": '"/tmp/zstd-run/step-00000100"',
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
    for page, text in SNIPPETS:
        names = [name for name, marker in MARKERS.items() if marker in text]
        assert len(names) == 1, f"a python snippet of {page} matches {names or 'no marker'}:\n{text[:300]}"
    assert {name for _, text in SNIPPETS for name, marker in MARKERS.items() if marker in text} == set(MARKERS)
    assert sum(1 for page, _ in SNIPPETS if page == "README.md") >= 1, "the README lost its quickstart"


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


def test_s3_snippet_creates_its_bucket_on_a_fresh_store_and_saves_the_step(tmp_path, s3_env) -> None:
    import shardckpt

    bucket = f"docs-{uuid.uuid4().hex[:12]}"  # a bucket the server does not have: the snippet must create it
    code = snippet(MARKERS["s3"]).replace('"bucket"', f'"{bucket}"').replace("s3://bucket/", f"s3://{bucket}/")
    assert bucket in code and "s3://bucket/" not in code
    assert f"s3://{bucket}/run/step-00000100" in run(code, tmp_path)
    assert f"s3://{bucket}/run/step-00000200" in run(code, tmp_path)  # run again: the next step, at a new URL
    for step in (100, 200):
        checkpoint = shardckpt.open(f"s3://{bucket}/run/step-{step:08d}")
        assert checkpoint.read("w").tolist() == [step + i for i in range(8)] and checkpoint.step == step


@pytest.mark.dist
def test_dcp_snippet_resumes_on_another_world_size(tmp_path) -> None:
    """Run as the page says, then again on 3 ranks: it continues from the 2-rank checkpoint (issue 26.11)."""
    import shardckpt

    root = tmp_path / "dcp-run"
    code = snippet(MARKERS["dcp"]).replace("/tmp/dcp-run", str(root))
    assert "resumed from None, saved step 1" in run(code, tmp_path, ranks=2)
    output = run(code, tmp_path, ranks=3)
    assert f"rank 2 of 3: resumed from {root / 'step-00000001'}, saved step 2" in output
    checkpoint = shardckpt.open(str(root / "step-00000002"))
    assert (checkpoint.step, checkpoint.manifest.world_size, checkpoint.objects["step"]) == (2, 3, 2)
    assert shardckpt.latest(str(root)).endswith("step-00000002")


def test_incremental_checkpointer_snippet_writes_only_the_head_and_continues_its_series(tmp_path) -> None:
    root = tmp_path / "finetune"
    code = snippet(MARKERS["incremental checkpointer"]).replace("/tmp/finetune", str(root))
    output = run(code, tmp_path)
    saves = re.findall(r"step (\d+): wrote (\d+) of (\d+) bytes \((full|incremental on step-\d+)\)", output)
    assert [(int(step), kind) for step, _, _, kind in saves] == [
        (2, "full"),
        (4, "incremental on step-00000002"),
        (6, "incremental on step-00000004"),
        (8, "full"),
    ], output
    for _, wrote, logical, kind in saves:  # an incremental save writes the head (2% of the state) and manifests
        assert int(wrote) < int(logical) / 20 if kind != "full" else int(wrote) >= int(logical)
    # A restarted job continues the series: its first save is incremental on the newest checkpoint.
    again = run(code, tmp_path)
    assert re.search(r"^step 10: wrote \d+ of \d+ bytes \(incremental on step-00000008\)$", again, re.MULTILINE), again


def test_save_parent_snippet_stores_the_unchanged_tensor_by_reference(tmp_path) -> None:
    code = snippet(MARKERS["save parent"]).replace('prefix="series-"', f'prefix="series-", dir="{tmp_path}"')
    assert str(tmp_path) in code
    output = run(code, tmp_path)
    rows = re.findall(r"^(\S+)/step-0000000(\d) (\d+) (\S+)$", output, re.MULTILINE)
    assert [(step, value) for _, step, _, value in rows] == [("1", "0.0"), ("2", "1.0")], output
    first, second = (int(size) for _, _, size, _ in rows)
    assert first > 4 << 20 and second < 128 << 10, output  # the 4 MiB frozen tensor is stored once
    assert rows[0][0].startswith(str(tmp_path))  # a new root per run (under the test's own directory here)


def test_torch_checkpointing_snippet_saves_its_format_and_loads_a_shardckpt_checkpoint(tmp_path) -> None:
    root = tmp_path / "tc-run"
    code = snippet(MARKERS["torch_checkpointing"]).replace("/tmp/tc-run", str(root))
    run(code, tmp_path)
    assert sorted(os.listdir(root)) == ["step-200", "step_100"]  # its rename committed step_100; no tmp_ left


def test_compression_snippet_saves_compressed_and_reads_a_box(tmp_path) -> None:
    import shardckpt

    url = tmp_path / "zstd-run" / "step-00000100"
    output = run(snippet(MARKERS["compression"]).replace("/tmp/zstd-run", str(tmp_path / "zstd-run")), tmp_path)
    percent = int(output.split("bytes (")[1].split("%")[0])
    assert 50 < percent < 90, output
    assert shardckpt.open(str(url)).manifest.version >= (1, 2)
