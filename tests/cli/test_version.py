"""`shardckpt --version` names the newest checkpoint format the build reads and writes (SPEC 2.1)."""

from __future__ import annotations

import pytest

from shardckpt.cli.main import main


def test_version_names_the_newest_format(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    shown = capsys.readouterr().out
    # Incremental saves write 1.1, compressed saves and saves of many tensors 1.2: a version line that says 1.0 sends
    # their users to the wrong reader.
    assert "(checkpoint format 1.2: reads and writes 1.0 to 1.2)\n" in shown, shown
