"""Shared reads (issue 27): an HSDP state (replicate 2 x shard 2, 4 gloo ranks) loaded on the same and on resharded
meshes, with each stored byte read once per job (load's share_reads, the default over a group) vs every rank reading
its own (share_reads=False) vs DCP; bytes read from storage over all ranks (rchar) as a ratio to the checkpoint's
data bytes, and medians of the load times. "DDP 4 ranks": the same tensors as plain tensors every rank loads whole.
--s3 adds the same-mesh and DDP loads from a SeaweedFS server (bytes: what the loads fetched). --plan-ranks times
what every rank of a larger job computes before its first round (no I/O): decoding every rank's offer and planning.

    python -m benchmarks.shared_reads --size-mib 2048 --json benchmarks/shared_reads.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks.__main__ import machine, write_report
from benchmarks.distributed import values
from tests.helpers.launch import run_ranks

WORKER = Path(__file__).resolve().parent / "share_worker.py"
SAVE_MESH = [2, 2]
LOADS = {"2x2 -> 2x2": (4, [2, 2]), "2x2 -> 1x3": (3, [1, 3]), "2x2 -> 4x1": (4, [4, 1]), "DDP 4 ranks": (4, None)}


def data_bytes(url: str) -> int:
    folder = Path(url) / "data"
    return sum(os.path.getsize(folder / name) for name in os.listdir(folder))


def load_rows(common: dict, stored: dict[str, int], loads: dict) -> dict[str, dict]:
    """One row per load: bytes read over all ranks / the checkpoint's data bytes, and the slowest rank's median
    seconds, per way (shared, alone, dcp). Mesh None: the DDP state (plain tensors every rank loads)."""
    rows = {}
    for name, (world, mesh) in loads.items():
        what = {"mesh": [1, world], "ddp": True} if mesh is None else {"mesh": mesh}
        ranks = values(run_ranks("load", world, {**common, **what}, worker=WORKER, timeout=1800))
        size = stored["ddp" if mesh is None else "hsdp"]
        row: dict[str, float] = {}
        for way in ranks[0]:
            row[f"{way}_read_ratio"] = sum(rank[way]["read"] for rank in ranks) / size
            row[f"{way}_seconds"] = max(rank[way]["seconds"] for rank in ranks)
        row["shared_vs_alone_time"] = row["shared_seconds"] / row["alone_seconds"]
        rows[name] = row
        cells = "  ".join(f"{key} {value:.3f}" for key, value in row.items())
        print(f"  {name}: {cells}", flush=True)
    return rows


def plan_row(ranks: int, ranges: int = 64, replicas: int = 2, per_node: int = 8) -> dict[str, float]:
    """One rank's setup of a shared read on `ranks` simulated ranks: HSDP with `replicas` replica groups, each rank
    needing `ranges` 1 MiB ranges of its shard's file, `per_node` ranks a node. CPU seconds of this process."""
    from shardckpt.distributed.shared_reads import Offer, agree, nodes_of, read_offers

    shards = max(1, ranks // replicas)
    offers = [
        Offer(
            f"node-{rank // per_node}",
            f"host-{rank // per_node}",
            8 << 20,
            [(rank % shards, i << 20, (i + 1) << 20) for i in range(ranges)],
            4,
            16 << 20,
            0.05,
            ("", 0),
            None,
            None,
        ).encode()
        for rank in range(ranks)
    ]
    began = time.process_time()
    decoded = read_offers(offers)
    decoded_at = time.process_time()
    agreed = agree(decoded, nodes_of(decoded))
    planned = time.process_time()
    assert agreed is not None
    share, _, round_bytes, _ = agreed
    rounds = sum(1 for _ in share.rounds(round_bytes))
    return {
        "ranks": ranks,
        "gathered_mib": sum(map(len, offers)) / 2**20,
        "decode_seconds": decoded_at - began,
        "plan_seconds": planned - decoded_at,
        "rounds_seconds": time.process_time() - planned,
        "segments": len(share.segments),
        "rounds": rounds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=2048, help="state size (default 2048 MiB, the reference)")
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="loads per way and mesh (median)")
    parser.add_argument("--warm", action="store_true", help="never drop the page cache")
    parser.add_argument("--s3", action="store_true", help="also load from a SeaweedFS server started here")
    parser.add_argument("--dir", help="scratch directory on the disk to measure")
    parser.add_argument("--loads", default=",".join(LOADS), help=f"comma-separated, of: {', '.join(LOADS)}")
    parser.add_argument("--no-dcp", action="store_true", help="leave DCP's loads out (a quicker run)")
    parser.add_argument("--json", default="")
    parser.add_argument(
        "--plan-ranks", type=int, nargs="*", default=[], help="only time one rank's setup on these simulated jobs"
    )
    args = parser.parse_args(argv)
    if args.plan_ranks:
        rows = [plan_row(ranks) for ranks in args.plan_ranks]
        for row in rows:
            print(
                f"  {row['ranks']} ranks, 64 ranges each: gathered {row['gathered_mib']:.2f} MiB, decode "
                f"{row['decode_seconds']:.2f} s, plan {row['plan_seconds']:.2f} s, rounds "
                f"{row['rounds_seconds']:.2f} s ({row['segments']} segments in {row['rounds']} rounds)",
                flush=True,
            )
        write_report(args.json, {"machine": machine(), "plan_rows": rows})
        return 0
    rows_per_tensor = max(12, round((args.size_mib << 20) / (args.tensors * 4096) / 12) * 12)
    scratch = tempfile.mkdtemp(prefix="shardckpt-share-", dir=args.dir)
    common = {"rows": rows_per_tensor, "tensors": args.tensors, "repeats": args.repeats, "warm": args.warm}
    unknown = set(args.loads.split(",")) - set(LOADS)
    if unknown:
        parser.error(f"unknown loads {sorted(unknown)}")
    loads = {name: LOADS[name] for name in args.loads.split(",")}
    report: dict[str, object] = {"machine": machine(), "size_mib": args.size_mib, "rows": {}}
    try:
        local = {**common, "url": f"{scratch}/sc", "ddp_url": f"{scratch}/ddp"}
        if not args.no_dcp:
            local.update({"dcp": f"{scratch}/dcp", "ddp_dcp": f"{scratch}/ddp-dcp"})
        values(run_ranks("save", 4, {**local, "mesh": SAVE_MESH}, worker=WORKER, timeout=1800))
        stored = {"hsdp": data_bytes(local["url"]), "ddp": data_bytes(local["ddp_url"])}
        report["stored_bytes"] = stored
        print(
            f"shared reads, local disk: {stored['hsdp'] / 2**20:.0f} MiB of data, saved on a 2x2 HSDP mesh", flush=True
        )
        report["rows"] = {"local": load_rows(local, stored, loads)}
        if args.s3:
            from benchmarks import seaweed

            with seaweed.running("shardckpt-share") as server:
                remote = {**common, "url": "s3://shardckpt-share/sc", "ddp_url": "s3://shardckpt-share/ddp"}
                remote["options"] = server.storage_options()
                values(run_ranks("save", 4, {**remote, "mesh": SAVE_MESH}, worker=WORKER, timeout=1800))
                print("shared reads, S3 (SeaweedFS on this machine):", flush=True)
                s3_loads = {name: loads[name] for name in ("2x2 -> 2x2", "DDP 4 ranks") if name in loads}
                report["rows"]["s3"] = load_rows({**remote, "warm": True}, stored, s3_loads)  # type: ignore[index]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    write_report(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
