"""Node-local tier (issue 28): 4 gloo ranks as 2 simulated nodes, a Shard(0) state saved asynchronously to the
persistent root and to a local tier on tmpfs with peers=1: the training stall of a local save against a persistent
one, the time until each is committed, and restore_latest from the local tier against the persistent root (cold
page cache), as ratios in one run; the steps lost per failure at the cadences given. --s3 puts the persistent root
on a SeaweedFS server started here.

    python -m benchmarks.local_tier --size-mib 2048 --json benchmarks/local_tier.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

from benchmarks.__main__ import machine, write_report
from benchmarks.distributed import values
from tests.helpers.launch import run_ranks

WORKER = Path(__file__).resolve().parent / "tier_worker.py"


def measure(common: dict) -> dict[str, float]:
    saves = values(run_ranks("save", 4, common, worker=WORKER, timeout=3600))
    restores = values(run_ranks("restore", 4, common, worker=WORKER, timeout=3600))
    row = {key: max(rank[key] for rank in saves) for key in saves[0]}
    row.update({f"restore_{key}": max(rank[key] for rank in restores) for key in restores[0]})
    row["stall_local_vs_persistent"] = row["local_stall"] / row["persistent_stall"]
    row["restore_local_vs_persistent"] = row["restore_local"] / row["restore_persistent"]
    # The memory target: a local save's peak extra host memory against an async (persistent) save's, the
    # largest rank's median of each; both floored at 1 MiB, below which a peak is the interpreter's own noise.
    row["peak_local_vs_async"] = max(row["local_peak_mib"], 1.0) / max(row["persistent_peak_mib"], 1.0)
    print("  " + "  ".join(f"{key} {value:.3f}" for key, value in row.items()), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=2048, help="state size (default 2048 MiB, the reference)")
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="saves and restores of each kind (median)")
    parser.add_argument("--every", type=int, default=500, help="persistent cadence (steps), for steps lost")
    parser.add_argument("--local-every", type=int, default=25, help="local cadence (steps), for steps lost")
    parser.add_argument("--warm", action="store_true", help="never drop the page cache")
    parser.add_argument("--s3", action="store_true", help="the persistent root on a SeaweedFS server started here")
    parser.add_argument("--dir", help="scratch directory for the persistent root (the disk to measure)")
    parser.add_argument("--local-dir", default="/dev/shm", help="where the nodes' local tiers go (tmpfs)")
    parser.add_argument(
        "--through-group",
        action="store_true",
        help="replicate and restore through the process group even between ranks of one host "
        "(SHARDCKPT_SHARE_MEMORY=0): what ranks on separate hosts do",
    )
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    if args.through_group:
        os.environ["SHARDCKPT_SHARE_MEMORY"] = "0"  # the ranks inherit it
    rows = max(4, round((args.size_mib << 20) / (args.tensors * 4096) / 4) * 4)
    scratch = tempfile.mkdtemp(prefix="shardckpt-tier-", dir=args.dir)
    local = tempfile.mkdtemp(prefix="shardckpt-tier-local-", dir=args.local_dir)
    common = {"rows": rows, "tensors": args.tensors, "repeats": args.repeats, "warm": args.warm, "local": local}
    report: dict[str, object] = {
        "machine": machine(),
        "size_mib": args.size_mib,
        "through_group": args.through_group,
        # A failure loses on average half an interval of work: the local tier's against the persistent one's.
        "steps_lost_per_failure": {"persistent_only": args.every / 2, "with_local_tier": args.local_every / 2},
        "rows": {},
    }
    try:
        print(f"local tier: {args.size_mib} MiB on 4 ranks as 2 nodes, persistent on local disk", flush=True)
        report["rows"] = {"local_disk": measure({**common, "url": f"{scratch}/root"})}
        if args.s3:
            from benchmarks import seaweed

            shutil.rmtree(local, ignore_errors=True)
            with seaweed.running("shardckpt-tier") as server:
                print("local tier, persistent on S3 (SeaweedFS on this machine):", flush=True)
                remote = {**common, "url": "s3://shardckpt-tier/root", "options": server.storage_options()}
                report["rows"]["s3"] = measure({**remote, "warm": True})  # type: ignore[index]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(local, ignore_errors=True)
    write_report(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
