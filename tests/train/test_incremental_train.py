"""The bundled loop with --freeze-base --incremental: checkpoints after a full one reference the unchanged state
and write a small part of it, and the log says how much."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers.training import torchrun

pytestmark = pytest.mark.dist


def test_a_frozen_base_run_writes_small_incremental_checkpoints(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    args = ["--ckpt", str(root), "--steps", "6", "--ckpt-every", "2", "--cpu", "--layers", "8"]
    job = torchrun(2, *args, "--keep-last", "5", "--freeze-base", "--incremental", "--full-every", "3", wait=False)
    out, _ = job.communicate(timeout=300)
    text = out.decode(errors="replace")
    if job.returncode != 0:
        pytest.fail(text[-6000:])
    lines = re.findall(
        r"checkpoint step (\d+): wrote (\d+) bytes of (\d+) logical \(.*?, (full|incremental on \S+)\)", text
    )
    assert [(int(step), kind) for step, _, _, kind in lines] == [
        (2, "full"),
        (4, "incremental on step-00000002"),
        (6, "incremental on step-00000004"),
    ]
    full, *incremental = [(int(written), int(logical)) for _, written, logical, _ in lines]
    assert full[0] >= full[1]  # the full one writes everything (plus headers)
    for written, logical in incremental:
        if not written < logical / 2:  # 7 of 8 blocks and the embeddings frozen (trainable: AdamW state too)
            pytest.fail(f"an incremental checkpoint wrote {written} of {logical} bytes:\n{text[-3000:]}")
    marker = json.loads((root / "step-00000006" / "COMMITTED").read_text())
    # The frozen state is referenced where it lies (step 2's files), never through step 4 (no chains).
    assert "step-00000002" in [entry["checkpoint"] for entry in marker["references"]]
