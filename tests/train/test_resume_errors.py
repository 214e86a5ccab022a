"""A resume that cannot load says so once, with the flag that fixes it (issue 26.10): a --freeze-base run resumed
without --freeze-base, through the real launcher (torchrun, the bundled loop)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.training import torchrun

pytestmark = pytest.mark.dist


def test_resuming_a_frozen_base_run_without_the_flag_says_it_once_with_the_hint(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    common = ["--ckpt", str(root), "--ckpt-every", "2", "--cpu", "--layers", "3"]
    torchrun(2, *common, "--steps", "2", "--freeze-base")
    job = torchrun(2, *common, "--steps", "4", "--resume", wait=False)
    out, _ = job.communicate(timeout=300)
    text = out.decode(errors="replace")
    assert job.returncode != 0, text[-4000:]
    assert text.count("lacks ") == 1, text[-6000:]
    assert "pass --freeze-base to resume it" in text, text[-6000:]
    assert "ranks 0-1: " in text, text[-6000:]  # one clause for both ranks' identical cause
