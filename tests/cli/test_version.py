"""`shardckpt --version` names the newest checkpoint format the build reads and writes (SPEC 2.1)."""

from __future__ import annotations

import pytest

from shardckpt.cli.main import main


def test_version_names_the_newest_format(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    shown = capsys.readouterr().out
    # Incremental saves write 1.1: a version line that says 1.0 sends users of 1.1 files to the wrong reader.
    assert "(checkpoint format 1.1: reads and writes 1.0 and 1.1)\n" in shown, shown
