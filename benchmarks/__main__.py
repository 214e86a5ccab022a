"""`python -m benchmarks`: durable save and load throughput of shardckpt versus baselines on the same state.

Every figure is the median of several runs, reported with its ratio to the best baseline of the same run; the
disk's own sequential write and read rates, checksum cost and peak memory of each load come with them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
import types
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import crc32c
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

import shardckpt
import shardckpt.write.writer
from benchmarks.memory import peak_above
from benchmarks.pagecache import drop_caches
from shardckpt.format.layout import new_attempt
from shardckpt.knobs import BLOCK_SIZE as DEFAULT_BLOCK_SIZE
from shardckpt.knobs import PIECE_HASHES

GIB = 1 << 30


def make_state(total_bytes: int, tensors: int = 64) -> dict[str, torch.Tensor]:
    """`tensors` fp32 tensors of equal size, like the weights/exp_avg/exp_avg_sq of a model."""
    rows = max(1, total_bytes // tensors // 4 // 1024)
    generator = torch.Generator().manual_seed(0)
    return {f"t{i:03d}": torch.randn(rows, 1024, generator=generator) for i in range(tensors)}


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checksum_seconds(state: dict[str, torch.Tensor], block: int = DEFAULT_BLOCK_SIZE) -> float:
    """One core's time for the CRC32C of every block of the state, as the writer computes them."""
    began = time.perf_counter()
    for tensor in state.values():
        view = memoryview(tensor.numpy()).cast("B")
        for offset in range(0, view.nbytes, block):
            crc32c.crc32c(view[offset : offset + block])
    return time.perf_counter() - began


def save_row_shards(url: str, state: dict[str, torch.Tensor], world: int) -> None:
    """Save `state` as `world` ranks would with FSDP's Shard(0): each rank writes its slab of rows (one process)."""
    attempt = new_attempt()
    for rank in range(world):
        writer = shardckpt.ShardWriter(url, rank=rank, world_size=world, attempt=attempt)
        for name, tensor in state.items():
            lo, hi = rank * tensor.shape[0] // world, (rank + 1) * tensor.shape[0] // world
            writer.add(name, tensor[lo:hi], global_shape=tensor.shape, offsets=(lo, 0))
        writer.close()
    shardckpt.commit(url, world_size=world, attempt=attempt)


