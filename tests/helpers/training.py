"""Running the bundled training loop (and workers built on it) under torchrun from tests, and reading its loss log.

Shared by the FSDP2 and DeepSpeed training tests.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

# Where DeepSpeed caches the small communication extension it compiles at start-up (~30 s, once per machine).
TORCH_EXTENSIONS_DIR = str(Path(sys.prefix) / "torch_extensions")


def torchrun(world: int, *args: str, wait: bool = True, script: str | None = None) -> subprocess.Popen[bytes]:
    """`torchrun --nproc-per-node world -m shardckpt.train args` (or `script args`); waits and checks exit 0."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    target = [script] if script else ["-m", "shardckpt.train"]
    process = subprocess.Popen(
        [*command, *target, *args],
        env={**os.environ, "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": TORCH_EXTENSIONS_DIR},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    if wait:
        out, _ = process.communicate(timeout=300)
        assert process.returncode == 0, out.decode(errors="replace")[-6000:]
    return process


def losses(path: str) -> dict[int, dict]:
    """The loss log's rows by step; a last line not yet ended by its newline (the job is writing it) is left out."""
    with open(path) as handle:
        lines = handle.read().split("\n")[:-1]
    return {row["step"]: row for row in map(json.loads, lines)}


def logged_step(path: str) -> int:
    """The highest step in the loss log so far: 0 while the log is absent or empty (a job polled while it starts)."""
    return max(losses(path), default=0) if os.path.exists(path) else 0


def resume(
    root: Path,
    checkpoint: str,
    world: int,
    steps: int,
    every: int,
    *extra: str,
    launch: Callable[..., object] | None = None,
) -> dict[int, dict]:
    """Copy one checkpoint under a fresh root, resume from it on `world` ranks until `steps`; the loss log.
    launch(world, *train_args): how the loop is started (default: torchrun)."""
    shutil.copytree(checkpoint, root / "ck" / os.path.basename(checkpoint))
    log = str(root / "loss.jsonl")
    (launch or torchrun)(
        world,
        "--ckpt",
        str(root / "ck"),
        "--steps",
        str(steps),
        "--ckpt-every",
        str(every),
        "--resume",
        "--loss-log",
        log,
        *extra,
    )
    return losses(log)
