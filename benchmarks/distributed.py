"""`python -m benchmarks.distributed`: FSDP-style state on 4 gloo ranks, saved and reloaded on 4, 3 and 2 ranks.

shardckpt and torch DCP on the same state in the same run: durable save, same-layout and resharded loads, cold
(page cache dropped, when allowed) and warm, bytes read from storage per byte needed, peak RSS per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from launch import run_ranks

WORKER = Path(__file__).resolve().parent / "dist_worker.py"
GIB = 1 << 30


def values(results: list[dict | None]) -> list[dict]:
    for rank, result in enumerate(results):
        if result is None or not result.get("ok"):
            raise SystemExit(f"benchmark rank {rank} failed: {result}")
    return [result["value"] for result in results if result is not None]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mib", type=int, default=512, help="state size over all ranks (default 512 MiB)")
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--dir", help="scratch directory on the disk to measure")
    parser.add_argument("--json", default="benchmarks/distributed.json")
    args = parser.parse_args(argv)
    rows = max(12, round((args.size_mib << 20) / (args.tensors * 4096) / 12) * 12)
    scratch = tempfile.mkdtemp(prefix="shardckpt-dbench-", dir=args.dir)
    common = {"rows": rows, "tensors": args.tensors, "shardckpt": f"{scratch}/sc", "dcp": f"{scratch}/dcp"}
    size = rows * 1024 * 4 * args.tensors
    report: dict = {"state_bytes": size, "save_world": 4, "rows": []}
    saved = values(run_ranks("save", 4, common, timeout=1200, worker=WORKER))[0]
    report["save"] = {"shardckpt_gib_s": size / saved["shardckpt"] / GIB, "dcp_gib_s": size / saved["dcp"] / GIB}
    print(
        f"state: {args.tensors} fp32 tensors, {size / GIB:.2f} GiB, Shard(0) over 4 gloo ranks, {os.cpu_count()} cores"
    )
    print(
        f"save on 4 ranks: shardckpt {report['save']['shardckpt_gib_s']:.2f} GiB/s, "
        f"DCP {report['save']['dcp_gib_s']:.2f} GiB/s, ratio {saved['dcp'] / saved['shardckpt']:.2f}x"
    )
    print(
        f"{'load':10} {'temp':5} {'shardckpt GiB/s':>16} {'DCP GiB/s':>10} {'speedup':>8} "
        f"{'read/needed sc':>15} {'read/needed DCP':>16} {'peak RSS/rank':>14}"
    )
    for world in (4, 3, 2):
        ranks = values(run_ranks("load", world, common, timeout=1200, worker=WORKER))
        needed = sum(r["needed"] for r in ranks)
        for temperature in ("cold", "warm"):
            sc, dc = ranks[0][f"shardckpt_{temperature}"], ranks[0][f"dcp_{temperature}"]
            row = {
                "load": f"4 -> {world}",
                "temperature": temperature if ranks[0].get("cold_possible", True) else "warm (no cache drop)",
                "shardckpt_gib_s": size / sc / GIB,
                "dcp_gib_s": size / dc / GIB,
                "speedup_vs_dcp": dc / sc,
                "shardckpt_read_ratio": sum(r[f"shardckpt_{temperature}_read"] for r in ranks) / needed,
                "dcp_read_ratio": sum(r[f"dcp_{temperature}_read"] for r in ranks) / needed,
                "peak_rss_bytes": max(r["peak_rss"] for r in ranks),
            }
            report["rows"].append(row)
            print(
                f"{row['load']:10} {temperature:5} {row['shardckpt_gib_s']:16.2f} {row['dcp_gib_s']:10.2f} "
                f"{row['speedup_vs_dcp']:7.2f}x {row['shardckpt_read_ratio']:15.3f} {row['dcp_read_ratio']:16.3f} "
                f"{row['peak_rss_bytes'] / 2**20:11.0f} MiB",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
