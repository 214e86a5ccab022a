"""Launch `world` ranks of tests/dist_worker.py as real processes (gloo on 127.0.0.1), like torchrun does.

Returns each rank's JSON verdict; a rank that wrote none (it crashed or hung past the timeout) maps to None.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

WORKER = Path(__file__).resolve().parent / "dist_worker.py"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_ranks(
    scenario: str, world: int, args: dict, timeout: float = 180.0, worker: Path = WORKER
) -> list[dict | None]:
    with tempfile.TemporaryDirectory() as result_dir:
        args = {**args, "result_dir": result_dir}
        port = free_port()
        processes = []
        for rank in range(world):
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
            }
            processes.append(
                subprocess.Popen(
                    [sys.executable, str(worker), scenario, json.dumps(args)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                )
            )
        deadline = time.monotonic() + timeout
        outputs = []
        for process in processes:
            try:
                out, _ = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                out, _ = process.communicate()
            outputs.append(out.decode(errors="replace"))
        results: list[dict | None] = []
        for rank in range(world):
            path = Path(result_dir) / f"rank-{rank}.json"
            result = json.loads(path.read_text()) if path.exists() else None
            if result is not None and not result.get("ok"):
                result["output"] = outputs[rank][-4000:]
            results.append(result)
        return results


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
