"""`make demo`: train on 4 ranks with checkpoints, kill -9 one rank mid-run, resume on 3 ranks, finish, inspect;
then fine-tune with a frozen base and incremental checkpoints, and show the bytes each checkpoint wrote.

Runs the bundled FSDP2 training loop under torchrun three times and prints the loss curve across the crash.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import shardckpt
from shardckpt.cli import main as cli_main


def torchrun(world: int, train_args: list[str], output: str) -> subprocess.Popen[bytes]:
    """Launch the training loop; its [train] lines are echoed, everything else goes to `output`."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    command += ["-m", "shardckpt.train", *train_args]
    process = subprocess.Popen(
        command, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )

    def echo() -> None:
        assert process.stdout is not None
        with open(output, "ab") as sink:
            for line in process.stdout:
                sink.write(line)
                if line.startswith(b"[train]"):
                    sys.stdout.write("  " + line.decode(errors="replace"))
                    sys.stdout.flush()

    threading.Thread(target=echo, daemon=True).start()
    return process


def read_log(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def wait_for_step(log: str, step: int, process: subprocess.Popen[bytes], timeout: float = 600) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = read_log(log)
        if rows and rows[-1]["step"] >= step:
            return int(rows[-1]["step"])
        if process.poll() is not None:
            raise SystemExit(f"demo: training exited early with code {process.returncode}")
        time.sleep(0.05)
    raise SystemExit("demo: training did not reach the kill step in time")


def kill_rank(pid_dir: str, rank: int) -> int:
    with open(os.path.join(pid_dir, f"rank-{rank}.pid")) as handle:
        pid = int(handle.read())
    os.kill(pid, signal.SIGKILL)
    return pid


def loss_curve(rows: list[dict[str, Any]], resumed_at: int, width: int = 50) -> None:
    low, high = min(r["loss"] for r in rows), max(r["loss"] for r in rows)
    print(f"\n  step  world  loss      (bar: {low:.3f} .. {high:.3f})")
    for row in rows:
        filled = round((row["loss"] - low) / max(high - low, 1e-12) * width)
        marker = "  <- resumed here" if row["step"] == resumed_at + 1 else ""
        print(f"  {row['step']:4d}  {row['world']:5d}  {row['loss']:.4f}  {'#' * max(filled, 1)}{marker}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", help="working directory, kept afterwards (default: a new one under demo-out/)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--ckpt-every", type=int, default=5)
    parser.add_argument("--kill-at", type=int, default=23, help="kill a rank once this step is logged")
    parser.add_argument("--finetune-steps", type=int, default=8, help="steps of the frozen-base run (0: skip it)")
    args = parser.parse_args(argv)
    workdir = args.dir or new_workdir()
    root, pid_dir = os.path.join(workdir, "checkpoints"), os.path.join(workdir, "pids")
    log_first, log_second = os.path.join(workdir, "loss-4.jsonl"), os.path.join(workdir, "loss-3.jsonl")
    common = ["--ckpt", root, "--steps", str(args.steps), "--ckpt-every", str(args.ckpt_every), "--keep-last", "3"]

    print(f"demo: training on 4 ranks (FSDP2, gloo), checkpoints every {args.ckpt_every} steps under {root}")
    output = os.path.join(workdir, "torchrun.log")
    first = torchrun(4, [*common, "--loss-log", log_first, "--pid-dir", pid_dir], output)
    reached = wait_for_step(log_first, args.kill_at, first)
    pid = kill_rank(pid_dir, 2)
    print(f"\ndemo: step {reached} reached: kill -9 rank 2 (pid {pid})")
    code = first.wait()
    print(f"demo: the 4-rank job died (torchrun exit code {code}; its full output is in {output})")
    print("demo: what is on storage now:")
    cli_main(["ls", root])
    latest = shardckpt.latest(root)
    if latest is None:
        raise SystemExit("demo: no committed checkpoint survived")
    resumed_at = shardckpt.open(latest).step or 0
    print(f"\ndemo: resuming on 3 ranks from {latest} (step {resumed_at})")
    second = torchrun(3, [*common, "--resume", "--loss-log", log_second], output)
    if second.wait() != 0:
        raise SystemExit(f"demo: the resumed job failed with code {second.returncode}")
    rows = [r for r in read_log(log_first) if r["step"] <= resumed_at] + read_log(log_second)
    loss_curve(rows, resumed_at)
    final = shardckpt.latest(root)
    assert final is not None
    print(f"\ndemo: shardckpt inspect {final}")
    cli_main(["inspect", final])
    print("demo: shardckpt verify")
    code = cli_main(["verify", final])
    if code == 0 and args.finetune_steps > 0:
        code = finetune(workdir, args.finetune_steps)
    # Kept, never removed: the logs it pointed to along the way are what a reader wants to look at afterwards.
    print(f"\ndemo: everything it wrote is kept in {workdir} ({', '.join(sorted(os.listdir(workdir)))}):")
    print("demo: the .log files hold every rank's output, loss-*.jsonl the loss per step; rm -rf it when done")
    return code


def new_workdir(parent: str = "demo-out") -> str:
    """A fresh directory for one run of the demo, named by its start time (a new one each run, nothing reused)."""
    os.makedirs(parent, exist_ok=True)
    return os.path.abspath(tempfile.mkdtemp(prefix=time.strftime("run-%Y%m%d-%H%M%S-"), dir=parent))


def finetune(workdir: str, steps: int) -> int:
    """A frozen-base run with incremental checkpoints (--freeze-base --incremental): after the first, full,
    checkpoint each one writes only the trainable state; the loop logs the bytes, `shardckpt du` sums them."""
    root = os.path.join(workdir, "finetune")
    print(f"\ndemo: fine-tuning on 3 ranks with a frozen base, incremental checkpoints every 2 steps under {root}")
    args = ["--ckpt", root, "--steps", str(steps), "--ckpt-every", "2", "--keep-last", "4", "--layers", "8"]
    job = torchrun(3, [*args, "--freeze-base", "--incremental", "--full-every", "4"], os.path.join(workdir, "ft.log"))
    if job.wait() != 0:
        raise SystemExit(f"demo: the fine-tuning job failed with code {job.returncode}")
    print(f"\ndemo: shardckpt du {root}  (unique bytes: what each checkpoint added; logical: what it holds)")
    return cli_main(["du", root])


if __name__ == "__main__":
    raise SystemExit(main())
