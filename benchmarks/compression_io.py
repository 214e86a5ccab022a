"""The throughput rows of `python -m benchmarks.compression`: save and load with compression="zstd" against the same
save without it, on local disk (also at compression_pace="storage"), on S3 (SeaweedFS here) directly and behind a
bandwidth-capped link (benchmarks/throttle.py), and a resharded load 4 -> 3 ranks (gloo) with the stored bytes it
read against the compressed bytes it needed. Medians over repeats; the ways take turns.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import shardckpt
from benchmarks.compression_data import tiled
from benchmarks.pagecache import drop_caches
from shardckpt.storage import local

WORKER = Path(__file__).resolve().parent / "compression_worker.py"
WAYS = {"plain": None, "zstd": "zstd"}
PACES = {"plain": None, "zstd": "codec", "paced": "storage"}  # local saves: compression_pace of each way


def save_compresses() -> bool:
    """Whether this tree's save() takes compression= (the codec branch's save path)."""
    return "compression" in inspect.signature(shardckpt.save).parameters


def local_data_bytes(url: str) -> int:
    folder = Path(url) / "data"
    return sum(os.path.getsize(folder / name) for name in os.listdir(folder))


Timing = tuple[dict[str, float], dict[str, float]]


def turns(operations: dict[str, Callable[[], object]], repeats: int, before: Callable[[], object] | None) -> Timing:
    """Median wall and CPU seconds (this process, all its threads) of each operation; they take turns (a slow spell
    of the machine hits them alike). CPU time is what a busy machine cannot hide: compression is CPU work."""
    wall: dict[str, list[float]] = {name: [] for name in operations}
    cpu: dict[str, list[float]] = {name: [] for name in operations}
    for repeat in range(repeats):
        names = list(operations)
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            if before is not None:
                before()
            began, began_cpu = time.perf_counter(), time.process_time()
            operations[name]()
            wall[name].append(time.perf_counter() - began)
            cpu[name].append(time.process_time() - began_cpu)
    wall_medians = {name: statistics.median(values) for name, values in wall.items()}
    return wall_medians, {name: statistics.median(values) for name, values in cpu.items()}


def compare(name: str, timing: Timing, stored: dict[str, int], size: int) -> dict[str, object]:
    """A row: wall and CPU seconds and GiB/s of logical bytes each way, time ratio zstd / plain, the size ratio."""
    seconds, cpu = timing
    ratio = stored["zstd"] / stored["plain"]
    row: dict[str, object] = {
        "seconds": seconds,
        "cpu_seconds": cpu,
        "logical_gib_s": {way: size / value / 2**30 for way, value in seconds.items()},
        "stored_bytes": stored,
        "size_ratio": ratio,
        "time_ratio": seconds["zstd"] / seconds["plain"],
    }
    print(
        f"  {name:34} plain {seconds['plain']:7.3f} s  zstd {seconds['zstd']:7.3f} s  time zstd/plain "
        f"{row['time_ratio']:.3f}  (size ratio {ratio:.3f}); CPU s plain {cpu['plain']:.3f} zstd {cpu['zstd']:.3f}",
        flush=True,
    )
    return row


def local_rows(state: dict[str, torch.Tensor], repeats: int, scratch: str, warm: bool) -> dict[str, object]:
    size = sum(t.numel() * t.element_size() for t in state.values())
    counter = iter(range(1 << 30))
    stored: dict[str, int] = {}
    written: list[str] = []

    def save(way: str) -> None:
        url = f"{scratch}/save-{way}-{next(counter)}"
        written.append(url)
        compression = None if way == "plain" else "zstd"
        shardckpt.save(state, url, step=1, compression=compression, compression_pace=PACES[way])
        stored[way] = local_data_bytes(url)

    def remove_saved() -> None:
        """Every save writes into blocks the disk freed just before (benchmarks/__main__.py's remove: see its note)."""
        while written:
            shutil.rmtree(written.pop(), ignore_errors=True)
        os.sync()

    timing = turns({way: lambda way=way: save(way) for way in PACES}, repeats, remove_saved)  # type: ignore[misc]
    remove_saved()
    row: dict[str, object] = {"save": compare("local save", timing, stored, size)}
    rates = row["save"]["logical_gib_s"]  # type: ignore[index]
    row["save_throughput_ratio_codec_pace"] = rates["zstd"] / rates["plain"]
    row["save_throughput_ratio"] = rates["paced"] / rates["plain"]
    row["paced_size_ratio"] = stored["paced"] / stored["plain"]
    print(
        f"  local save throughput / plain: compression_pace='storage' {row['save_throughput_ratio']:.3f} (target >= "
        f"0.9; stored {row['paced_size_ratio']:.3f} of raw), 'codec' {row['save_throughput_ratio_codec_pace']:.3f} "
        f"(stored {stored['zstd'] / stored['plain']:.3f}); {_cpu_note()}",
        flush=True,
    )
    urls = {way: f"{scratch}/load-{way}" for way in WAYS}
    for way, url in urls.items():
        shardckpt.save(state, url, step=1, compression=WAYS[way])
    destination = {name: torch.empty_like(tensor) for name, tensor in state.items()}
    cold = not warm and drop_caches()
    loads = {way: lambda url=url: shardckpt.load(destination, url) for way, url in urls.items()}
    load_seconds = turns(loads, repeats, drop_caches if cold else None)  # type: ignore[misc]
    row["load"] = compare(f"local load ({'cold' if cold else 'warm'})", load_seconds, stored, size)
    for url in urls.values():
        shutil.rmtree(url, ignore_errors=True)
    return row


@contextlib.contextmanager
def slow_disk(mb_s: float) -> Iterator[None]:
    """Local writes at most `mb_s` MB/s per file: each write to a data file also waits until its bytes would have gone
    at that rate (2 writer threads share it). A disk slower than the codec, which this machine's page cache is not."""
    original = local._LocalNewFile.write_at

    def write_at(self: Any, data: bytes | memoryview, offset: int) -> None:
        began = time.perf_counter()
        original(self, data, offset)
        rest = memoryview(data).nbytes * 2 / (mb_s * 1e6) - (time.perf_counter() - began)
        if rest > 0:
            time.sleep(rest)

    local._LocalNewFile.write_at = write_at  # type: ignore[method-assign]
    try:
        yield
    finally:
        local._LocalNewFile.write_at = original  # type: ignore[method-assign]


def slow_disk_row(state: dict[str, torch.Tensor], repeats: int, scratch: str, mb_s: float) -> dict[str, object]:
    """Saves to a disk slower than the codec: there the storage's pace compresses (the encoders keep ahead of the
    writer), where on this machine's fast page cache it stores nearly everything raw. Save time and stored bytes of
    each way against the uncompressed save."""
    counter = iter(range(1 << 30))
    stored: dict[str, int] = {}

    def save(way: str) -> None:
        url = f"{scratch}/slow-{way}-{next(counter)}"
        shardckpt.save(state, url, step=1, compression=None if way == "plain" else "zstd", compression_pace=PACES[way])
        stored[way] = local_data_bytes(url)
        shutil.rmtree(url, ignore_errors=True)

    with slow_disk(mb_s):
        seconds, _ = turns({way: lambda way=way: save(way) for way in PACES}, repeats, None)  # type: ignore[misc]
    row: dict[str, object] = {"disk_mb_s": mb_s, "seconds": seconds}
    row["throughput_ratio"] = {way: seconds["plain"] / seconds[way] for way in PACES}
    row["stored_ratio"] = {way: stored[way] / stored["plain"] for way in PACES}
    print(
        f"  local save, a {mb_s:.0f} MB/s disk (simulated): throughput / plain: compression_pace='storage' "
        f"{row['throughput_ratio']['paced']:.3f} (stored {row['stored_ratio']['paced']:.3f} of raw), 'codec' "
        f"{row['throughput_ratio']['zstd']:.3f} (stored {row['stored_ratio']['zstd']:.3f}); {_cpu_note()}",
        flush=True,
    )
    return row


def _cpu_note() -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{os.cpu_count()} cores, load average {load:.1f}"


def s3_rows(
    state: dict[str, torch.Tensor],
    repeats: int,
    endpoint: str | None,
    bucket: str,
    link_mb_s: float = 0.0,
    link_state: dict[str, torch.Tensor] | None = None,
) -> dict[str, dict[str, object]]:
    """Save and load through s3fs to `endpoint`, or to a SeaweedFS started here: loopback, where the shared cores are
    the limit; with link_mb_s, `link_state` (default: state) through benchmarks/throttle.py's proxy capped at that many
    MB/s ("s3" and "s3_link")."""
    link_state = state if link_state is None else link_state
    from benchmarks.s3 import server_options
    from benchmarks.throttle import running

    rows: dict[str, dict[str, object]] = {}
    with server_options(endpoint) as options:
        rows["s3"] = _s3_ways("S3", state, repeats, options, bucket)
        if link_mb_s:
            target = str(options["endpoint_url"]).split("://", 1)[-1].rstrip("/")
            with running(target, link_mb_s) as proxy:
                limited = {**options, "endpoint_url": proxy}
                rows["s3_link"] = _s3_ways(f"S3 at {link_mb_s:g} MB/s", link_state, repeats, limited, bucket)
            size = sum(t.numel() * t.element_size() for t in link_state.values())
            moved = size / rows["s3_link"]["save"]["seconds"]["plain"] / 1e6  # type: ignore[index]
            rows["s3_link"]["link_mb_s"] = link_mb_s
            rows["s3_link"]["plain_save_mb_s"] = moved
            verdict = "the link, not the CPU, is the limit" if moved >= 0.8 * link_mb_s else "NOT link-limited"
            print(
                f"  the link is capped at {link_mb_s:g} MB/s (both ways) by benchmarks/throttle.py; the plain save "
                f"moved {moved:.0f} MB/s through it ({moved / link_mb_s:.0%} of the cap: {verdict}); {_cpu_note()}",
                flush=True,
            )
    return rows


def _s3_ways(
    label: str, state: dict[str, torch.Tensor], repeats: int, options: dict[str, object], bucket: str
) -> dict[str, object]:
    import s3fs

    size = sum(t.numel() * t.element_size() for t in state.values())
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    run = f"{bucket}/zbench-{uuid.uuid4().hex[:8]}"
    counter = iter(range(1 << 30))

    def save(way: str) -> None:
        url = f"s3://{run}/{way}-{next(counter)}"
        shardckpt.save(state, url, step=1, compression=WAYS[way], storage_options=options)

    urls = {way: f"s3://{run}/loaded-{way}" for way in WAYS}
    for way, url in urls.items():  # the checkpoints the loads read, written once (this also warms both paths)
        shardckpt.save(state, url, step=1, compression=WAYS[way], storage_options=options)
    stored = {way: int(fs.du(f"{url}/data")) for way, url in urls.items()}
    destination = {name: torch.empty_like(tensor) for name, tensor in state.items()}
    saves = turns({way: lambda way=way: save(way) for way in WAYS}, repeats, None)  # type: ignore[misc]
    load_ops = {
        way: lambda url=url: shardckpt.load(destination, url, storage_options=options)
        for way, url in urls.items()  # type: ignore[misc]
    }
    loads = turns(load_ops, repeats, None)
    fs.rm(run, recursive=True)
    rows = {
        what: compare(f"{label} {what}", timing, stored, size) for what, timing in (("save", saves), ("load", loads))
    }
    for what, row in rows.items():
        target = row["size_ratio"] + 0.10  # type: ignore[operator]
        row["target_time_ratio"] = target
        print(f"  {label} {what}: time ratio {row['time_ratio']:.3f}, target <= size ratio + 0.10 = {target:.3f}")
    return dict(rows)


def reshard_row(source: str, scratch: str, warm: bool, elements: int) -> dict[str, object]:
    """Saved on 4 ranks, loaded on 3 (gloo): bytes all ranks read / the checkpoint's data bytes, each way."""
    from benchmarks.distributed import values
    from tests.helpers.launch import run_ranks

    args = {
        "source": source,
        "elements": elements,
        "plain": f"{scratch}/reshard-plain",
        "packed": f"{scratch}/reshard-zstd",
        "warm": warm,
    }
    values(run_ranks("save", 4, args, worker=WORKER, timeout=1800))
    ranks = values(run_ranks("load", 3, args, worker=WORKER, timeout=1800))
    row: dict[str, object] = {}
    for way, url in (("plain", args["plain"]), ("zstd", args["packed"])):
        key = "plain" if way == "plain" else "packed"
        stored = local_data_bytes(str(url))
        fetched, needed = [rank[key]["fetched"] for rank in ranks], [rank[key]["needed"] for rank in ranks]
        row[way] = {
            "stored_bytes": stored,
            "read_bytes": sum(rank[key]["read"] for rank in ranks),
            "read_ratio": sum(rank[key]["read"] for rank in ranks) / stored,
            "fetched_ratio": sum(fetched) / stored if None not in fetched else None,
            # the load's own count: bytes it fetched from storage (stored, compressed) / bytes its plan needed (logical)
            "fetched_over_needed": sum(fetched) / sum(needed) if None not in fetched + needed else None,
            "seconds": max(rank[key]["seconds"] for rank in ranks),
            "agree": all(rank[key]["agree"] for rank in ranks),
        }
    for way in ("plain", "zstd"):
        cell = row[way]
        assert isinstance(cell, dict)
        print(
            f"  reshard 4 -> 3 ({way}): stored bytes read / stored bytes needed {cell['read_ratio']:.3f} (rchar), "
            f"{cell['fetched_ratio']:.3f} (fetched; / the plan's logical needed {cell['fetched_over_needed']:.3f}); "
            f"{cell['seconds']:.3f} s; values equal: {cell['agree']}",
            flush=True,
        )
        if not cell["agree"]:
            raise SystemExit(f"resharded load ({way}) gave other values than were saved")
    return row


def throughput_rows(args: argparse.Namespace, weights: dict[str, torch.Tensor]) -> dict[str, object]:
    """Every throughput row that args asks for, or the reason there are none yet."""
    if not save_compresses():
        reason = "pending: this tree's shardckpt.save() has no compression= (the codec branch's save path)"
        print(f"throughput rows {reason}")
        return {"pending": reason}
    state = tiled(weights, args.size_mib << 20)
    size = sum(t.numel() * t.element_size() for t in state.values())
    print(f"throughput: {len(state)} fp32 tensors of {'synthetic' if args.smoke else 'MiniLM'} weights, "
          f"{size / 2**20:.0f} MiB, median of {args.repeats}")  # fmt: skip
    scratch = tempfile.mkdtemp(prefix="shardckpt-zbench-", dir=args.dir)
    rows: dict[str, object] = {"state_bytes": size}
    try:
        rows["local"] = local_rows(state, args.repeats, scratch, args.warm)
        if args.slow_disk_mb_s > 0:
            rows["local_slow_disk"] = slow_disk_row(state, args.repeats, scratch, args.slow_disk_mb_s)
        if not args.no_s3:
            link_state = tiled(weights, min(args.size_mib, args.link_size_mib) << 20)
            rows.update(s3_rows(state, args.repeats, args.endpoint, args.bucket, args.link_mb_s, link_state))
        if not args.no_reshard:
            source = "synthetic" if args.smoke else "minilm"
            rows["reshard_4_to_3"] = reshard_row(source, scratch, args.warm, 1 << 20)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return rows
