"""`python -m benchmarks.pickle_check`: the pickle check before an import, in MiB/s and peak memory, on a DCP .metadata.

The file is what torch's dcp.save writes for FSDP row shards of a transformer (model + Adam state); the baseline,
in the same process, is pickletools.genops walking the same opcodes, and (for the file it makes itself, never a
given one) pickle.loads, which is what DCP's own FileSystemReader does with it. Medians of a few runs.
"""

from __future__ import annotations

import argparse
import json
import pickle
import pickletools
import statistics
import time
from collections.abc import Callable

from benchmarks.memory import peak_above
from shardckpt.interop.pickle_scan import check_pickle

MIB = 1 << 20


def dcp_metadata(ranks: int, layers: int) -> bytes:
    """A DCP .metadata: every weight of `layers` transformer layers (and its Adam state) in `ranks` row shards."""
    from torch import Size, float32
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    shapes = {"attn.qkv.weight": (3 * 4096, 4096), "attn.proj.weight": (4096, 4096), "mlp.fc1.weight": (16384, 4096)}
    shapes |= {"mlp.fc2.weight": (4096, 16384), "ln1.weight": (4096,), "ln2.weight": (4096,)}
    shapes["attn.qkv.bias"] = (3 * 4096,)
    entries: dict[str, object] = {}
    storage = {}
    for layer in range(layers):
        for suffix, shape in shapes.items():
            for kind in ("model", "optim.exp_avg", "optim.exp_avg_sq"):
                fqn, rows, chunks = f"{kind}.layers.{layer}.{suffix}", shape[0] // ranks, []
                for rank in range(ranks):
                    offsets = Size([rank * rows] + [0] * (len(shape) - 1))
                    chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=Size([rows, *shape[1:]])))
                    info = _StorageInfo(f"__{rank}_0.distcp", 123456 * layer + rank, rows * 4)
                    storage[MetadataIndex(fqn, offsets, rank)] = info
                entries[fqn] = TensorStorageMetadata(TensorProperties(dtype=float32), Size(shape), chunks)
        entries[f"optim.step.{layer}"] = BytesStorageMetadata()
    return pickle.dumps(Metadata(entries, storage_data=storage), protocol=4)  # type: ignore[arg-type]


def measure(run: Callable[[], object], repeats: int) -> tuple[float, float, int | None]:
    """Median wall and CPU seconds of `run` (CPU: this process only, steadier on a shared machine) and the most
    memory one run added (peak RSS)."""
    seconds, cpu, peaks = [], [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        peaks.append(peak_above(run))
        seconds.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    known = [peak for peak in peaks if peak is not None]
    return statistics.median(seconds), statistics.median(cpu), max(known) if known else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64, help="row shards per tensor (64: 15 MiB, 7.6 M opcodes)")
    parser.add_argument("--layers", type=int, default=84)
    parser.add_argument("--file", help="check this .metadata instead of making one")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args(argv)
    if args.file:
        with open(args.file, "rb") as handle:
            data = handle.read()
    else:
        data = dcp_metadata(args.ranks, args.layers)
    size = len(data) / MIB
    check_s, check_cpu, check_peak = measure(lambda: check_pickle(data, "bench.metadata"), args.repeats)
    genops = measure(lambda: sum(1 for _ in pickletools.genops(data)), max(1, args.repeats // 2))
    genops_s, genops_cpu, genops_peak = genops
    loads = None
    if not args.file:  # unpickle only bytes this process made: never a file from elsewhere
        import torch.distributed.checkpoint.metadata  # noqa: F401  (the classes the pickle names)

        loads = measure(lambda: pickle.loads(data), max(1, args.repeats // 2))
    report = {
        "mib": round(size, 2),
        "check_mib_s": round(size / check_s, 2),
        "check_cpu_mib_s": round(size / check_cpu, 2),
        "check_peak_mib": None if check_peak is None else round(check_peak / MIB, 1),
        "genops_mib_s": round(size / genops_s, 2),
        "genops_cpu_mib_s": round(size / genops_cpu, 2),
        "genops_peak_mib": None if genops_peak is None else round(genops_peak / MIB, 1),
        "speedup_over_genops": round(genops_cpu / check_cpu, 2),
    }
    if loads is not None:
        report.update(
            loads_mib_s=round(size / loads[0], 2),
            loads_cpu_mib_s=round(size / loads[1], 2),
            loads_peak_mib=None if loads[2] is None else round(loads[2] / MIB, 1),
            check_cost_of_loads=round(check_cpu / loads[1], 2),
        )
    print(f"pickle check of a {size:.1f} MiB DCP .metadata (median of {args.repeats}; MiB/s of wall / CPU time)")
    rows = [("check_pickle", "check"), ("pickletools.genops", "genops")]
    rows += [("pickle.loads", "loads")] if loads else []
    for name, key in rows:
        rate, cpu_rate, peak = report[f"{key}_mib_s"], report[f"{key}_cpu_mib_s"], report[f"{key}_peak_mib"]
        print(f"  {name:18} {rate:8.2f} / {cpu_rate:6.2f} MiB/s   peak +{peak} MiB")
    print(f"  speedup (CPU)      {report['speedup_over_genops']:8.2f}x")
    if loads is not None:
        print(f"  check / DCP's own pickle.loads of it (CPU): {report['check_cost_of_loads']:.2f}x")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
