"""`python -m benchmarks.loop_state`: the bundled FSDP2 training loop's own state (GPT weights + AdamW moments by
parameter FQN), saved on 4 gloo ranks and loaded on 4, 3 and 2 by shardckpt and by torch DCP in the same run.

Unlike the uniform reference state, this one has tensors of many sizes (embeddings, attention and MLP weights,
layer norms, the 0-d steps of the optimizer), so per-tensor costs show. Both libraries load into the same state
dicts, zeroed before every load, and must end with identical tensors.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile

from benchmarks.__main__ import write_report
from benchmarks.distributed import WORKER, run_ranks, values

GIB = 1 << 30


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--save-world", type=int, default=4, choices=range(1, 5))
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 3, 2], choices=range(1, 5))
    parser.add_argument("--repeats", type=int, default=3, help="runs per library and row (median)")
    parser.add_argument("--warm", action="store_true", help="never drop the page cache (warm loads only)")
    parser.add_argument("--dir", help="scratch directory on the disk to measure")
    parser.add_argument("--json", default="benchmarks/loop_state.json")
    args = parser.parse_args(argv)
    scratch = tempfile.mkdtemp(prefix="shardckpt-lbench-", dir=args.dir)
    common = {
        "vocab": args.vocab,
        "seq_len": args.seq_len,
        "d_model": args.d_model,
        "layers": args.layers,
        "heads": args.heads,
        "batch": 12,
        "shardckpt": f"{scratch}/sc",
        "dcp": f"{scratch}/dcp",
        "repeats": args.repeats,
        "warm": args.warm,
    }
    saved = values(run_ranks("loop_save", args.save_world, common, timeout=1200, worker=WORKER))[0]
    size = saved["bytes"]
    report: dict = {"state_bytes": size, "tensors": saved["tensors"], "save_world": args.save_world, "rows": []}
    report["save"] = {"shardckpt_gib_s": size / saved["shardckpt"] / GIB, "dcp_gib_s": size / saved["dcp"] / GIB}
    print(
        f"FSDP2 training loop state: GPT d_model {args.d_model}, {args.layers} layers, vocab {args.vocab}; "
        f"{saved['tensors']} tensors, {size / 2**20:.0f} MiB with AdamW state, on {args.save_world} gloo ranks"
    )
    print(f"{'row':16} {'temp':5} {'shardckpt':>10} {'DCP':>10} {'speedup':>8}")
    print(
        f"{'save':16} {'':5} {saved['shardckpt'] * 1e3:8.0f}ms {saved['dcp'] * 1e3:8.0f}ms "
        f"{saved['dcp'] / saved['shardckpt']:7.2f}x"
    )
    for world in args.worlds:
        ranks = values(run_ranks("loop_load", world, common, timeout=1200, worker=WORKER))
        if not all(rank["agree"] for rank in ranks):
            raise SystemExit(f"load on {world} ranks: shardckpt and DCP loaded different tensors")
        for temperature in ("warm",) if args.warm else ("cold", "warm"):
            sc, dc = ranks[0][f"shardckpt_{temperature}"], ranks[0][f"dcp_{temperature}"]
            shown = temperature if temperature == "warm" or ranks[0]["cold_possible"] else "warm (no cache drop)"
            row = {
                "load": f"{args.save_world} -> {world}",
                "temperature": shown,
                "shardckpt_seconds": sc,
                "dcp_seconds": dc,
                "speedup_vs_dcp": dc / sc,
            }
            report["rows"].append(row)
            print(f"{'load ' + row['load']:16} {temperature:5} {sc * 1e3:8.0f}ms {dc * 1e3:8.0f}ms {dc / sc:7.2f}x")
    write_report(args.json, report)
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
