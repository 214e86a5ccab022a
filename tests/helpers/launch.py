"""Launch `world` ranks of a worker script (tests/helpers/dist_worker.py by default) on gloo at 127.0.0.1.

Ranks are forked from a server that has imported torch once; each returns its JSON verdict (None: it died or hung).
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping
from multiprocessing import popen_forkserver, spawn
from pathlib import Path
from typing import Any
from unittest import mock

WORKER = Path(__file__).resolve().parent / "dist_worker.py"
# What the fork server imports before it forks any rank: importing these costs ~3.5 s of CPU per process, the rest
# of a worker (shardckpt, its tests) ~0.2 s. Only imports: no torch op runs there and no thread starts (checked
# below), so a forked rank is as clean as a fresh interpreter. shardckpt itself is imported fresh by every rank, as
# its knobs read SHARDCKPT_* from the environment at import and a test may set them.
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.device_mesh",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "safetensors.torch",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank_process(command: list[str], env: dict[str, str], output: str) -> None:
    """A forked rank: this rank's environment and output file, then `python *command` in effect (a script and
    its arguments, or -m module and its arguments)."""
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # The server's environment is that of the first launch; a test may have changed it since (S3 credentials).
    os.environ.clear()
    os.environ.update(env)
    import torch

    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # OpenMP read the variable when the server loaded torch
    code = 0
    try:
        if command[0] == "-m":
            sys.argv = [command[1], *command[2:]]
            sys.path.insert(0, os.getcwd())  # as `python -m module` has it
            runpy.run_module(command[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(command)
            sys.path.insert(0, os.path.dirname(command[0]))  # as `python script.py` has it
            runpy.run_path(command[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as serve_rank: no interpreter teardown after the verdict (gloo may abort at exit)


_preparation_data = spawn.get_preparation_data


def _preparation_without_main(name: str) -> dict[str, Any]:
    data = _preparation_data(name)
    data.pop("init_main_from_name", None)
    data.pop("init_main_from_path", None)
    return data


class _RankPopen(popen_forkserver.Popen):
    """multiprocessing's forkserver Popen, except that the rank does not import the launcher's __main__ (pytest, a
    benchmark): that would import shardckpt before the rank's environment is set, and cost time for nothing."""

    def _launch(self, process_obj: Any) -> None:
        with mock.patch.object(spawn, "get_preparation_data", _preparation_without_main):
            super()._launch(process_obj)


class _RankProcess(multiprocessing.context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> _RankPopen:
        return _RankPopen(process_obj)


def start_fork_server() -> None:
    """The fork server, started (once per process) with PRELOAD to import and one OpenMP thread."""
    multiprocessing.forkserver.set_forkserver_preload(PRELOAD)
    with mock.patch.dict(os.environ, {"OMP_NUM_THREADS": "1"}):
        multiprocessing.forkserver.ensure_running()


def _check_fork_server(processes: list[multiprocessing.process.BaseProcess]) -> None:
    """Refuse ranks forked from a server that runs threads (a fork may copy a lock another thread held), killing
    them; a started rank means the server has finished importing PRELOAD."""
    server = multiprocessing.forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    threads = len(os.listdir(f"/proc/{server}/task"))
    if threads != 1:
        for process in processes:
            process.kill()
            process.join()
        raise RuntimeError(f"the rank fork server (pid {server}) runs {threads} threads; it must run one")


def _launch(world: int, command: list[str], output_dir: str, timeout: float, env: Mapping[str, str]) -> list[int]:
    """`python *command` on `world` ranks with torchrun's variables; each rank's exit code (-9: SIGKILLed,
    also when still running `timeout` seconds after the launch). Rank r's output goes to output_dir/rank-<r>.out."""
    start_fork_server()
    port = free_port()
    processes = []
    for rank in range(world):
        variables = {
            **os.environ,
            **env,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        output = os.path.join(output_dir, f"rank-{rank}.out")
        process = _RankProcess(target=_rank_process, args=(command, variables, output))
        process.start()
        processes.append(process)
    _check_fork_server(processes)
    deadline = time.monotonic() + timeout
    for process in processes:
        process.join(max(1.0, deadline - time.monotonic()))
        if process.exitcode is None:
            process.kill()
            process.join()
    return [int(process.exitcode) for process in processes]  # type: ignore[arg-type]  (joined: not None)


def _output(output_dir: str, rank: int) -> str:
    path = Path(output_dir) / f"rank-{rank}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def run_ranks(
    scenario: str, world: int, args: dict, timeout: float = 180.0, worker: Path = WORKER
) -> list[dict | None]:
    """Run `worker scenario args` on `world` ranks (torchrun's environment variables); each rank's verdict.

    A rank still running `timeout` seconds after the launch is SIGKILLed; a failed verdict carries the rank's output.
    """
    with tempfile.TemporaryDirectory() as result_dir:
        command = [str(worker), scenario, json.dumps({**args, "result_dir": result_dir})]
        _launch(world, command, result_dir, timeout, {})
        results: list[dict | None] = []
        for rank in range(world):
            path = Path(result_dir) / f"rank-{rank}.json"
            result = json.loads(path.read_text()) if path.exists() else None
            if result is not None and not result.get("ok"):
                result["output"] = _output(result_dir, rank)[-4000:]
            results.append(result)
        return results


def run_like_torchrun(
    world: int, *command: str, timeout: float = 300.0, env: Mapping[str, str] | None = None
) -> list[str]:
    """What `torchrun --standalone --nproc-per-node world *command` runs (a script or -m module, with arguments),
    its ranks forked as run_ranks forks them; each rank's output. A rank that exits other than 0 fails the test."""
    with tempfile.TemporaryDirectory() as output_dir:
        codes = _launch(world, list(command), output_dir, timeout, env or {})
        outputs = [_output(output_dir, rank) for rank in range(world)]
    failed = {rank: code for rank, code in enumerate(codes) if code != 0}
    if failed:
        import pytest  # here: benchmarks import this module too

        reports = "\n".join(f"rank {rank} exit {code}:\n{outputs[rank][-3000:]}" for rank, code in failed.items())
        pytest.fail(f"{' '.join(command)} on {world} ranks failed: {failed}\n{reports}")
    return outputs


def serve_rank(names: Mapping[str, Any], default_timeout: float) -> None:
    """The body of a worker script that run_ranks starts: join the gloo group, run `scenario_<argv[1]>` from
    `names` (the worker's globals) with the JSON args of argv[2], write this rank's verdict, and leave at once
    (gloo may abort at interpreter exit, FIELD-NOTES: the verdict is written already)."""
    import datetime

    import torch.distributed as dist

    scenario, args = sys.argv[1], json.loads(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=float(args.get("timeout", default_timeout)))
    dist.init_process_group("gloo", timeout=timeout)
    try:
        result = {"ok": True, "value": names[f"scenario_{scenario}"](args, rank, world)}
    except Exception as exc:
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    with open(os.path.join(args["result_dir"], f"rank-{rank}.json"), "w") as handle:
        json.dump(result, handle)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
