"""`python -m benchmarks.compression_codecs`: encoder settings of the per-block codec tried side by side on the same
tensors as benchmarks/compression.py (an experiment, not a `make bench` row): stored / raw and one core's encode rate.

Every variant groups bytes by element width with the sign bit rotated to the bottom (as format/codec.py does) and
frames each group like the codec (2 bytes + 5 per group, a group stored raw when zstd does not shrink it); only the
zstd settings, the frame's optional fields and the unit of compression change. "codec" is BlockEncoder itself.

    python -m benchmarks.compression_codecs
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch
import zstandard

from benchmarks.__main__ import write_report
from benchmarks.compression import ours, raw_bytes, total, zipnn_bytes, zipnn_version
from benchmarks.compression_data import adamw_moments, minilm_weights
from shardckpt.knobs import BLOCK_SIZE

UINT = {2: np.uint16, 4: np.uint32}


def groups(raw: memoryview, width: int) -> list[bytes]:
    """The codec's ROTATE transform: each element rotated left by one bit, then its bytes grouped, top byte first."""
    values = np.frombuffer(raw, dtype=UINT[width])
    values = (values << UINT[width](1)) | (values >> UINT[width](8 * width - 1))
    grouped = np.ascontiguousarray(values.view(np.uint8).reshape(-1, width).T)
    return [grouped[k].tobytes() for k in range(width)]


Run = Callable[[dict[str, torch.Tensor]], tuple[int, float]]


def variant(params: zstandard.ZstdCompressionParameters, unit: int) -> Run:
    """(stored bytes, seconds) of `tensors` in units of `unit` bytes framed like the codec, groups compressed with
    `params`."""

    def stored(tensors: dict[str, torch.Tensor]) -> tuple[int, float]:
        began = time.perf_counter()
        compressor = zstandard.ZstdCompressor(compression_params=params)
        size = 0
        for tensor in tensors.values():
            data, width = raw_bytes(tensor), tensor.element_size()
            for offset in range(0, len(data), unit):
                raw = data[offset : offset + unit]
                if len(raw) % width:
                    size += len(raw)
                    continue
                framed = 2 + sum(5 + min(len(g), len(compressor.compress(g))) for g in groups(raw, width))
                size += min(framed, len(raw))
        return size, time.perf_counter() - began

    return stored


def variants(level: int) -> dict[str, Run]:
    def params(at: int = level, **changes: int) -> zstandard.ZstdCompressionParameters:
        base = {"min_match": 7, "write_checksum": 0, "write_content_size": 1, "write_dict_id": 0}
        return zstandard.ZstdCompressionParameters.from_level(at, **{**base, **changes})

    def codec(tensors: dict[str, torch.Tensor]) -> tuple[int, float]:
        stored, encoding, _ = ours(tensors, level)
        return stored, encoding

    lean = {"hash_log": 6, "format": zstandard.FORMAT_ZSTD1_MAGICLESS, "write_content_size": 0}
    return {
        "codec (BlockEncoder as merged)": codec,
        f"L{level} min_match 7 (the codec's settings, re-framed here)": variant(params(), BLOCK_SIZE),
        f"L{level} min_match 7 hash_log 6": variant(params(hash_log=6), BLOCK_SIZE),
        "  + magicless frames, no content size": variant(params(**lean), BLOCK_SIZE),
        "  + 128 KiB units": variant(params(**lean), 2 * BLOCK_SIZE),
        "  + 256 KiB units": variant(params(**lean), 4 * BLOCK_SIZE),
        "L3 (zstd's default level), min_match 7": variant(params(3), BLOCK_SIZE),
        "L19 min_match 7": variant(params(19), BLOCK_SIZE),
    }


def best_rate(run: Callable[[], object], size: int, tries: int = 4) -> float:
    """MiB/s of the fastest of `tries` runs (on a shared machine the fastest is the least disturbed)."""
    best = float("inf")
    for _ in range(tries):
        began = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - began)
    return size / best / 2**20


def join_into(parts: list[bytes], width: int) -> np.ndarray:
    """The inverse of groups() written into one preallocated array, un-rotated in place (no stack, no copies out)."""
    out = np.empty((len(parts[0]), width), np.uint8)
    for k, part in enumerate(parts):
        out[:, k] = np.frombuffer(part, np.uint8)
    values = out.view(UINT[width]).reshape(-1)
    values[:] = (values >> UINT[width](1)) | (values << UINT[width](8 * width - 1))
    return values


