"""Regenerate the golden test vectors of the shardckpt format: `python spec/vectors/generate.py`.

valid/<case>/   a committed checkpoint written by the library, plus description.json (what a reader must find).
invalid/<case>/ a copy of a valid checkpoint with exactly one defect, plus expected_error.json (what a reader
                must raise). Every mutation is done here, at the byte level, with its own msgpack/CRC32C/column
                code, so a vector does not depend on the library's encoder being right.

Output is deterministic: fixed attempt id, fixed seeds, and the commit clock pinned to CREATED, so running the
script twice gives byte-identical trees. Only the case directories this script knows are replaced; anything
else under valid/ and invalid/ is left alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import shutil
import types
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import crc32c
import msgpack
import numpy as np
import torch

import shardckpt
import shardckpt.write.commit
from shardckpt.torch_bytes import TORCH_TO_FORMAT

HERE = Path(__file__).resolve().parent
VALID = HERE / "valid"
INVALID = HERE / "invalid"
ATTEMPT = "golden1"
BLOCK = 4096
CREATED = 1767225600.0  # 2026-01-01T00:00:00Z: the commit clock, pinned so manifests are reproducible

FORMAT_DTYPES = TORCH_TO_FORMAT  # the library's table; tests/format/test_spec_vectors.py spells its own out
# Dtypes whose values JSON cannot state exactly (or at all): described by sha256 only.
EXOTIC = {"F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F8_E8M0", "C64"}
MAX_LISTED_VALUES = 64


def data_file(rank: int) -> str:
    return f"data/{rank:05d}-{ATTEMPT}.safetensors"


def local_file(rank: int) -> str:
    return f"ranks/{rank:05d}-{ATTEMPT}.msgpack"


GLOBAL_FILE = f"manifest-{ATTEMPT}.msgpack"


# ------------------------------------------------------------------------------------------- descriptions


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """Row-major bytes of the whole tensor."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return b""
    return flat.view(torch.uint8).numpy().tobytes()


def describe_tensor(tensor: torch.Tensor) -> dict[str, Any]:
    dtype = FORMAT_DTYPES[tensor.dtype]
    entry: dict[str, Any] = {
        "dtype": dtype,
        "shape": list(tensor.shape),
        "sha256": hashlib.sha256(tensor_bytes(tensor)).hexdigest(),
    }
    if dtype not in EXOTIC and tensor.numel() <= MAX_LISTED_VALUES:
        entry["values"] = tensor.tolist()
    return entry


def value_to_json(value: Any) -> Any:
    """A plain value as JSON: tuples, bytes, non-str-keyed maps and non-finite floats as one-key tagged objects."""
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$float": repr(value)}
    if isinstance(value, bytes):
        return {"$bytes": value.hex()}
    if isinstance(value, tuple):
        return {"$tuple": [value_to_json(item) for item in value]}
    if isinstance(value, list):
        return [value_to_json(item) for item in value]
    if isinstance(value, dict):
        if all(isinstance(key, str) and not key.startswith("$") for key in value):
            return {key: value_to_json(item) for key, item in value.items()}
        return {"$map": [[value_to_json(key), value_to_json(item)] for key, item in value.items()]}
    raise TypeError(f"no JSON form for {type(value).__name__}")


def write_json(path: Path, document: Any) -> None:
    path.write_text(json.dumps(document, indent=1, allow_nan=False) + "\n")


@contextlib.contextmanager
def pinned_clock() -> Iterator[None]:
    """The coordinator stamps `created` with time.time(); pin it so the manifests are byte-reproducible."""
    module = shardckpt.write.commit
    original = getattr(module, "time")  # noqa: B009 - the module's `time` import, not an exported name
    setattr(module, "time", types.SimpleNamespace(time=lambda: CREATED))  # noqa: B010
    try:
        yield
    finally:
        setattr(module, "time", original)  # noqa: B010


