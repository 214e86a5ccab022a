"""`python -m benchmarks.incremental`: incremental checkpoints of a frozen-base fine-tuning state, one process.

Frozen tensors + trainable ones + the trainable ones' AdamW state: one full save, then N saves with a parent after
an optimizer step each (one rank's ShardWriter + commit, what save(parent=) runs in one process, so that each save's
time splits into hashing every piece and writing the changed ones); bytes written per checkpoint against the changed
bytes + manifests, seconds against a full save, what piece hashes cost (full saves with and without them; BLAKE3 per
core next to a memcpy of the same bytes; the writer's hashing per thread count), and loads of an incremental
checkpoint against a full one where the reader follows references.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

import shardckpt
from benchmarks.__main__ import machine, remove, write_report
from shardckpt.format.layout import new_attempt
from shardckpt.format.references import LEGACY_HASH_ALG, piece_hash
from shardckpt.knobs import HASH_THREADS
from shardckpt.storage import open_storage
from shardckpt.write.parent import open_parent
from shardckpt.write.writer import ShardWriter, piece_digest

MIB = 1 << 20
GB = 1e9
FROZEN_TENSORS = 64  # a 1 GiB base: 64 tensors of 16 MiB, like the blocks of a small model
TRAINABLE_TENSORS = 4
# Full saves timed with and without hashes: none; hashed in the writer's own thread, one piece after the other
# (hash_threads=0); hashed on the hash threads while the writer writes (the default).
HASH_MODES = {"no_hashes": None, "hashes_inline": 0, "hashes_threaded": HASH_THREADS}


class FineTuning:
    """A frozen base, trainable tensors and a real AdamW over them; `step` changes the trainable part only."""

    def __init__(self, frozen_mib: float, trainable_mib: float) -> None:
        generator = torch.Generator().manual_seed(18)
        frozen_rows = max(1, int(frozen_mib * MIB) // FROZEN_TENSORS // 4 // 1024)
        trainable_rows = max(1, int(trainable_mib * MIB) // TRAINABLE_TENSORS // 4 // 1024)
        self.frozen = {
            f"base.{i:02d}.weight": torch.randn(frozen_rows, 1024, generator=generator) for i in range(FROZEN_TENSORS)
        }
        self.trainable = {
            f"adapter.{i}.weight": torch.randn(trainable_rows, 1024, generator=generator).requires_grad_()
            for i in range(TRAINABLE_TENSORS)
        }
        self.optimizer = torch.optim.AdamW(self.trainable.values(), lr=1e-3)
        self.generator = generator
        self.step()  # AdamW creates its state on the first step

    def step(self) -> None:
        for tensor in self.trainable.values():
            tensor.grad = torch.randn(tensor.shape, generator=self.generator)
        self.optimizer.step()

    def state(self) -> dict[str, torch.Tensor]:
        """The flat state saved: model tensors and the optimizer's, named by parameter."""
        state = {name: tensor for name, tensor in self.frozen.items()}
        for name, tensor in self.trainable.items():
            state[name] = tensor.detach()
            for key, value in self.optimizer.state[tensor].items():
                state[f"optim.{name}.{key}"] = value
        return state

    def changed_bytes(self) -> int:
        """Bytes one step changes: every trainable tensor and its optimizer state (all elements, almost surely)."""
        state = self.state()
        return sum(t.nbytes for name, t in state.items() if name not in self.frozen)


def sizes(path: str) -> tuple[int, int]:
    """(data file bytes, everything else: manifests and COMMITTED) of the checkpoint at `path`."""
    data = other = 0
    for folder, _, files in os.walk(path):
        for name in files:
            size = os.path.getsize(os.path.join(folder, name))
            if os.path.basename(folder) == "data":
                data += size
            else:
                other += size
    return data, other


def _views(state: dict[str, torch.Tensor]) -> list[memoryview]:
    """Every tensor's bytes, largest first."""
    views = [t.detach().reshape(-1).view(torch.uint8).numpy().data for t in state.values()]
    return sorted(views, key=len, reverse=True)