def speed_rows(tensors: dict[str, torch.Tensor], limit: int = 32 << 20) -> dict[str, float]:
    """One core's MiB/s of the codec's encode and decode and of their parts, against alternatives, on fp32 blocks."""
    from shardckpt.format import codec

    data = b"".join(bytes(raw_bytes(tensor)) for tensor in tensors.values())[:limit]
    blocks = [memoryview(data)[offset : offset + BLOCK_SIZE] for offset in range(0, len(data), BLOCK_SIZE)]
    blocks = [block for block in blocks if len(block) % 4 == 0]
    size = sum(len(block) for block in blocks)
    encoder = codec.BlockEncoder()
    packed = [encoder.encode(block, "F32") for block in blocks]
    grouped = [groups(block, 4) for block in blocks]
    base = {"min_match": 7, "write_checksum": 0, "write_content_size": 1, "write_dict_id": 0}
    merged = zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters.from_level(1, **base))
    lean = zstandard.ZstdCompressor(
        compression_params=zstandard.ZstdCompressionParameters.from_level(1, hash_log=6, **base)
    )
    frames = [[merged.compress(group) for group in parts] for parts in grouped]
    reused = zstandard.ZstdDecompressor()
    return {
        "encode: BlockEncoder.encode": best_rate(lambda: [encoder.encode(b, "F32") for b in blocks], size),
        "encode part: rotate + group (numpy)": best_rate(lambda: [groups(b, 4) for b in blocks], size),
        "encode part: zstd of the groups, as merged": best_rate(
            lambda: [[merged.compress(g) for g in parts] for parts in grouped], size
        ),
        "encode part: zstd of the groups, hash_log 6": best_rate(
            lambda: [[lean.compress(g) for g in parts] for parts in grouped], size
        ),
        "decode: decode_block": best_rate(lambda: [codec.decode_block(p, BLOCK_SIZE, "x") for p in packed], size),
        "decode part: a new decompressobj per group (as merged)": best_rate(
            lambda: [
                [zstandard.ZstdDecompressor(max_window_size=1 << 27).decompressobj().decompress(f) for f in fs]
                for fs in frames
            ],
            size,
        ),
        "decode part: one reused ZstdDecompressor per thread": best_rate(
            lambda: [[reused.decompress(f) for f in fs] for fs in frames], size
        ),
        "decode part: the codec's join into its destination": best_rate(
            lambda: [codec._join_into(parts, codec.ROTATE, 4, np.empty(BLOCK_SIZE, np.uint8)) for parts in grouped],
            size,
        ),
        "decode part: join into one preallocated array": best_rate(
            lambda: [join_into(parts, 4) for parts in grouped], size
        ),
        "reference: bytes(block) (a memcpy)": best_rate(lambda: [bytes(b) for b in blocks], size),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--level", type=int, default=1)
    parser.add_argument("--train-steps", type=int, default=200)
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    weights = minilm_weights()
    exp_avg, exp_avg_sq, _ = adamw_moments(args.train_steps)
    sets = {
        "MiniLM fp32": weights,
        "MiniLM bf16": {name: tensor.to(torch.bfloat16) for name, tensor in weights.items()},
        "AdamW exp_avg": exp_avg,
        "AdamW exp_avg_sq": exp_avg_sq,
    }
    found = zipnn_version()
    results: dict[str, dict[str, dict[str, float]]] = {}
    print(f"stored / raw (encode MiB/s: one core; ZipNN: all cores); ZipNN {found or 'not installed'}")
    print(f"{'variant':58}" + "".join(f"{name:>24}" for name in sets))
    table = dict(variants(args.level))
    if found:
        table["ZipNN (its defaults and threads, one stream per set)"] = zipnn_bytes
    for label, run in table.items():
        results[label] = {}
        cells = []
        for name, tensors in sets.items():
            stored, seconds = run(tensors)
            rate = total(tensors) / seconds / 2**20
            results[label][name] = {"ratio": stored / total(tensors), "mib_s": rate}
            cells.append(f"{stored / total(tensors):.4f} ({rate:5.0f})")
        print(f"{label:58}" + "".join(f"{cell:>24}" for cell in cells), flush=True)
    speeds = speed_rows(weights)
    print("\none core, MiniLM fp32 blocks (MiB/s of logical bytes, fastest of 4 runs):")
    for label, rate in speeds.items():
        print(f"  {label:58} {rate:7.0f}")
    write_report(args.json, {"level": args.level, "block_size": BLOCK_SIZE, "results": results, "speed": speeds})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
