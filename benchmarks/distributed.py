"""`python -m benchmarks.distributed`: FSDP-style state on 4 gloo ranks, saved and reloaded on 4, 3 and 2 ranks.

shardckpt and torch DCP on the same state in the same run: durable save, same-layout and resharded loads, cold
(page cache dropped, when allowed) and warm (medians of --repeats), bytes read per byte needed, peak RSS per rank.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

from benchmarks.__main__ import write_report
from tests.helpers.launch import run_ranks

WORKER = Path(__file__).resolve().parent / "dist_worker.py"
GIB = 1 << 30


def values(results: list[dict | None]) -> list[dict]:
    for rank, result in enumerate(results):
        if result is None or not result.get("ok"):
            raise SystemExit(f"benchmark rank {rank} failed: {result}")
    return [result["value"] for result in results if result is not None]


def sharded_job(
    argv: list[str] | None, doc: str | None, json_default: str, worlds: list[int], prefix: str
) -> tuple[argparse.Namespace, int, dict, str]:
    """The options and set-up shared by the gloo benchmarks of a Shard(0) state (this one, benchmarks.dcp_backend):
    (args, rows per tensor, the arguments every rank gets, the scratch directory). Rows are a multiple of 12, so
    that every world size from 1 to 4 shards them evenly."""
    parser = argparse.ArgumentParser(description=doc)
    parser.add_argument("--size-mib", type=int, default=512, help="state size over all ranks (default 512 MiB)")
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--dir", help="scratch directory on the disk to measure")
    parser.add_argument("--json", default=json_default)
    parser.add_argument("--repeats", type=int, default=3, help="runs per library and row (median)")
    parser.add_argument("--save-world", type=int, default=4, choices=range(1, 5), help="ranks that save")
    parser.add_argument("--worlds", type=int, nargs="+", default=worlds, choices=range(1, 5), help="load on")
    parser.add_argument("--warm", action="store_true", help="never drop the page cache (warm loads only)")
    args = parser.parse_args(argv)
    rows = max(12, round((args.size_mib << 20) / (args.tensors * 4096) / 12) * 12)
    scratch = tempfile.mkdtemp(prefix=prefix, dir=args.dir)
    common = {
        "rows": rows,
        "tensors": args.tensors,
        "shardckpt": f"{scratch}/sc",
        "dcp": f"{scratch}/dcp",
        "repeats": args.repeats,
        "warm": args.warm,
    }
    return args, rows, common, scratch


def main(argv: list[str] | None = None) -> int:
    args, rows, common, scratch = sharded_job(
        argv, __doc__, "benchmarks/distributed.json", [4, 3, 2], "shardckpt-dbench-"
    )
    size = rows * 1024 * 4 * args.tensors
    report: dict = {"state_bytes": size, "save_world": args.save_world, "rows": []}
    saved = values(run_ranks("save", args.save_world, common, timeout=1200, worker=WORKER))[0]
    report["save"] = {"shardckpt_gib_s": size / saved["shardckpt"] / GIB, "dcp_gib_s": size / saved["dcp"] / GIB}
    print(
        f"state: {args.tensors} fp32 tensors, {size / GIB:.2f} GiB, Shard(0) over {args.save_world} gloo ranks, "
        f"{os.cpu_count()} cores"
    )
    print(
        f"save on {args.save_world} ranks: shardckpt {report['save']['shardckpt_gib_s']:.2f} GiB/s, "
        f"DCP {report['save']['dcp_gib_s']:.2f} GiB/s, ratio {saved['dcp'] / saved['shardckpt']:.2f}x"
    )
    print(
        f"{'load':10} {'temp':5} {'shardckpt GiB/s':>16} {'DCP GiB/s':>10} {'speedup':>8} "
        f"{'read/needed sc':>15} {'read/needed DCP':>16} {'peak RSS/rank':>14} {'load peak +MiB sc/DCP':>22}"
    )
    for world in args.worlds:
        ranks = values(run_ranks("load", world, common, timeout=1200, worker=WORKER))
        needed = sum(r["needed"] for r in ranks)
        for temperature in ("warm",) if args.warm else ("cold", "warm"):
            sc, dc = ranks[0][f"shardckpt_{temperature}"], ranks[0][f"dcp_{temperature}"]
            cold_dropped = temperature == "warm" or ranks[0]["cold_possible"]
            row = {
                "load": f"{args.save_world} -> {world}",
                "temperature": temperature if cold_dropped else "warm (no cache drop)",
                "shardckpt_gib_s": size / sc / GIB,
                "dcp_gib_s": size / dc / GIB,
                "speedup_vs_dcp": dc / sc,
                "shardckpt_read_ratio": sum(r[f"shardckpt_{temperature}_read"] for r in ranks) / needed,
                "dcp_read_ratio": sum(r[f"dcp_{temperature}_read"] for r in ranks) / needed,
                "peak_rss_bytes": max(r["peak_rss"] for r in ranks),
                # Above the rank's RSS just before the load (destinations included there): what the load adds.
                "shardckpt_load_peak_bytes": max(r.get("shardckpt_peak_above", 0) for r in ranks),
                "dcp_load_peak_bytes": max(r.get("dcp_peak_above", 0) for r in ranks),
            }
            report["rows"].append(row)
            print(
                f"{row['load']:10} {temperature:5} {row['shardckpt_gib_s']:16.2f} {row['dcp_gib_s']:10.2f} "
                f"{row['speedup_vs_dcp']:7.2f}x {row['shardckpt_read_ratio']:15.3f} {row['dcp_read_ratio']:16.3f} "
                f"{row['peak_rss_bytes'] / 2**20:10.0f} MiB "
                f"{row['shardckpt_load_peak_bytes'] / 2**20:11.0f} / {row['dcp_load_peak_bytes'] / 2**20:.0f}",
                flush=True,
            )
    write_report(args.json, report)
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