def per_core_rates(state: dict[str, torch.Tensor], repeats: int) -> dict[str, float]:
    """GB/s on one thread over every tensor of `state`, medians of `repeats` rounds taking turns: a memcpy into a
    pre-faulted buffer (memory speed in this process), BLAKE3-128 as one hash thread runs it, and BLAKE2b-128 (the
    previous release's); each hash also as a fraction of the memcpy."""
    views = _views(state)
    total = sum(len(view) for view in views)
    target = np.ones(len(views[0]), dtype=np.uint8)  # written once, so no page fault is timed

    def memcpy() -> None:
        for view in views:
            np.copyto(target[: len(view)], np.frombuffer(view, dtype=np.uint8))

    def blake3_128() -> None:
        for view in views:
            piece_hash(view, threads=1)

    def blake2b_128() -> None:
        for view in views:
            piece_hash(view, LEGACY_HASH_ALG)

    runs: dict[str, Callable[[], None]] = {"memcpy": memcpy, "blake3_128": blake3_128, "blake2b_128": blake2b_128}
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            began = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - began)
    rates = {f"{name}_gb_s": total / GB / statistics.median(values) for name, values in samples.items()}
    rates["blake3_over_memcpy"] = rates["blake3_128_gb_s"] / rates["memcpy_gb_s"]
    rates["blake2b_over_memcpy"] = rates["blake2b_128_gb_s"] / rates["memcpy_gb_s"]
    return rates


def hashing_rates(state: dict[str, torch.Tensor], threads: list[int]) -> dict[str, float]:
    """GB/s of the writer's piece hash (BLAKE3-128, pieces from HASH_SPLIT_MIN bytes on BLAKE3's own threads) over
    every tensor of `state`, one job per tensor, largest first, on n threads of ours."""
    views = _views(state)
    total = sum(len(view) for view in views)
    rates = {}
    for count in threads:
        began = time.perf_counter()
        with ThreadPoolExecutor(max_workers=count) as pool:
            list(pool.map(piece_digest, views))
        rates[str(count)] = total / GB / (time.perf_counter() - began)
    return rates


def incremental_save(state: dict[str, torch.Tensor], root: str, name: str, parent: str) -> dict[str, float]:
    """One rank's save of `state` as ROOT/name with parent ROOT/parent, as save(parent=) runs it in one process:
    seconds in all and per phase (opening the parent, hashing every piece, writing the changed ones, committing)."""
    url = os.path.join(root, name)
    began = time.perf_counter()
    pieces = open_parent(open_storage(root), parent, set(state))
    opened = time.perf_counter()
    attempt = new_attempt()
    writer = ShardWriter(url, rank=0, world_size=1, attempt=attempt, parent=pieces)
    for key, tensor in state.items():
        writer.add(key, tensor)
    writer.close()
    closed = time.perf_counter()
    shardckpt.commit(url, world_size=1, attempt=attempt)
    ended = time.perf_counter()
    stats = writer.stats
    if stats is None:
        raise SystemExit(f"{url}: the writer closed without its statistics")
    return {
        "seconds": ended - began,
        "open_parent_s": opened - began,
        "hash_s": stats.hash_seconds,
        "write_s": stats.seconds - stats.hash_seconds,
        "commit_s": ended - closed,
        "referenced_bytes": stats.referenced_bytes,
    }


def full_saves(state: dict[str, torch.Tensor], repeats: int, fresh: Callable[[str], str]) -> dict[str, float]:
    """Median seconds of a full one-rank save (data file, local manifest, commit) in each HASH_MODES mode; the modes
    take turns each round."""
    samples: dict[str, list[float]] = {mode: [] for mode in HASH_MODES}
    modes = list(HASH_MODES)
    for repeat in range(repeats):
        for mode in modes[repeat % len(modes) :] + modes[: repeat % len(modes)]:
            threads = HASH_MODES[mode]
            path = fresh(mode)
            attempt = new_attempt()
            began = time.perf_counter()
            writer = ShardWriter(
                path,
                rank=0,
                world_size=1,
                attempt=attempt,
                piece_hashes=threads is not None,
                hash_threads=threads or 0,
            )
            for name, tensor in state.items():
                writer.add(name, tensor)
            writer.close()
            shardckpt.commit(path, world_size=1, attempt=attempt)
            samples[mode].append(time.perf_counter() - began)
            remove(path)
    return {f"{mode}_s": statistics.median(values) for mode, values in samples.items()}


