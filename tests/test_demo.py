"""`make demo` keeps what it wrote: the logs it points to while it runs are still there when it has finished
(issue 26.11). The training runs are replaced by stand-ins; the real demo is run by hand (`make demo`)."""

from __future__ import annotations

import os
import re
import types

from examples import demo


class _FinishedJob:
    returncode = 0

    def wait(self) -> int:
        return 0


def test_demo_keeps_its_logs_and_checkpoints_after_a_successful_run(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)

    def torchrun(world: int, args: list[str], output: str) -> _FinishedJob:
        with open(output, "a") as log:  # what the real one does: every rank's output goes to `output`
            log.write(f"{world} ranks: {args}\n")
        return _FinishedJob()

    checkpoint = types.SimpleNamespace(step=20)
    monkeypatch.setattr(demo, "torchrun", torchrun)
    monkeypatch.setattr(demo, "wait_for_step", lambda log, step, process: step)
    monkeypatch.setattr(demo, "kill_rank", lambda pid_dir, rank: 4242)
    monkeypatch.setattr(demo, "read_log", lambda path: [{"step": 21, "world": 3, "loss": 1.0}])
    monkeypatch.setattr(demo, "cli_main", lambda argv: 0)
    monkeypatch.setattr(demo, "shardckpt", types.SimpleNamespace(latest=lambda root: root, open=lambda url: checkpoint))
    assert demo.main(["--finetune-steps", "0"]) == 0
    printed = capsys.readouterr().out
    workdir = os.path.dirname(re.search(r"checkpoints every \d+ steps under (\S+)", printed).group(1))
    log = re.search(r"its full output is in (\S+)\)", printed).group(1)
    assert os.path.dirname(log) == workdir
    assert os.path.isfile(log), f"the demo deleted {workdir}, whose log it told the reader to look at"
    assert workdir in printed.splitlines()[-2]  # and it says where everything is, at the end