class ValidCase:
    """One valid vector: W ShardWriters on valid/<name>/, the full tensors, objects, and the expected keys."""

    def __init__(
        self, name: str, description: str, world_size: int, step: int | None, root: Path | None = None
    ) -> None:
        self.name, self.description, self.world_size, self.step = name, description, world_size, step
        self.dir = root if root is not None else VALID / name
        if self.dir.exists():
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True)
        self.writers = [
            shardckpt.ShardWriter(
                str(self.dir), rank=rank, world_size=world_size, attempt=ATTEMPT, block_size=BLOCK, step=step
            )
            for rank in range(world_size)
        ]
        self.tensors: dict[str, torch.Tensor] = {}
        self.objects: dict[str, Any] = {}
        self.rank_objects: dict[str, dict[str, Any]] = {str(rank): {} for rank in range(world_size)}
        self.keys: list[list[str]] = [[] for _ in range(world_size)]
        self._pieces: dict[tuple[int, str], int] = {}

    def tensor(self, name: str, full: torch.Tensor) -> torch.Tensor:
        self.tensors[name] = full
        return full

    def _key(self, rank: int, name: str, piece: torch.Tensor) -> None:
        if piece.numel() == 0:
            return
        count = self._pieces.get((rank, name), 0)
        self._pieces[(rank, name)] = count + 1
        self.keys[rank].append(name if count == 0 else f"{name}#{count}")

    def add_box(self, rank: int, name: str, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> None:
        full = self.tensors[name]
        region = tuple(slice(o, o + n) for o, n in zip(offsets, lengths))
        piece = full[region].clone() if region else full.clone()
        self.writers[rank].add(name, piece, global_shape=tuple(full.shape), offsets=offsets)
        self._key(rank, name, piece)

    def add_flat(self, rank: int, name: str, start: int, stop: int) -> None:
        full = self.tensors[name]
        piece = full.reshape(-1)[start:stop].clone()
        self.writers[rank].add(name, piece, global_shape=tuple(full.shape), flat_offset=start)
        self._key(rank, name, piece)

    def add_object(self, name: str, value: Any, rank: int | None = None) -> None:
        """rank None: a shared value, added by every rank (the coordinator checks they agree)."""
        if rank is None:
            self.objects[name] = value
            for writer in self.writers:
                writer.add_object(name, value)
        else:
            self.rank_objects[str(rank)][name] = value
            self.writers[rank].add_object(name, value, per_rank=True)

    def finish(self) -> None:
        for writer in self.writers:
            writer.close()
        with pinned_clock():
            shardckpt.commit(str(self.dir), world_size=self.world_size, attempt=ATTEMPT)
        write_json(
            self.dir / "description.json",
            {
                "description": self.description,
                "world_size": self.world_size,
                "step": self.step,
                "attempt": ATTEMPT,
                "block_size": BLOCK,
                "tensors": {name: describe_tensor(full) for name, full in self.tensors.items()},
                "objects": {name: value_to_json(value) for name, value in self.objects.items()},
                "rank_objects": {
                    rank: {name: value_to_json(value) for name, value in values.items()}
                    for rank, values in self.rank_objects.items()
                },
                "data_files": {data_file(rank): self.keys[rank] for rank in range(self.world_size)},
            },
        )


def chunk(length: int, parts: int, index: int) -> tuple[int, int]:
    """torch.chunk bounds (FSDP2 Shard): ceil-sized chunks, trailing ones short or empty."""
    size = -(-length // parts) if length else 0
    start = min(index * size, length)
    return start, min(start + size, length)


# ------------------------------------------------------------------------------------------- valid cases


def valid_single_rank_basic() -> None:
    case = ValidCase(
        "single_rank_basic",
        "One rank stores whole tensors: a 2-D F32, an F64 scalar (shape [], one piece with k=0), a 0-element "
        "F32 [0, 5] (no piece, no safetensors key), a BOOL mask and an I64 vector with both int64 extremes.",
        world_size=1,
        step=7,
    )
    gen = torch.Generator().manual_seed(1)
    case.tensor("weight", torch.randn(3, 4, generator=gen))
    case.tensor("scalar", torch.tensor(3.25, dtype=torch.float64))
    case.tensor("empty", torch.zeros(0, 5))
    case.tensor("mask", torch.tensor([[True, False, True], [False, False, True]]))
    case.tensor("index", torch.tensor([-(2**63), -1, 0, 1, 2**63 - 1], dtype=torch.int64))
    for name, full in case.tensors.items():
        case.add_box(0, name, (0,) * full.dim(), tuple(full.shape))
    case.add_object("epoch", 3)
    case.finish()


def valid_every_dtype() -> None:
    case = ValidCase(
        "every_dtype",
        "One small tensor per dtype of the format, named dtype.<NAME>. Integer tensors hold their type's extremes; "
        "each F8 tensor holds all 256 bit patterns (bytes 0..255, shape [16, 16]); C64 is complex randn. F8 and "
        "C64 are described by sha256 only.",
        world_size=1,
        step=1,
    )
    gen = torch.Generator().manual_seed(2)
    case.tensor("dtype.BOOL", torch.tensor([[True, False, False], [True, True, False]]))
    case.tensor("dtype.U8", torch.tensor([0, 1, 127, 128, 254, 255], dtype=torch.uint8))
    case.tensor("dtype.I8", torch.tensor([-128, -1, 0, 1, 126, 127], dtype=torch.int8))
    case.tensor("dtype.I16", torch.tensor([-32768, -1, 0, 1, 32767], dtype=torch.int16))
    case.tensor("dtype.U16", torch.tensor([0, 1, 32768, 65535], dtype=torch.uint16))
    case.tensor("dtype.I32", torch.tensor([-(2**31), -1, 0, 1, 2**31 - 1], dtype=torch.int32))
    case.tensor("dtype.U32", torch.tensor([0, 1, 2**31, 2**32 - 1], dtype=torch.uint32))
    case.tensor("dtype.I64", torch.tensor([-(2**63), -1, 0, 1, 2**63 - 1], dtype=torch.int64))
    case.tensor("dtype.U64", torch.tensor([0, 1, 2**63, 2**64 - 1], dtype=torch.uint64))
    case.tensor(
        "dtype.F16", torch.tensor([[0.0, -0.0, 1.0], [-2.5, 65504.0, 5.960464477539063e-08]], dtype=torch.float16)
    )
    case.tensor("dtype.BF16", torch.tensor([[0.0, -0.0, 1.0], [-2.5, 3.3895313892515355e38, 1e-40]]).bfloat16())
    case.tensor("dtype.F32", torch.randn(2, 3, generator=gen))
    case.tensor("dtype.F64", torch.tensor([[math.pi, -math.e, 0.1], [1e308, -5e-324, 0.0]], dtype=torch.float64))
    patterns = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(16, 16)
    for dtype in (
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.float8_e4m3fnuz,
        torch.float8_e5m2fnuz,
        torch.float8_e8m0fnu,
    ):
        case.tensor(f"dtype.{FORMAT_DTYPES[dtype]}", patterns.clone().view(dtype))
    case.tensor("dtype.C64", torch.complex(torch.randn(2, 3, generator=gen), torch.randn(2, 3, generator=gen)))
    assert {full.dtype for full in case.tensors.values()} == set(FORMAT_DTYPES)
    for name, full in case.tensors.items():
        case.add_box(0, name, (0,) * full.dim(), tuple(full.shape))
    case.finish()


def valid_fsdp_uneven_4_ranks(seed: int = 3, root: Path | None = None) -> None:
    case = ValidCase(
        "fsdp_uneven_4_ranks",
        "FSDP2 Shard(0) on 4 ranks with torch.chunk bounds, dim 0 not divisible by 4: layer.weight [5, 3] and "
        "layer.bias [5] split 2,2,1,0 rows (rank 3 holds an empty shard and stores no piece of them), emb [9, 2] "
        "BF16 split 3,3,3,0, tiny [2, 4] I32 split 1,1,0,0; the I64 scalar step is stored by rank 0 only. "
        "Per-rank objects rng = (rank, 1234).",
        world_size=4,
        step=100,
        root=root,
    )
    gen = torch.Generator().manual_seed(seed)
    case.tensor("layer.weight", torch.randn(5, 3, generator=gen))
    case.tensor("layer.bias", torch.randn(5, generator=gen))
    case.tensor("emb", torch.randn(9, 2, generator=gen).bfloat16())
    case.tensor("tiny", torch.randint(-1000, 1000, (2, 4), generator=gen, dtype=torch.int32))
    case.tensor("step", torch.tensor(100, dtype=torch.int64))
    for rank in range(4):
        for name in ("layer.weight", "layer.bias", "emb", "tiny"):
            full = case.tensors[name]
            lo, hi = chunk(full.shape[0], 4, rank)
            case.add_box(rank, name, (lo,) + (0,) * (full.dim() - 1), (hi - lo,) + tuple(full.shape[1:]))
        if rank == 0:
            case.add_box(0, "step", (), ())
        case.add_object("rng", (rank, 1234), rank=rank)
    case.add_object("epoch", 1)
    case.finish()


def valid_grid_2d_fsdp_tp() -> None:
    case = ValidCase(
        "grid_2d_fsdp_tp",
        "A 2x2 device mesh (dp, tp), rank = 2*dp + tp, placements (Shard(0), Shard(1)) with torch.chunk bounds: "
        "attn.w [6, 10] F32 in 3x5 tiles, mlp.w [5, 7] F16 in uneven tiles (rows 3,2 x cols 4,3), block.w "
        "[4, 6, 2] F32 (dims 0 and 1 sharded). norm.bias [6] is (Shard(0), Replicate()): only the tp=0 ranks "
        "store it, so ranks 1 and 3 store no piece of it.",
        world_size=4,
        step=5,
    )
    gen = torch.Generator().manual_seed(4)
    case.tensor("attn.w", torch.randn(6, 10, generator=gen))
    case.tensor("mlp.w", torch.randn(5, 7, generator=gen).half())
    case.tensor("block.w", torch.randn(4, 6, 2, generator=gen))
    case.tensor("norm.bias", torch.randn(6, generator=gen))
    for rank in range(4):
        dp, tp = divmod(rank, 2)
        for name in ("attn.w", "mlp.w", "block.w"):
            full = case.tensors[name]
            r0, r1 = chunk(full.shape[0], 2, dp)
            c0, c1 = chunk(full.shape[1], 2, tp)
            case.add_box(rank, name, (r0, c0) + (0,) * (full.dim() - 2), (r1 - r0, c1 - c0) + tuple(full.shape[2:]))
        if tp == 0:
            r0, r1 = chunk(6, 2, dp)
            case.add_box(rank, "norm.bias", (r0,), (r1 - r0,))
    case.finish()


def valid_flat_zero_partitions() -> None:
    case = ValidCase(
        "flat_zero_partitions",
        "ZeRO-style flat partitions on 3 ranks: a [7, 5], b [11], c [3, 4, 2] (all F32) are concatenated into one "
        "flat buffer of 70 elements cut into [0, 24), [24, 48), [48, 70). So a is cut mid-row at element 24 "
        "(rank 0: a[0:24], rank 1: a[24:35]), b lies whole on rank 1, c is cut at element 2 (rank 1: c[0:2], "
        "rank 2: c[2:24]). opt.step is an F32 scalar stored as one flat piece (start [0], length [1]) by rank 0.",
        world_size=3,
        step=12,
    )
    gen = torch.Generator().manual_seed(5)
    params = {
        "a": case.tensor("a", torch.randn(7, 5, generator=gen)),
        "b": case.tensor("b", torch.randn(11, generator=gen)),
        "c": case.tensor("c", torch.randn(3, 4, 2, generator=gen)),
    }
    case.tensor("opt.step", torch.tensor(12.0))
    bounds = [(0, 24), (24, 48), (48, 70)]
    for rank, (lo, hi) in enumerate(bounds):
        base = 0
        for name, full in params.items():
            start, stop = max(lo, base), min(hi, base + full.numel())
            if start < stop:
                case.add_flat(rank, name, start - base, stop - base)
            base += full.numel()
        if rank == 0:
            case.add_flat(0, "opt.step", 0, 1)
    case.finish()


def valid_multi_block_pieces() -> None:
    case = ValidCase(
        "multi_block_pieces",
        "Block size 4096 with pieces of several blocks whose sizes are not multiples of it, at offsets that are "
        "not block-aligned. big [160, 37] F32 (23,680 bytes): rank 0 stores rows 0:70 (key big, 10,360 bytes, "
        "3 blocks) and rows 130:160 (key big#1, 4,440 bytes, 2 blocks), with small [3] I16 added between them; "
        "rank 1 stores rows 70:130 (8,880 bytes, 3 blocks). flatm [1500] F64 is split flat at element 777 "
        "(6,216 and 5,784 bytes, 2 blocks each).",
        world_size=2,
        step=3,
    )
    gen = torch.Generator().manual_seed(6)
    case.tensor("big", torch.randn(160, 37, generator=gen))
    case.tensor("small", torch.tensor([-7, 0, 7], dtype=torch.int16))
    case.tensor("flatm", torch.randn(1500, generator=gen, dtype=torch.float64))
    case.add_box(0, "big", (0, 0), (70, 37))
    case.add_box(0, "small", (0,), (3,))
    case.add_box(0, "big", (130, 0), (30, 37))
    case.add_flat(0, "flatm", 0, 777)
    case.add_box(1, "big", (70, 0), (60, 37))
    case.add_flat(1, "flatm", 777, 1500)
    case.finish()


OBJECT_VALUES: dict[str, Any] = {
    "epoch": 3,
    "lr": 0.001,
    "none": None,
    "flag": True,
    "text": "héllo ✓ \u4e16\u754c",
    "empty_str": "",
    "blob": bytes(range(256)),
    "empty_blob": b"",
    "floats": [0.0, -0.0, 1.5, 1e308, 5e-324, float("inf"), float("-inf"), float("nan")],
    "ints": [0, -1, 2**63 - 1, -(2**63), 2**64 - 1],
    "tuples": ((), (1,), ((2, 3), [4, (5,)]), ("a", None, b"\x00")),
    "scheduler": {"milestones": (10, 20), "gamma": 0.1, "last_epoch": 2, "state": {"base_lrs": [0.1, 0.01]}},
    "int_keys": {1: "one", -2: {3: None, 4: (5, 6)}, 2**40: [], "mixed": {0: b"zero"}},
    "dollar_keys": {"$tuple": "not a tuple"},
    "empty_map": {},
    "empty_list": [],
}


def valid_objects() -> None:
    case = ValidCase(
        "objects",
        "Plain values on 2 ranks with step null: shared values of every msgpack kind (nil, bool, ints at both "
        "ends of the range, floats incl. -0.0/inf/nan, str, bin, arrays, tuples (ext type 1, nested), maps with "
        "int keys, empty containers) and per-rank values (rng tuples, bytes). In description.json a tuple is "
        '{"$tuple": [...]}, bytes {"$bytes": hex}, a map with a non-str (or "$"-prefixed) key {"$map": [[k, v], '
        '...]}, a non-finite float {"$float": "nan"|"inf"|"-inf"}.',
        world_size=2,
        step=None,
    )
    case.tensor("w", torch.arange(4, dtype=torch.float32).reshape(2, 2))
    case.add_box(0, "w", (0, 0), (1, 2))
    case.add_box(1, "w", (1, 0), (1, 2))
    for name, value in OBJECT_VALUES.items():
        case.add_object(name, value)
    for rank in range(2):
        case.add_object("rng", (rank, 42, bytes([rank]) * 8), rank=rank)
        case.add_object("loader", {"position": 1000 * rank, "order": (rank, 1 - rank)}, rank=rank)
    case.finish()


def valid_minor_version_unknown_fields() -> None:
    case = ValidCase(
        "minor_version_unknown_fields",
        "What a future 1.1 writer may produce: version [1, 1] in COMMITTED, the global and the local manifests "
        "(data files untouched), an empty must_understand in all three, and unknown keys at every level "
        "(documents, file entries, tensor entries, piece tables, columns, object entries). A 1.0 reader MUST read "
        "it exactly like the 1.0 checkpoint it was derived from.",
        world_size=2,
        step=9,
    )
    gen = torch.Generator().manual_seed(7)
    case.tensor("w", torch.randn(3, 2, generator=gen))
    case.tensor("v", torch.randn(5, generator=gen))
    case.add_box(0, "w", (0, 0), (2, 2))
    case.add_box(1, "w", (2, 0), (1, 2))
    case.add_flat(0, "v", 0, 1)
    case.add_flat(1, "v", 1, 5)
    case.add_object("epoch", 4)
    case.add_object("rng", (1, 2), rank=1)
    case.finish()

    def future_table(table: dict[str, Any]) -> None:
        table["x_future_table_field"] = [1, 2, 3]
        for value in table.values():
            if isinstance(value, dict) and "enc" in value:
                value["x_future_column_field"] = "ignored"

    def future_document(document: dict[str, Any]) -> None:
        document["version"] = [1, 1]
        document["must_understand"] = []
        document["x_future_field"] = {"nested": [1, (2, 3)], "bin": b"\x01"}
        tensors = document["tensors"]
        if isinstance(tensors, dict):  # a columnar tensor table (local manifests)
            future_table(tensors)
        else:
            for tensor in tensors:
                tensor["x_future_tensor_field"] = {"quantized": False}
                future_table(tensor["pieces"])
        if isinstance(document.get("pieces"), dict):  # a columnar piece table (local manifests)
            future_table(document["pieces"])
        if isinstance(document.get("crc32c"), dict):  # the block checksum column (local manifests)
            document["crc32c"]["x_future_column_field"] = 0
        for entry in document.get("objects", []):
            entry["x_future_object_field"] = 1

    for rank in range(2):
        edit_local(case.dir, rank, future_document)

    def future_global(document: dict[str, Any]) -> None:
        future_document(document)
        for entry in document["files"]:
            entry["x_future_file_field"] = "sha256-would-go-here"

    def future_committed(document: dict[str, Any]) -> None:
        document["version"] = [1, 1]
        document["must_understand"] = []
        document["x_future_field"] = {"replicas": ["elsewhere"]}

    edit_global(case.dir, future_global)
    edit_committed(case.dir, future_committed)


# ------------------------------------------------------------------------- byte-level editing helpers


def unpack(raw: bytes) -> Any:
    # Extension types (tuples) pass through unchanged so that re-packing reproduces them byte for byte.
    return msgpack.unpackb(raw, raw=False, strict_map_key=False, ext_hook=msgpack.ExtType)


def pack(document: Any) -> bytes:
    return msgpack.packb(document, use_bin_type=True)


def read_committed(root: Path) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((root / "COMMITTED").read_text())
    return document


def write_committed(root: Path, document: dict[str, Any]) -> None:
    # The reference writer's layout: indent 1, trailing newline.
    (root / "COMMITTED").write_text(json.dumps(document, indent=1) + "\n")


def edit_committed(root: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    document = read_committed(root)
    edit(document)
    write_committed(root, document)


def set_global_bytes(root: Path, raw: bytes, *, fix_chain: bool = True) -> None:
    """Replace the global manifest; fix_chain: update COMMITTED's size and CRC32C so only the content is wrong."""
    (root / GLOBAL_FILE).write_bytes(raw)
    if fix_chain:

        def fix(document: dict[str, Any]) -> None:
            document["manifest_size"] = len(raw)
            document["manifest_crc32c"] = crc32c.crc32c(raw)

        edit_committed(root, fix)


def edit_global(root: Path, edit: Callable[[dict[str, Any]], None], *, fix_chain: bool = True) -> None:
    raw = (root / GLOBAL_FILE).read_bytes()
    document = unpack(raw)
    assert pack(document) == raw, "re-encoding must reproduce the writer's bytes"
    edit(document)
    set_global_bytes(root, pack(document), fix_chain=fix_chain)


def edit_local(root: Path, rank: int, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit a local manifest and update the global file table (index_size, index_crc32c) and COMMITTED."""
    path = root / local_file(rank)
    raw = path.read_bytes()
    document = unpack(raw)
    assert pack(document) == raw, "re-encoding must reproduce the writer's bytes"
    edit(document)
    new = pack(document)
    path.write_bytes(new)

    def fix(global_doc: dict[str, Any]) -> None:
        (entry,) = [f for f in global_doc["files"] if f["rank"] == rank]
        entry["index_size"] = len(new)
        entry["index_crc32c"] = crc32c.crc32c(new)

    edit_global(root, fix)


def column_values(column: dict[str, Any]) -> list[int]:
    """Decode a delta-zlib column (SPEC section 5) without the library."""
    assert column["enc"] == "delta-zlib"
    deltas = np.frombuffer(zlib.decompress(column["data"]), dtype="<i8")
    assert deltas.size == column["n"]
    values: list[int] = np.cumsum(deltas, dtype=np.int64).tolist()
    return values


def make_column(values: list[int]) -> dict[str, Any]:
    array = np.array(values, dtype=np.int64)
    deltas = np.diff(array, prepend=np.int64(0)) if array.size else array
    return {"enc": "delta-zlib", "n": len(values), "data": zlib.compress(deltas.astype("<i8").tobytes(), 6)}


def tensor_entry(document: dict[str, Any], name: str) -> dict[str, Any]:
    (entry,) = [t for t in document["tensors"] if t["name"] == name]
    found: dict[str, Any] = entry
    return found


def get_pieces(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """The piece table as rows {file, offset, start: [k], length: [k]} (columns are dimension-major)."""
    table = entry["pieces"]
    count = table["count"]
    k = 1 if entry["layout"] == "flat" else len(entry["shape"])
    file, offset = column_values(table["file"]), column_values(table["offset"])
    start, length = column_values(table["start"]), column_values(table["length"])
    return [
        {
            "file": file[i],
            "offset": offset[i],
            "start": [start[d * count + i] for d in range(k)],
            "length": [length[d * count + i] for d in range(k)],
        }
        for i in range(count)
    ]


def set_pieces(entry: dict[str, Any], pieces: list[dict[str, Any]]) -> None:
    k = 1 if entry["layout"] == "flat" else len(entry["shape"])
    entry["pieces"] = {
        "count": len(pieces),
        "file": make_column([p["file"] for p in pieces]),
        "offset": make_column([p["offset"] for p in pieces]),
        "start": make_column([p["start"][d] for d in range(k) for p in pieces]),
        "length": make_column([p["length"][d] for d in range(k) for p in pieces]),
    }


def edit_pieces(root: Path, name: str, edit: Callable[[list[dict[str, Any]]], None]) -> None:
    def apply(document: dict[str, Any]) -> None:
        entry = tensor_entry(document, name)
        pieces = get_pieces(entry)
        edit(pieces)
        set_pieces(entry, pieces)

    edit_global(root, apply)


def piece_offset(root: Path, name: str, index: int) -> int:
    document = unpack((root / GLOBAL_FILE).read_bytes())
    return int(get_pieces(tensor_entry(document, name))[index]["offset"])


# ------------------------------------------------------------------------------------------ invalid cases

INVALID_CASES: dict[str, Callable[[Path], dict[str, Any]]] = {}


def invalid(name: str, source: str) -> Callable[[Callable[[Path], dict[str, Any]]], Callable[[Path], dict[str, Any]]]:
    """Register an invalid case: copy valid/<source>/ (without description.json), then the function mutates it."""

    def register(mutate: Callable[[Path], dict[str, Any]]) -> Callable[[Path], dict[str, Any]]:
        def build(root: Path) -> dict[str, Any]:
            shutil.copytree(VALID / source, root, ignore=shutil.ignore_patterns("description.json"))
            expected = mutate(root)
            return {**expected, "source": source}

        INVALID_CASES[name] = build
        return build

    return register


def expect(
    error: str,
    operation: str,
    rule: str,
    description: str,
    message_contains: list[str],
    verify_contains: list[str] | None = None,
) -> dict[str, Any]:
    return {
        "error": error,
        "operation": operation,
        "rule": rule,
        "description": description,
        "message_contains": message_contains,
        "verify_contains": verify_contains if verify_contains is not None else [],
    }


@invalid("no_committed", "single_rank_basic")
def _no_committed(root: Path) -> dict[str, Any]:
    (root / "COMMITTED").unlink()
    return expect(
        "NotCommittedError",
        "open",
        "SPEC.md §3/§9: a checkpoint without COMMITTED does not exist; a reader MUST refuse it",
        "every other file of a complete save is present, COMMITTED is missing",
        ["COMMITTED"],
    )


@invalid("committed_not_json", "single_rank_basic")
def _committed_not_json(root: Path) -> dict[str, Any]:
    raw = (root / "COMMITTED").read_bytes()
    (root / "COMMITTED").write_bytes(raw[: len(raw) // 2])
    return expect(
        "FormatError",
        "open",
        "SPEC.md §8 step 1 / appendix C: COMMITTED MUST be a JSON object; undecodable -> FormatError",
        "COMMITTED cut in half (unterminated JSON)",
        ["COMMITTED"],
    )


@invalid("committed_unknown_major_version", "single_rank_basic")
def _committed_major(root: Path) -> dict[str, Any]:
    edit_committed(root, lambda d: d.update(version=[2, 0]))
    return expect(
        "FormatError",
        "open",
        "SPEC.md §2: a reader MUST refuse a document whose major version it does not implement",
        'COMMITTED says "version": [2, 0]',
        ["COMMITTED", "2.0"],
    )


@invalid("committed_wrong_manifest_crc", "single_rank_basic")
def _committed_crc(root: Path) -> dict[str, Any]:
    edit_committed(root, lambda d: d.update(manifest_crc32c=(d["manifest_crc32c"] + 1) % (1 << 32)))
    return expect(
        "IntegrityError",
        "open",
        "SPEC.md §8 step 2: the global manifest's CRC32C MUST equal COMMITTED's manifest_crc32c",
        "manifest_crc32c in COMMITTED is off by one; the manifest itself is intact",
        [GLOBAL_FILE],
    )


@invalid("committed_manifest_path_traversal", "single_rank_basic")
def _committed_traversal(root: Path) -> dict[str, Any]:
    edit_committed(root, lambda d: d.update(manifest="../x"))
    return expect(
        "FormatError",
        "open",
        "SPEC.md §3 path rules: stored paths MUST be layout names (no '..'); refused before touching storage",
        'COMMITTED names "../x" as its manifest',
        ["COMMITTED", "../x"],
    )


@invalid("committed_too_large", "single_rank_basic")
def _committed_too_large(root: Path) -> dict[str, Any]:
    raw = (root / "COMMITTED").read_bytes()
    # Still a valid JSON document: trailing whitespace only, so only the size limit is broken.
    (root / "COMMITTED").write_bytes(raw + b" " * ((64 << 10) + 1 - len(raw)))
    return expect(
        "FormatError",
        "open",
        "SPEC.md §8 step 1 and §10: COMMITTED is at most 64 KiB; larger -> FormatError",
        "COMMITTED padded with trailing spaces to 65,537 bytes (valid JSON otherwise)",
        ["COMMITTED"],
    )


@invalid("committed_world_size_mismatch", "fsdp_uneven_4_ranks")
def _committed_world_size(root: Path) -> dict[str, Any]:
    edit_committed(root, lambda d: d.update(world_size=3))
    return expect(
        "FormatError",
        "open",
        "SPEC.md §8 step 2: the global manifest's attempt and world_size MUST equal those of COMMITTED",
        "COMMITTED says world_size 3, the (intact) global manifest 4",
        ["world_size"],
    )


@invalid("manifest_missing", "single_rank_basic")
def _manifest_missing(root: Path) -> dict[str, Any]:
    (root / GLOBAL_FILE).unlink()
    return expect(
        "NotFoundError",
        "open",
        "SPEC.md §8 step 2 / §13: the manifest COMMITTED names MUST exist (missing file -> NotFoundError)",
        "the global manifest is deleted",
        [GLOBAL_FILE],
    )


@invalid("manifest_truncated", "single_rank_basic")
def _manifest_truncated(root: Path) -> dict[str, Any]:
    raw = (root / GLOBAL_FILE).read_bytes()
    (root / GLOBAL_FILE).write_bytes(raw[: len(raw) - 17])
    return expect(
        "IntegrityError",
        "open",
        "SPEC.md §8 step 2: the global manifest's size MUST equal COMMITTED's manifest_size",
        "last 17 bytes of the global manifest cut off",
        [GLOBAL_FILE],
    )


@invalid("manifest_trailing_bytes", "single_rank_basic")
def _manifest_trailing(root: Path) -> dict[str, Any]:
    raw = (root / GLOBAL_FILE).read_bytes()
    set_global_bytes(root, raw + pack({"extra": 1}))
    return expect(
        "FormatError",
        "open",
        "SPEC.md §1: a manifest file is exactly one msgpack map with no trailing bytes",
        "a second msgpack map appended to the global manifest; COMMITTED's size and CRC32C updated to match",
        [GLOBAL_FILE],
    )


@invalid("manifest_unknown_major_version", "fsdp_uneven_4_ranks")
def _manifest_major(root: Path) -> dict[str, Any]:
    edit_global(root, lambda d: d.update(version=[2, 0]))
    return expect(
        "FormatError",
        "open",
        "SPEC.md §2: a reader MUST refuse a document whose major version it does not implement",
        'global manifest says "version": [2, 0]; COMMITTED updated so only the version is wrong',
        [GLOBAL_FILE, "2.0"],
    )


@invalid("manifest_must_understand_unknown", "fsdp_uneven_4_ranks")
def _manifest_must_understand(root: Path) -> dict[str, Any]:
    edit_global(root, lambda d: d.update(must_understand=["zstd-columns"]))
    return expect(
        "FormatError",
        "open",
        "SPEC.md §2: a reader MUST refuse a document whose must_understand lists an entry it does not understand",
        'global manifest lists must_understand ["zstd-columns"]',
        [GLOBAL_FILE, "zstd-columns"],
    )


@invalid("manifest_file_path_absolute", "fsdp_uneven_4_ranks")
def _manifest_absolute(root: Path) -> dict[str, Any]:
    edit_global(root, lambda d: d["files"][1].update(data="/etc/passwd"))
    return expect(
        "FormatError",
        "open",
        "SPEC.md §3 path rules: no leading '/'; a reader MUST refuse any other path before it touches storage",
        'files[1].data is "/etc/passwd"',
        [GLOBAL_FILE, "/etc/passwd"],
    )


@invalid("manifest_file_path_url", "fsdp_uneven_4_ranks")
def _manifest_url(root: Path) -> dict[str, Any]:
    edit_global(root, lambda d: d["files"][2].update(data="s3://bucket/x"))
    return expect(
        "FormatError",
        "open",
        "SPEC.md §3 path rules: no ':' (hence no URL); a reader MUST refuse any other path",
        'files[2].data is "s3://bucket/x"',
        [GLOBAL_FILE, "s3://bucket/x"],
    )


@invalid("manifest_duplicate_tensor", "fsdp_uneven_4_ranks")
def _manifest_duplicate(root: Path) -> dict[str, Any]:
    edit_global(root, lambda d: d["tensors"].append(dict(tensor_entry(d, "layer.bias"))))
    return expect(
        "FormatError",
        "open",
        "SPEC.md §6: tensor names are unique within a manifest's tensors",
        "the entry of layer.bias appears twice in the global manifest",
        [GLOBAL_FILE, "layer.bias"],
    )


@invalid("manifest_piece_out_of_shape", "fsdp_uneven_4_ranks")
def _manifest_out_of_shape(root: Path) -> dict[str, Any]:
    def edit(pieces: list[dict[str, Any]]) -> None:
        pieces[1]["start"][0] = 4  # rows 4:6 of a 5-row tensor

    edit_pieces(root, "layer.weight", edit)
    return expect(
        "FormatError",
        "read",
        "SPEC.md §6: a reader MUST refuse a piece with start + length beyond the extent (shape[d])",
        "piece 1 of layer.weight [5, 3] moved to rows 4:6",
        ["layer.weight"],
    )


@invalid("manifest_piece_past_file_end", "fsdp_uneven_4_ranks")
def _manifest_past_end(root: Path) -> dict[str, Any]:
    size = (root / data_file(2)).stat().st_size

    def edit(pieces: list[dict[str, Any]]) -> None:
        assert pieces[2]["file"] == 2
        pieces[2]["offset"] = size - 4  # a 12-byte piece starting 4 bytes before the end of its file

    edit_pieces(root, "layer.weight", edit)
    return expect(
        "FormatError",
        "read",
        "SPEC.md §6: a reader MUST refuse a piece whose offset + S exceeds the data_size of its file",
        f"piece 2 of layer.weight (rank 2, 12 bytes) given offset {size - 4} in a file of {size} bytes",
        ["layer.weight"],
    )


@invalid("manifest_gap", "fsdp_uneven_4_ranks")
def _manifest_gap(root: Path) -> dict[str, Any]:
    def edit(pieces: list[dict[str, Any]]) -> None:
        del pieces[1]

    edit_pieces(root, "layer.weight", edit)
    return expect(
        "CoverageError",
        "read",
        "SPEC.md §6 exact cover: every element lies in exactly one piece; a reader MUST check it (no gap)",
        "piece 1 (rows 2:4) of layer.weight dropped from the global manifest: rows 2:4 are covered by no piece",
        ["layer.weight", "covered by no piece"],
    )


@invalid("manifest_overlap", "grid_2d_fsdp_tp")
def _manifest_overlap(root: Path) -> dict[str, Any]:
    edit_pieces(root, "attn.w", lambda pieces: pieces.append(dict(pieces[0])))
    return expect(
        "CoverageError",
        "read",
        "SPEC.md §6 exact cover: every element lies in exactly one piece; a reader MUST check it (no overlap)",
        "piece 0 of attn.w (rows 0:3, cols 0:5 on rank 0) listed twice in the global manifest",
        ["attn.w", "overlap"],
    )


@invalid("manifest_column_zip_bomb", "fsdp_uneven_4_ranks")
def _manifest_zip_bomb(root: Path) -> dict[str, Any]:
    bomb = zlib.compress(bytes(16 << 20), 9)  # 16 MiB of zeros in ~16 KiB; the column declares n = 4 (32 bytes)

    def edit(document: dict[str, Any]) -> None:
        column = tensor_entry(document, "layer.weight")["pieces"]["offset"]
        assert column["n"] == 3
        column["data"] = bomb

    edit_global(root, edit)
    return expect(
        "FormatError",
        "read",
        "SPEC.md §5: a decoder MUST bound decompression to 8n + 1 bytes and refuse a column that does not "
        "inflate to exactly 8n bytes",
        f"pieces.offset of layer.weight (n = 3, 24 bytes) is a {len(bomb)}-byte zlib stream of 16 MiB of zeros",
        ["layer.weight", "pieces.offset"],
    )


@invalid("manifest_negative_shape", "fsdp_uneven_4_ranks")
def _manifest_negative_shape(root: Path) -> dict[str, Any]:
    edit_global(root, lambda d: tensor_entry(d, "layer.bias").update(shape=[-5]))
    return expect(
        "FormatError",
        "open",
        "SPEC.md §6 / §10: each dimension is an integer in 0..2^62 - 1",
        "layer.bias has shape [-5]",
        [GLOBAL_FILE, "layer.bias"],
    )


@invalid("manifest_huge_shape", "fsdp_uneven_4_ranks")
def _manifest_huge_shape(root: Path) -> dict[str, Any]:
    edit_global(root, lambda d: tensor_entry(d, "layer.weight").update(shape=[2**40, 2**40]))
    return expect(
        "FormatError",
        "open",
        "SPEC.md §6 / §10: numel (the product of the shape) MUST be at most 2^62 - 1",
        "layer.weight has shape [2^40, 2^40] (each dimension legal, numel 2^80)",
        [GLOBAL_FILE, "layer.weight"],
    )


@invalid("manifest_unknown_dtype", "fsdp_uneven_4_ranks")
def _manifest_unknown_dtype(root: Path) -> dict[str, Any]:
    edit_global(root, lambda d: tensor_entry(d, "layer.bias").update(dtype="F4"))
    return expect(
        "FormatError",
        "open",
        "SPEC.md §2 / §6: dtype is a closed enumeration; a reader MUST refuse a value it does not define",
        'layer.bias has dtype "F4"',
        [GLOBAL_FILE, "layer.bias", "F4"],
    )


@invalid("manifest_object_timestamp_ext", "objects")
def _manifest_timestamp(root: Path) -> dict[str, Any]:
    def edit(document: dict[str, Any]) -> None:
        (entry,) = [o for o in document["objects"] if o["name"] == "epoch"]
        entry["value"] = msgpack.Timestamp(1767225600)  # packs as ext type -1 (timestamp 32)

    edit_global(root, edit)
    return expect(
        "FormatError",
        "open",
        "SPEC.md §7: a reader MUST refuse any extension type other than 1 (tuple), including the timestamp type -1",
        "the value of shared object epoch is a msgpack timestamp (ext type -1)",
        [GLOBAL_FILE],
    )


@invalid("manifest_piece_disagrees_with_local", "fsdp_uneven_4_ranks")
def _manifest_piece_disagrees(root: Path) -> dict[str, Any]:
    def edit(pieces: list[dict[str, Any]]) -> None:
        # Pieces 0 and 1 (rows 0:2 of rank 0, rows 2:4 of rank 1) trade places: cover, offsets and sizes stay
        # consistent, but the global manifest now disagrees with both local manifests about start.
        pieces[0]["start"], pieces[1]["start"] = pieces[1]["start"], pieces[0]["start"]

    edit_pieces(root, "layer.weight", edit)
    return expect(
        "IntegrityError",
        "read",
        "SPEC.md §8 step 4: every piece a reader uses MUST be the same piece in its file's local manifest: offset, "
        "size, tensor name, dtype, shape, start and length",
        "the starts of layer.weight pieces 0 (rank 0) and 1 (rank 1) swapped in the global manifest only "
        "(offsets and sizes still match the local manifests; the starts do not)",
        ["layer.weight"],
        ["layer.weight"],
    )


@invalid("local_manifest_tampered", "fsdp_uneven_4_ranks")
def _local_tampered(root: Path) -> dict[str, Any]:
    path = root / local_file(1)
    raw = bytearray(path.read_bytes())
    position = raw.index(b"layer.weight") + 2
    raw[position] ^= 0x01  # "layer" -> "laxer": still valid msgpack, only the CRC32C chain catches it
    path.write_bytes(bytes(raw))
    return expect(
        "IntegrityError",
        "read",
        "SPEC.md §8 step 3: a local manifest's size and CRC32C MUST equal index_size and index_crc32c",
        f"one bit of {local_file(1)} flipped (byte {position}), global manifest and COMMITTED intact",
        [local_file(1)],
        [local_file(1)],
    )


@invalid("data_bit_flip", "multi_block_pieces")
def _data_bit_flip(root: Path) -> dict[str, Any]:
    offset = piece_offset(root, "big", 2)  # rank 1's piece: rows 70:130, 8,880 bytes, 3 blocks
    position = offset + BLOCK + 100  # inside block 1 of the piece
    path = root / data_file(1)
    raw = bytearray(path.read_bytes())
    raw[position] ^= 0x10
    path.write_bytes(bytes(raw))
    return expect(
        "IntegrityError",
        "read",
        "SPEC.md §8: a reader MUST verify the CRC32C of every block it reads before it uses any byte of it",
        f"one bit flipped at byte {position} of {data_file(1)}: block 1 of the piece of big at byte {offset}",
        [data_file(1), "big", "block 1"],
        [data_file(1)],
    )


@invalid("data_truncated", "multi_block_pieces")
def _data_truncated(root: Path) -> dict[str, Any]:
    path = root / data_file(0)
    raw = path.read_bytes()
    path.write_bytes(raw[:-100])
    return expect(
        "IntegrityError",
        "read",
        "SPEC.md §8 step 5: every range read MUST return exactly the bytes requested; a short read is an "
        "IntegrityError",
        f"last 100 bytes of {data_file(0)} cut off (inside the last piece, flatm)",
        [data_file(0)],
        [data_file(0)],
    )


@invalid("data_trailing_bytes", "fsdp_uneven_4_ranks")
def _data_trailing(root: Path) -> dict[str, Any]:
    path = root / data_file(2)
    path.write_bytes(path.read_bytes() + bytes(8))
    return expect(
        "IntegrityError",
        "read",
        "SPEC.md §8 step 5: before returning data read from a data file, a reader MUST refuse a file whose size "
        "differs from its data_size",
        f"8 zero bytes appended to {data_file(2)}; every piece is intact, only the file's size is wrong",
        [data_file(2)],
        [data_file(2)],
    )


@invalid("data_header_mismatch", "fsdp_uneven_4_ranks")
def _data_header(root: Path) -> dict[str, Any]:
    path = root / data_file(0)
    raw = path.read_bytes()
    assert raw.count(b'"emb":') == 1
    path.write_bytes(raw.replace(b'"emb":', b'"emx":', 1))
    header_size = unpack((root / local_file(0)).read_bytes())["header_size"]
    header_crc = crc32c.crc32c(raw.replace(b'"emb":', b'"emx":', 1)[:header_size])
    edit_local(root, 0, lambda document: document.update(header_crc32c=header_crc))
    return expect(
        "FormatError",
        "verify",
        "SPEC.md §4 'What a verifier checks in the header': one key per piece of the local manifest, named as §4 "
        "says; readers never need the header",
        f'the header key "emb" of {data_file(0)} renamed to "emx" (same length, data untouched); header_crc32c '
        "updated to match, so only the header's content is wrong",
        [data_file(0), "emb"],
        [data_file(0), "emb"],
    )


@invalid("data_file_missing", "fsdp_uneven_4_ranks")
def _data_missing(root: Path) -> dict[str, Any]:
    (root / data_file(1)).unlink()
    return expect(
        "NotFoundError",
        "read",
        "SPEC.md §8 / §13: every file the chain names MUST exist; a missing one is NotFoundError",
        f"{data_file(1)} is deleted; its local manifest is intact",
        [data_file(1)],
        [data_file(1)],
    )


@invalid("data_replaced_by_other_checkpoint_file", "fsdp_uneven_4_ranks")
def _data_replaced(root: Path) -> dict[str, Any]:
    # The same save with other values (seed 33) into a scratch directory: same attempt id, same piece sizes, so
    # its rank-1 data file has the same name, size and header as ours. Only the block checksums tell them apart.
    other = root.parent / f".{root.name}.other"
    if other.exists():
        shutil.rmtree(other)
    try:
        valid_fsdp_uneven_4_ranks(seed=33, root=other)
        assert (other / data_file(1)).read_bytes()[:64] == (root / data_file(1)).read_bytes()[:64]
        assert (other / data_file(1)).stat().st_size == (root / data_file(1)).stat().st_size
        shutil.copyfile(other / data_file(1), root / data_file(1))
    finally:
        shutil.rmtree(other, ignore_errors=True)
    return expect(
        "IntegrityError",
        "read",
        "SPEC.md §8: a reader MUST verify the CRC32C of every block it reads before it uses any byte of it",
        f"{data_file(1)} replaced by the file of the same name from another checkpoint (same save, other values): "
        "same name, size and header, other bytes",
        [data_file(1)],
        [data_file(1)],
    )


def pack_map_pairs(pairs: list[tuple[Any, Any]]) -> bytes:
    """A msgpack map from (key, value) pairs, so that a key can repeat (msgpack-python would merge them)."""
    count = len(pairs)
    header = bytes([0x80 | count]) if count < 16 else b"\xde" + count.to_bytes(2, "big")
    return header + b"".join(pack(key) + pack(value) for key, value in pairs)


@invalid("committed_duplicate_key", "single_rank_basic")
def _committed_duplicate_key(root: Path) -> dict[str, Any]:
    document = read_committed(root)
    right = document["manifest_crc32c"]
    text = json.dumps(document, indent=1)
    # A wrong CRC first, the right one last: a parser that lets the last key win sees a consistent marker.
    text = text.replace(
        '\n "manifest_crc32c"', f'\n "manifest_crc32c": {(right + 1) % (1 << 32)},\n "manifest_crc32c"', 1
    )
    (root / "COMMITTED").write_text(text + "\n")
    return expect(
        "FormatError",
        "open",
        "SPEC.md appendix C: keys of the COMMITTED object MUST NOT repeat",
        "COMMITTED holds manifest_crc32c twice: a wrong value, then the right one",
        ["COMMITTED", "manifest_crc32c"],
    )


@invalid("committed_nan", "single_rank_basic")
def _committed_nan(root: Path) -> dict[str, Any]:
    text = (root / "COMMITTED").read_text()
    document = read_committed(root)
    text = text.replace(f'"created": {json.dumps(document["created"])}', '"created": NaN', 1)
    assert "NaN" in text
    (root / "COMMITTED").write_text(text)
    return expect(
        "FormatError",
        "open",
        "SPEC.md appendix C: NaN, Infinity and -Infinity are refused in COMMITTED",
        '"created": NaN in COMMITTED',
        ["COMMITTED"],
    )


@invalid("committed_must_understand_unknown", "single_rank_basic")
def _committed_must_understand(root: Path) -> dict[str, Any]:
    edit_committed(root, lambda d: d.update(must_understand=["encryption"]))
    return expect(
        "FormatError",
        "open",
        "SPEC.md §2: a reader MUST refuse a document whose must_understand lists an entry it does not understand",
        'COMMITTED lists must_understand ["encryption"]',
        ["COMMITTED", "encryption"],
    )


@invalid("committed_manifest_other_attempt", "single_rank_basic")
def _committed_other_attempt(root: Path) -> dict[str, Any]:
    edit_committed(root, lambda d: d.update(manifest="manifest-golden2.msgpack"))
    return expect(
        "FormatError",
        "open",
        "SPEC.md §3 path rules / appendix C: manifest MUST be manifest-<attempt>.msgpack of COMMITTED's own attempt",
        'COMMITTED (attempt golden1) names "manifest-golden2.msgpack"',
        ["COMMITTED", "manifest-golden2.msgpack"],
    )


@invalid("manifest_duplicate_map_key", "single_rank_basic")
def _manifest_duplicate_map_key(root: Path) -> dict[str, Any]:
    document = unpack((root / GLOBAL_FILE).read_bytes())
    pairs = list(document.items())
    # "tensors" twice: first an empty list, then the real one (a last-key-wins decoder sees a valid manifest).
    index = [key for key, _ in pairs].index("tensors")
    pairs.insert(index, ("tensors", []))
    set_global_bytes(root, pack_map_pairs(pairs))
    return expect(
        "FormatError",
        "open",
        "SPEC.md §1: keys of a msgpack map MUST NOT repeat",
        'the global manifest\'s top-level map holds "tensors" twice (an empty list, then the real one)',
        [GLOBAL_FILE, "tensors"],
    )


@invalid("manifest_invalid_utf8", "single_rank_basic")
def _manifest_invalid_utf8(root: Path) -> dict[str, Any]:
    raw = (root / GLOBAL_FILE).read_bytes()
    assert raw.count(b"weight") == 1
    set_global_bytes(root, raw.replace(b"weight", b"we\xffght", 1))
    return expect(
        "FormatError",
        "open",
        "SPEC.md §10: strings MUST be msgpack str of valid UTF-8",
        'the str "weight" (a tensor name) in the global manifest has byte 0xFF in place of "i"',
        [GLOBAL_FILE],
    )


@invalid("manifest_bool_as_int", "single_rank_basic")
def _manifest_bool_as_int(root: Path) -> dict[str, Any]:
    edit_global(root, lambda d: d.update(world_size=True))
    return expect(
        "FormatError",
        "open",
        "SPEC.md §10: integers MUST NOT be given as booleans",
        "world_size is msgpack true (== 1 in many languages) in the global manifest",
        [GLOBAL_FILE, "world_size"],
    )


@invalid("manifest_too_deep", "objects")
def _manifest_too_deep(root: Path) -> dict[str, Any]:
    def edit(document: dict[str, Any]) -> None:
        value: Any = 0
        for _ in range(70):
            value = [value]
        (entry,) = [o for o in document["objects"] if o["name"] == "epoch"]
        entry["value"] = value

    edit_global(root, edit)
    return expect(
        "FormatError",
        "open",
        "SPEC.md §7 / §10: nesting depth of a decoded document is at most 64",
        "the value of shared object epoch is 70 nested arrays (depth 73 in the document)",
        [GLOBAL_FILE],
    )


@invalid("manifest_object_bool_key", "objects")
def _manifest_object_bool_key(root: Path) -> dict[str, Any]:
    def edit(document: dict[str, Any]) -> None:
        (entry,) = [o for o in document["objects"] if o["name"] == "epoch"]
        entry["value"] = {True: 1}

    edit_global(root, edit)
    return expect(
        "FormatError",
        "open",
        "SPEC.md §7: map keys are str or int, not bool; a reader MUST refuse a map key of another type",
        "the value of shared object epoch is the map {true: 1}",
        [GLOBAL_FILE],
    )


@invalid("manifest_duplicate_object", "fsdp_uneven_4_ranks")
def _manifest_duplicate_object(root: Path) -> dict[str, Any]:
    def edit(document: dict[str, Any]) -> None:
        assert [o for o in document["objects"] if o["name"] == "rng" and o["rank"] == 2]
        document["objects"].append({"name": "rng", "rank": 2, "value": msgpack.ExtType(1, pack([2, 9999]))})

    edit_global(root, edit)
    return expect(
        "FormatError",
        "open",
        "SPEC.md §7: the pair (name, rank) MUST be unique within a manifest's objects",
        "a second object rng of rank 2 appended to the global manifest",
        [GLOBAL_FILE, "rng"],
    )


@invalid("manifest_unknown_layout", "fsdp_uneven_4_ranks")
def _manifest_unknown_layout(root: Path) -> dict[str, Any]:
    edit_global(root, lambda d: tensor_entry(d, "emb").update(layout="tiled"))
    return expect(
        "FormatError",
        "open",
        "SPEC.md §2 / §6: layout is a closed enumeration (box, flat); a reader MUST refuse any other value",
        'emb has layout "tiled"',
        [GLOBAL_FILE, "emb", "tiled"],
    )


@invalid("manifest_block_size_not_power_of_two", "fsdp_uneven_4_ranks")
def _manifest_block_size(root: Path) -> dict[str, Any]:
    edit_global(root, lambda d: d.update(block_size=6144))
    return expect(
        "FormatError",
        "open",
        "SPEC.md §8 / §10: block_size is a power of two in 4 KiB..64 MiB",
        "block_size 6144 in the global manifest",
        [GLOBAL_FILE, "6144"],
    )


@invalid("manifest_file_path_wrong_rank", "fsdp_uneven_4_ranks")
def _manifest_wrong_rank(root: Path) -> dict[str, Any]:
    edit_global(root, lambda d: d["files"][1].update(data=data_file(2)))
    return expect(
        "FormatError",
        "open",
        "SPEC.md §3 path rules: the rank and attempt in a path MUST equal the document's rank and attempt",
        f'files[1] (rank 1) names "{data_file(2)}", the data file of rank 2',
        [GLOBAL_FILE, data_file(2)],
    )


@invalid("manifest_column_wrong_encoding", "fsdp_uneven_4_ranks")
def _manifest_column_enc(root: Path) -> dict[str, Any]:
    def edit(document: dict[str, Any]) -> None:
        table = tensor_entry(document, "emb")["pieces"]
        table["file"] = {"enc": "u32le", "n": 3, "data": np.array([0, 1, 2], "<u4").tobytes()}

    edit_global(root, edit)
    return expect(
        "FormatError",
        "read",
        "SPEC.md §5: a decoder MUST refuse a column whose enc is not the encoding the field requires (delta-zlib)",
        "pieces.file of emb is a u32le column",
        ["emb", "pieces.file"],
    )


@invalid("manifest_column_trailing_garbage", "fsdp_uneven_4_ranks")
def _manifest_column_trailing(root: Path) -> dict[str, Any]:
    def edit(document: dict[str, Any]) -> None:
        column = tensor_entry(document, "emb")["pieces"]["length"]
        column["data"] += b"\x00garbage"

    edit_global(root, edit)
    return expect(
        "FormatError",
        "read",
        "SPEC.md §5: delta-zlib data is exactly one complete zlib stream, with no trailing bytes",
        "8 bytes appended after the (complete, correct) zlib stream of pieces.length of emb",
        ["emb", "pieces.length"],
    )


@invalid("manifest_piece_file_index_out_of_range", "fsdp_uneven_4_ranks")
def _manifest_file_index(root: Path) -> dict[str, Any]:
    def edit(pieces: list[dict[str, Any]]) -> None:
        pieces[0]["file"] = 4  # 4 files: 0..3

    edit_pieces(root, "tiny", edit)
    return expect(
        "FormatError",
        "read",
        "SPEC.md §6: a reader MUST refuse a piece table in which file[i] is not a valid file index",
        "piece 0 of tiny names file 4 of a 4-file manifest",
        ["tiny"],
    )


@invalid("manifest_scalar_two_pieces", "fsdp_uneven_4_ranks")
def _manifest_scalar_two_pieces(root: Path) -> dict[str, Any]:
    edit_pieces(root, "step", lambda pieces: pieces.append(dict(pieces[0])))
    return expect(
        "CoverageError",
        "read",
        "SPEC.md §6: a scalar in layout box has exactly one piece (exact cover)",
        "the I64 scalar step lists its one piece twice",
        ["step"],
    )


@invalid("manifest_piece_points_at_other_tensor", "fsdp_uneven_4_ranks")
def _manifest_points_at_other(root: Path) -> dict[str, Any]:
    step_offset = piece_offset(root, "step", 0)

    def edit(pieces: list[dict[str, Any]]) -> None:
        # layer.bias rows 0:2 on rank 0 are 8 bytes, like rank 0's I64 scalar step: point the piece there.
        assert pieces[0]["file"] == 0 and pieces[0]["length"] == [2]
        pieces[0]["offset"] = step_offset

    edit_pieces(root, "layer.bias", edit)
    return expect(
        "IntegrityError",
        "read",
        "SPEC.md §8 step 4: every piece a reader uses MUST be the same piece in its file's local manifest: offset, "
        "size, tensor name, dtype, shape, start and length",
        f"piece 0 of layer.bias (rank 0, 8 bytes) given offset {step_offset}, where rank 0 stores the 8-byte "
        "piece of the tensor step (offset and size match a local piece, the tensor does not)",
        ["layer.bias"],
        ["layer.bias"],
    )


@invalid("data_header_too_deep", "fsdp_uneven_4_ranks")
def _data_header_too_deep(root: Path) -> dict[str, Any]:
    # Found by tests/fuzz.py (target "header"): verify() died of a RecursionError in json.loads instead of
    # reporting the file. Rank 3 stores no piece, so its data file is all header and any header length is legal.
    depth = 100_000
    metadata = b'{"__metadata__":{"format":"shardckpt","version":"1.0","attempt":"golden1","rank":"3"},"x":'
    body = metadata + b"[" * depth + b"]" * depth + b"}"
    body += b" " * (-len(body) % 8)
    raw = len(body).to_bytes(8, "little") + body
    (root / data_file(3)).write_bytes(raw)

    def fix_local(document: dict[str, Any]) -> None:
        document.update(data_size=len(raw), header_size=len(raw), header_crc32c=crc32c.crc32c(raw))

    edit_local(root, 3, fix_local)
    edit_global(root, lambda d: d["files"][3].update(data_size=len(raw)))
    edit_committed(root, lambda d: d.update(total_bytes=sum(f.stat().st_size for f in (root / "data").iterdir())))
    return expect(
        "FormatError",
        "verify",
        "SPEC.md §4: a data file MUST be a valid safetensors file (header: a JSON object); readers need not parse "
        "it, a verifier MUST check it and report a malformed one instead of failing",
        f"the header of {data_file(3)} (rank 3 stores no piece) replaced by a valid JSON object nested 100,000 "
        "levels deep; data_size, header_size and header_crc32c in its local manifest, the global manifest and "
        "COMMITTED all updated to match, so only the header's content is wrong",
        [data_file(3)],
        [data_file(3), "nested too deeply"],
    )


@invalid("local_manifest_must_understand_unknown", "fsdp_uneven_4_ranks")
def _local_must_understand(root: Path) -> dict[str, Any]:
    edit_local(root, 1, lambda d: d.update(must_understand=["zstd-columns"]))
    return expect(
        "FormatError",
        "read",
        "SPEC.md §2: a reader MUST refuse a document whose must_understand lists an entry it does not understand",
        f'{local_file(1)} lists must_understand ["zstd-columns"]; global manifest and COMMITTED updated to match',
        [local_file(1), "zstd-columns"],
        [local_file(1)],
    )


@invalid("local_manifest_crc_column_short", "fsdp_uneven_4_ranks")
def _local_crc_short(root: Path) -> dict[str, Any]:
    def edit(document: dict[str, Any]) -> None:
        column = document["crc32c"]
        column["n"] -= 1
        column["data"] = column["data"][:-4]

    edit_local(root, 1, edit)
    return expect(
        "FormatError",
        "read",
        "SPEC.md §8: a reader MUST refuse a local manifest whose crc32c column has the wrong length",
        f"the last block checksum removed from {local_file(1)}; global manifest and COMMITTED updated to match",
        [local_file(1)],
        [local_file(1)],
    )


@invalid("local_manifest_world_size_mismatch", "fsdp_uneven_4_ranks")
def _local_world_size(root: Path) -> dict[str, Any]:
    edit_local(root, 1, lambda d: d.update(world_size=5))
    return expect(
        "FormatError",
        "read",
        "SPEC.md §8 step 3: a local manifest's attempt, rank, world_size, data, data_size and block_size MUST "
        "equal the global manifest's",
        f"{local_file(1)} says world_size 5 (global: 4); global manifest and COMMITTED updated to match its bytes",
        [local_file(1)],
        [local_file(1)],
    )


@invalid("local_manifest_data_area_gap", "fsdp_uneven_4_ranks")
def _local_gap(root: Path) -> dict[str, Any]:
    edit_local(root, 1, lambda d: d.update(header_size=d["header_size"] - 8))
    return expect(
        "FormatError",
        "read",
        "SPEC.md §8: the pieces of a local manifest sorted by offset MUST tile the data area exactly, the first "
        "starting at header_size",
        f"header_size of {local_file(1)} lowered by 8: 8 bytes between header and first piece belong to nothing",
        [local_file(1)],
        [local_file(1)],
    )


# ------------------------------------------------------------------------------------------------- main

VALID_CASES: dict[str, Callable[[], None]] = {
    "single_rank_basic": valid_single_rank_basic,
    "every_dtype": valid_every_dtype,
    "fsdp_uneven_4_ranks": valid_fsdp_uneven_4_ranks,
    "grid_2d_fsdp_tp": valid_grid_2d_fsdp_tp,
    "flat_zero_partitions": valid_flat_zero_partitions,
    "multi_block_pieces": valid_multi_block_pieces,
    "objects": valid_objects,
    "minor_version_unknown_fields": valid_minor_version_unknown_fields,
}


def main() -> None:
    torch.use_deterministic_algorithms(True)
    VALID.mkdir(exist_ok=True)
    INVALID.mkdir(exist_ok=True)
    for name, build_valid in VALID_CASES.items():
        build_valid()
        print(f"valid/{name}")
    for name, build_invalid in INVALID_CASES.items():
        root = INVALID / name
        if root.exists():
            shutil.rmtree(root)
        expected = build_invalid(root)
        write_json(root / "expected_error.json", expected)
        print(f"invalid/{name}: {expected['operation']} -> {expected['error']}")


if __name__ == "__main__":
    main()