def timed_loads(state: dict[str, torch.Tensor], paths: dict[str, str], repeats: int) -> dict[str, float]:
    """Median seconds of warm loads of each of `paths` into preallocated tensors, taking turns each round (so a
    slow spell hits them alike); every load must return `state`."""
    destination = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
    samples: dict[str, list[float]] = {label: [] for label in paths}
    labels = list(paths)
    for round_ in range(repeats + 1):  # round 0 warms the page cache for both and is not counted
        for label in labels[round_ % len(labels) :] + labels[: round_ % len(labels)]:
            for tensor in destination.values():
                tensor.zero_()
            began = time.perf_counter()
            shardckpt.load(destination, paths[label])
            if round_:
                samples[label].append(time.perf_counter() - began)
            wrong = [name for name, tensor in state.items() if not torch.equal(destination[name], tensor)]
            if wrong:
                raise SystemExit(f"a load of {paths[label]} returned other values for {wrong[:3]}")
    return {label: statistics.median(values) for label, values in samples.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--frozen-mib", type=float, default=1024, help="frozen base size (default 1024)")
    parser.add_argument("--trainable-mib", type=float, default=16, help="trainable tensors' size (default 16)")
    parser.add_argument("--saves", type=int, default=3, help="incremental saves after the full one (default 3)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each full save and load; medians")
    parser.add_argument("--hash-threads", type=int, nargs="*", default=[1, 2, 4], help="thread counts hashed alone")
    parser.add_argument("--dir", help="scratch directory on the disk to measure (default: a temp dir)")
    parser.add_argument("--json", default="benchmarks/incremental.json", help="where to write the results")
    args = parser.parse_args(argv)
    scratch = tempfile.mkdtemp(prefix="shardckpt-incremental-", dir=args.dir)
    counter = iter(range(1 << 30))

    def fresh(name: str) -> str:
        return os.path.join(scratch, f"{name}-{next(counter)}")

    job = FineTuning(args.frozen_mib, args.trainable_mib)
    state = job.state()
    logical = sum(t.nbytes for t in state.values())
    per_core = per_core_rates(state, args.repeats)
    rates = hashing_rates(state, args.hash_threads)
    full = full_saves(state, args.repeats, fresh)

    root = os.path.join(scratch, "run")
    began = time.perf_counter()
    shardckpt.save(state, os.path.join(root, "step-0"), piece_hashes=True)
    first_s = time.perf_counter() - began
    data, other = sizes(os.path.join(root, "step-0"))
    rows: list[dict[str, Any]] = [{"save": 0, "kind": "full", "seconds": first_s, "data_bytes": data}]
    rows[0].update({"manifest_bytes": other, "logical_bytes": logical})
    for number in range(1, args.saves + 1):
        job.step()
        state = job.state()
        changed = job.changed_bytes()
        timing = incremental_save(state, root, f"step-{number}", f"step-{number - 1}")
        data, other = sizes(os.path.join(root, f"step-{number}"))
        rows.append(
            {
                "save": number,
                "kind": "incremental",
                **timing,
                "data_bytes": data,
                "manifest_bytes": other,
                "logical_bytes": logical,
                "changed_bytes": changed,
                # The target: written <= 1.05 x changed + manifests.
                "written_over_changed_plus_manifests": (data + other) / (changed + other),
                "data_over_changed": data / changed,
                "seconds_over_full": timing["seconds"] / full["hashes_threaded_s"],
                # The hash pass covers every piece, changed ones too: that is how a save knows what changed.
                "hash_gb_s": logical / GB / timing["hash_s"],
                "write_gb_s": data / GB / timing["write_s"],
            }
        )
    incremental = rows[1:]
    unchanged = logical - job.changed_bytes()
    default_rate = rates.get(str(HASH_THREADS)) or max(rates.values())
    hashing = {
        "per_core": per_core,
        "rates_gb_s_by_threads": rates,
        "hash_threads": HASH_THREADS,
        # An incremental save hashes every piece before writing the changed ones: its floor at the rate measured.
        "unchanged_hash_s": unchanged / GB / default_rate,
        "full_save_cost_inline": full["hashes_inline_s"] / full["no_hashes_s"] - 1,
        "full_save_cost_threaded": full["hashes_threaded_s"] / full["no_hashes_s"] - 1,
    }
    newest = os.path.join(root, f"step-{args.saves}")
    complete = fresh("full")
    shardckpt.save(state, complete)
    medians = timed_loads(state, {"incremental": newest, "full": complete}, args.repeats)
    loads = {
        "incremental_s": medians["incremental"],
        "full_s": medians["full"],
        "ratio": medians["incremental"] / medians["full"],
    }
    shutil.rmtree(scratch, ignore_errors=True)

    print(
        f"frozen {args.frozen_mib:g} MiB + trainable {args.trainable_mib:g} MiB + AdamW state, one process; "
        f"{platform.machine()}, {os.cpu_count()} cores"
    )
    print(
        f"one core, GB/s (median of {args.repeats}): memcpy {per_core['memcpy_gb_s']:.2f}, BLAKE3-128 "
        f"{per_core['blake3_128_gb_s']:.2f} ({per_core['blake3_over_memcpy']:.2f}x memcpy), BLAKE2b-128 "
        f"{per_core['blake2b_128_gb_s']:.2f} ({per_core['blake2b_over_memcpy']:.2f}x memcpy)"
    )
    print("the writer's hashing, GB/s: " + ", ".join(f"{n} threads {r:.2f}" for n, r in rates.items()))
    print(
        f"full save, median of {args.repeats}: no hashes {full['no_hashes_s']:.2f} s, hashed in line "
        f"{full['hashes_inline_s']:.2f} s ({hashing['full_save_cost_inline']:+.0%}), hashed on {HASH_THREADS} "
        f"threads {full['hashes_threaded_s']:.2f} s ({hashing['full_save_cost_threaded']:+.0%})"
    )
    print(
        f"{'save':>4} {'kind':12} {'seconds':>8} {'data MiB':>9} {'manifest KiB':>13} {'changed MiB':>12} {'ratio':>6} "
        f"{'hash all s':>10} {'write s':>8} {'other s':>8}"
    )
    for row in rows:
        line = f"{row['save']:>4} {row['kind']:12} {row['seconds']:8.3f} {row['data_bytes'] / MIB:9.2f} "
        line += f"{row['manifest_bytes'] / 1024:13.1f}"
        if row["kind"] == "incremental":
            line += f" {row['changed_bytes'] / MIB:12.2f} {row['written_over_changed_plus_manifests']:6.3f}"
            other_s = row["open_parent_s"] + row["commit_s"]
            line += f" {row['hash_s']:10.3f} {row['write_s']:8.3f} {other_s:8.3f}"
        print(line)
    hash_s = statistics.median(row["hash_s"] for row in incremental)
    write_s = statistics.median(row["write_s"] for row in incremental)
    print(
        f"an incremental save, medians: hashing all {logical / MIB:.0f} MiB ({unchanged / MIB:.0f} MiB unchanged) "
        f"{hash_s:.3f} s ({logical / GB / hash_s:.2f} GB/s), writing the changed {job.changed_bytes() / MIB:.0f} MiB "
        f"{write_s:.3f} s"
    )
    print(f"loads: {loads}")
    report = {
        "frozen_mib": args.frozen_mib,
        "trainable_mib": args.trainable_mib,
        "repeats": args.repeats,
        "machine": machine(),
        "full_saves": full,
        "hashing": hashing,
        "saves": rows,
        "loads": loads,
    }
    write_report(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