def machine() -> dict[str, object]:
    """What a report says of the machine it ran on."""
    return {
        "arch": platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def write_report(path: str | None, report: dict) -> None:
    """The results as JSON at `path` (nothing when it is empty)."""
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as handle:
            json.dump(report, handle, indent=1)


def remove(path: str) -> None:
    """Delete a file or a directory tree and wait until the disk has forgotten it (the next row starts even)."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)
    os.sync()


def timed(run: Callable[[], None], setup: Callable[[], None] | None, repeats: int) -> float:
    """Median seconds of `repeats` runs of `run`, each after `setup`."""
    samples = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        began = time.perf_counter()
        run()
        samples.append(time.perf_counter() - began)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", message=".*torch.distributed.*")  # DCP warns when used without a group
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mib", type=int, default=512, help="state size (default 512 MiB)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per row; the median is reported")
    parser.add_argument("--dir", help="scratch directory on the disk to measure (default: a temp dir)")
    parser.add_argument("--json", default="benchmarks/results.json", help="where to write the results")
    parser.add_argument("--warm", action="store_true", help="never drop the page cache (loads measured warm)")
    args = parser.parse_args(argv)
    scratch = tempfile.mkdtemp(prefix="shardckpt-bench-", dir=args.dir)
    state = make_state(args.size_mib << 20)
    size = nbytes(state)
    counter = iter(range(1 << 30))

    def fresh(name: str) -> str:
        return os.path.join(scratch, f"{name}-{next(counter)}")

    rows: dict[str, dict[str, object]] = {}

    def record(name: str, samples: list[float], kind: str, peak: int | None = None) -> None:
        """A row: the median of its samples, and the slowest and fastest (this disk has slow spells)."""
        seconds = statistics.median(samples)
        rows[name] = {
            "seconds": seconds,
            "gib_per_s": size / seconds / GIB,
            "range_gib_per_s": [size / max(samples) / GIB, size / min(samples) / GIB],
            "kind": kind,
            "peak_rss_bytes": peak,
        }

    def measured_peak(run: Callable[[], None], setup: Callable[[], None] | None) -> int | None:
        """Peak RSS above the RSS before, of one more (untimed) run."""
        if setup is not None:
            setup()
        return peak_above(run)

    # ---- durable saves: libraries take turns, and each output is deleted before the next save, so every row
    # writes into disk blocks the machine already backs (see README: fresh blocks of a thin-provisioned VM disk
    # cost every library alike and would measure the host, not the library).
    blob = b"".join(t.numpy().tobytes() for t in list(state.values())[:1]) * len(state)

    def raw_write(path: str, parts: int = 1) -> None:
        os.makedirs(path)
        part = len(blob) // parts

        def one(index: int) -> None:
            with open(os.path.join(path, f"part{index}"), "wb") as handle:
                end = len(blob) if index == parts - 1 else (index + 1) * part
                handle.write(memoryview(blob)[index * part : end])
                handle.flush()
                os.fsync(handle.fileno())

        with ThreadPoolExecutor(parts) as pool:
            list(pool.map(one, range(parts)))

    def torch_save(path: str) -> None:
        torch.save(state, path)
        fsync_path(path)

    def st_save(path: str) -> None:
        save_file(state, path)
        fsync_path(path)

    def dcp_save(path: str) -> None:
        dcp.save(state, storage_writer=FileSystemWriter(path, thread_count=2, sync_files=True))

    def sc_save(path: str) -> None:
        shardckpt.save(state, path)

    # What BLAKE3 piece hashes (format 1.1, what a parent needs) cost a full save: the save the default does not make.
    hash_probe = f"shardckpt.save {'without' if PIECE_HASHES else 'with'} piece hashes (cost probe)"

    def sc_save_other_hashing(path: str) -> None:
        shardckpt.save(state, path, piece_hashes=not PIECE_HASHES)

    def sc_save_unchecked(path: str) -> None:
        """The same save with every CRC32C replaced by 0: what the checksums cost is the difference."""
        real = shardckpt.write.writer.crc32c
        shardckpt.write.writer.crc32c = types.SimpleNamespace(crc32c=lambda data, value=0: 0)  # type: ignore[assignment]
        try:
            shardckpt.save(state, path)
        finally:
            shardckpt.write.writer.crc32c = real

    saves: dict[str, Callable[[str], None]] = {
        "raw write + fsync (1 stream)": raw_write,
        "raw write + fsync (2 streams, 2 files)": lambda path: raw_write(path, 2),
        "torch.save + fsync": torch_save,
        "safetensors save_file + fsync": st_save,
        "torch DCP save (thread_count=2, fsync)": dcp_save,
        "shardckpt.save (durable, committed)": sc_save,
        "shardckpt.save without checksums (cost probe)": sc_save_unchecked,
        hash_probe: sc_save_other_hashing,
    }
    save_samples = {name: [] for name in saves}
    for repeat in range(args.repeats):
        names = list(saves)
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:  # a different order each round
            path = fresh("save")
            began = time.perf_counter()
            saves[name](path)
            save_samples[name].append(time.perf_counter() - began)
            remove(path)
    for name, samples in save_samples.items():
        peak = None
        if "DCP" in name or name.startswith("shardckpt"):
            path = fresh("save")
            peak = peak_above(lambda: saves[name](path))  # noqa: B023 (called at once)
            remove(path)
        kind = "disk" if name.startswith("raw") else "probe" if "probe" in name else "save"
        record(name, samples, kind, peak)
    crc_seconds = statistics.median(checksum_seconds(state) for _ in range(args.repeats))
    unchecked = rows["shardckpt.save without checksums (cost probe)"]["gib_per_s"]
    checksum_share = 1 - rows["shardckpt.save (durable, committed)"]["gib_per_s"] / unchecked  # type: ignore[operator]
    rates = [rows["shardckpt.save (durable, committed)"]["gib_per_s"], rows[hash_probe]["gib_per_s"]]
    hashed_rate, unhashed_rate = rates if PIECE_HASHES else rates[::-1]
    hash_share = 1 - hashed_rate / unhashed_rate  # type: ignore[operator]

    # ---- loads (cold when the page cache can be dropped)
    torch_path, st_path, sc_path = fresh("torch-load"), fresh("st-load"), fresh("sc-load")
    dcp_path = fresh("dcp-load")
    dcp.save(state, storage_writer=FileSystemWriter(dcp_path, thread_count=2, sync_files=True))
    torch.save(state, torch_path)
    save_file(state, st_path)
    shardckpt.save(state, sc_path)
    cold = not args.warm and drop_caches()
    setup = drop_caches if cold else None
    temperature = "cold" if cold else "warm"
    # Preallocated means touched: a model's tensors are; first-touch page faults are not the loader's cost.
    destination = {k: torch.zeros_like(v) for k, v in state.items()}
    read_buffer = bytearray(4 << 20)  # dd's way: one reused buffer, 4 MiB per read

    raw_path = fresh("raw-read")
    raw_write(raw_path)

    def raw_read() -> None:
        with open(os.path.join(raw_path, "part0"), "rb", buffering=0) as handle:
            while handle.readinto(read_buffer):
                pass

    def st_load() -> None:
        loaded = load_file(st_path)
        for tensor in loaded.values():
            tensor.sum()  # touch every page of the lazily mapped file

    def dcp_load() -> None:
        dcp.load(destination, storage_reader=FileSystemReader(dcp_path))

    def sc_load() -> None:
        shardckpt.load(destination, sc_path)

    # ---- resharded read: saved as 4 ranks, read as 3 (all three ranks' reads in this one process)
    resharded = fresh("reshard")
    save_row_shards(resharded, state, 4)
    fetched: list[int] = []
    thirds = []
    for rank in range(3):
        items = []
        for name, tensor in state.items():
            lo, hi = rank * tensor.shape[0] // 3, (rank + 1) * tensor.shape[0] // 3
            box = shardckpt.Box((lo, 0), (hi - lo, tensor.shape[1]))
            items.append((name, box, torch.zeros(box.shape)))  # preallocated and touched, like the others
        thirds.append(items)

    def read_as_three() -> None:
        checkpoint = shardckpt.open(resharded)
        fetched.clear()
        for items in thirds:
            fetched.append(checkpoint.read_into(items).fetched_bytes)

    dcp_name = f"torch DCP load into preallocated ({temperature})"
    sc_name = f"shardckpt.load into preallocated ({temperature})"
    loads: dict[str, tuple[Callable[[], object], str]] = {
        f"raw read, 1 stream ({temperature})": (raw_read, "disk"),
        f"torch.load ({temperature})": (lambda: torch.load(torch_path, weights_only=True), "load"),
        f"safetensors load_file + touch ({temperature})": (st_load, "load"),
        dcp_name: (dcp_load, "load"),
        sc_name: (sc_load, "load"),
        f"shardckpt resharded load 4 -> 3 ranks ({temperature})": (read_as_three, "load"),
    }
    # Libraries take turns (a different order each round), so a slow spell of the disk hits them alike.
    load_samples: dict[str, list[float]] = {name: [] for name in loads}
    for repeat in range(args.repeats):
        names = list(loads)
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            if setup is not None:
                setup()
            began = time.perf_counter()
            loads[name][0]()
            load_samples[name].append(time.perf_counter() - began)
    for name, (run, kind) in loads.items():
        peak = measured_peak(run, setup) if kind == "load" and "torch.load" not in name else None
        record(name, load_samples[name], kind, peak)
    read_ratio = sum(fetched) / size

    save_rows = {k: v for k, v in rows.items() if v["kind"] == "save"}
    load_rows = {k: v for k, v in rows.items() if v["kind"] == "load"}
    best_save = max(v["gib_per_s"] for k, v in save_rows.items() if not k.startswith("shardckpt"))
    best_load = max(v["gib_per_s"] for k, v in load_rows.items() if not k.startswith("shardckpt"))
    print(
        f"state: {len(state)} fp32 tensors, {size / GIB:.2f} GiB; {args.repeats} runs per row (median); "
        f"{platform.machine()}, {os.cpu_count()} cores; loads are {temperature}"
    )
    print(f"{'row':55} {'GiB/s':>7} {'(min-max)':>11} {'ratio to best baseline':>24} {'peak RSS +MiB':>14}")
    for name, row in rows.items():
        best = {"save": best_save, "load": best_load}.get(str(row["kind"]), row["gib_per_s"])
        row["ratio_to_best_baseline"] = row["gib_per_s"] / best  # type: ignore[operator]
        peak = row["peak_rss_bytes"]
        shown = f"{peak / 2**20:14.0f}" if isinstance(peak, int) else f"{'':14}"
        low, high = row["range_gib_per_s"]  # type: ignore[misc]
        spread = f"{low:.2f}-{high:.2f}"
        print(f"{name:55} {row['gib_per_s']:7.2f} {spread:>11} {row['ratio_to_best_baseline']:24.2f} {shown}")
    sc_save_rate = rows["shardckpt.save (durable, committed)"]["gib_per_s"]
    two_streams = rows["raw write + fsync (2 streams, 2 files)"]["gib_per_s"]
    save_vs_disk = sc_save_rate / two_streams  # type: ignore[operator]
    print(
        f"durable save / raw 2-stream write = {save_vs_disk:.2f}; / best library baseline = "
        f"{sc_save_rate / best_save:.2f}"
    )  # type: ignore[operator]
    disk_read = rows[f"raw read, 1 stream ({temperature})"]["gib_per_s"]
    same_layout = rows[sc_name]["gib_per_s"] / disk_read  # type: ignore[operator]
    versus_dcp = rows[sc_name]["gib_per_s"] / rows[dcp_name]["gib_per_s"]  # type: ignore[operator]
    print(f"resharded 4 -> 3: bytes read / bytes needed = {read_ratio:.3f}")
    print(f"same-layout load / raw sequential read ({temperature}) = {same_layout:.2f}; / DCP load = {versus_dcp:.2f}")
    print(
        f"checksum cost: CRC32C of every block takes {crc_seconds * 1000:.0f} ms on one core; the durable save "
        f"with checksums is {100 * checksum_share:.1f}% slower than the same save without them"
    )
    default = "on" if PIECE_HASHES else "off (SHARDCKPT_PIECE_HASHES=0)"
    print(
        f"piece hash cost: the durable save with BLAKE3 piece hashes is {100 * hash_share:.1f}% slower than the same "
        f"save without them (by default they are {default})"
    )
    result = {
        "state_bytes": size,
        "repeats": args.repeats,
        "loads": temperature,
        "machine": machine(),
        "rows": rows,
        "resharded_read_ratio": read_ratio,
        "save_ratio_to_two_stream_write": save_vs_disk,
        "load_ratio_to_disk_read": same_layout,
        "load_ratio_to_dcp": versus_dcp,
        "checksum_cost": {"crc32c_seconds": crc_seconds, "share_of_save": checksum_share},
        "piece_hash_cost": {"default_hashes": bool(PIECE_HASHES), "share_of_save": hash_share},
    }
    write_report(args.json, result)
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
