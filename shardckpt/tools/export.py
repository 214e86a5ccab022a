"""Exporting model weights as Hugging Face sharded safetensors, streamed tensor by tensor under a memory bound.

Writes `model-0000k-of-0000n.safetensors` files and `model.safetensors.index.json`, the layout HF tools read.

Each output file's header is computed from the manifest alone (names, shapes, dtypes), written first, and then
every tensor's bytes follow in row-major chunks read (and dtype-converted) one at a time, so no tensor is ever
whole in memory. The index is written last: an export without its index is incomplete.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from shardckpt import knobs
from shardckpt.errors import AlreadyExistsError, FormatError, ShardckptUsageError
from shardckpt.format import layout
from shardckpt.format.dtypes import itemsize
from shardckpt.read.checkpoint import Checkpoint
from shardckpt.read.streaming import arena_view, chunk_arena, chunk_elements, open_streaming, read_chunks
from shardckpt.storage import Storage, open_storage
from shardckpt.tools.hf_names import DEFAULT_INCLUDE, DTYPES, INDEX_FILE, is_torchtitan_llama, torchtitan_llama_name
from shardckpt.torch_bytes import host_bytes, torch_dtype

DEFAULT_MAX_SHARD_SIZE = knobs.EXPORT_SHARD_SIZE
DEFAULT_MEMORY_LIMIT = knobs.MEMORY_LIMIT
FLOATING = frozenset({"F16", "BF16", "F32", "F64"})  # converted by --dtype; integer and bool tensors keep theirs


@dataclass(frozen=True)
class ExportedTensor:
    source: str  # name in the checkpoint
    name: str  # name in the export
    dtype: str  # format dtype written
    shape: tuple[int, ...]
    heads: int = 0  # > 0: rows permuted per head of this many, as torchtitan's llama -> HF (hf_names)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


@dataclass(frozen=True)
class ExportShard:
    file: str
    tensors: tuple[ExportedTensor, ...]  # in the order their bytes are written

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass
class ExportReport:
    url: str
    out: str
    shards: list[ExportShard] = field(default_factory=list)  # the files written, in order
    seconds: float = 0.0

    @property
    def tensors(self) -> int:
        return sum(len(shard.tensors) for shard in self.shards)

    @property
    def total_size(self) -> int:
        return sum(shard.nbytes for shard in self.shards)


def select_tensors(
    checkpoint: Checkpoint,
    *,
    dtype: str | None = None,
    include: str | None = None,
    exclude: str | None = None,
    strip_prefix: str = "",
) -> list[ExportedTensor]:
    """The tensors to export, in manifest order: names matching `include` (default: under `model.`), not `exclude`.

    `dtype` (bf16, fp16, fp32) converts floating-point tensors; `strip_prefix` is cut from names that start with it.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ShardckptUsageError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    wanted = re.compile(include if include is not None else DEFAULT_INCLUDE)
    unwanted = re.compile(exclude) if exclude else None
    chosen: list[ExportedTensor] = []
    names: dict[str, str] = {}
    for entry in checkpoint.manifest.tensors:
        if not wanted.search(entry.name) or (unwanted is not None and unwanted.search(entry.name)):
            continue
        name = entry.name[len(strip_prefix) :] if strip_prefix and entry.name.startswith(strip_prefix) else entry.name
        if not name or name == "__metadata__":
            raise ShardckptUsageError(f"tensor {entry.name!r} would be exported as {name!r}, which safetensors forbids")
        if name in names:
            raise ShardckptUsageError(f"tensors {names[name]!r} and {entry.name!r} would both be exported as {name!r}")
        names[name] = entry.name
        written = DTYPES[dtype] if dtype is not None and entry.dtype in FLOATING else entry.dtype
        chosen.append(ExportedTensor(entry.name, name, written, entry.shape))
    if not chosen:
        raise ShardckptUsageError(
            f"no tensor of {checkpoint.url} matches include {wanted.pattern!r}"
            + (f" and exclude {unwanted.pattern!r}" if unwanted else "")
            + "; pass --include REGEX to choose others"
        )
    return chosen


def select_torchtitan_llama(
    checkpoint: Checkpoint, *, dtype: str | None = None, heads: int | None = None, kv_heads: int | None = None
) -> list[ExportedTensor]:
    """The model tensors of a torchtitan llama checkpoint under their Hugging Face names (hf_names.TORCHTITAN_LLAMA),
    wq and wk with their rows permuted per head as torchtitan's state dict adapter does; `heads` is the model's
    n_heads (its checkpoint does not record it), `kv_heads` its n_kv_heads (default: from wk's shape)."""
    if dtype is not None and dtype not in DTYPES:
        raise ShardckptUsageError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    entries = {entry.name: entry for entry in checkpoint.manifest.tensors}
    if not heads or heads < 1:
        raise ShardckptUsageError(
            f"{checkpoint.url} holds a torchtitan llama model: its attention weights are permuted per head on the "
            "way to Hugging Face, so the export needs the model's number of heads: pass heads= (--heads N, the "
            "n_heads of its torchtitan model args, num_attention_heads in HF's config.json)"
        )
    # torchtitan before 0.3 named them attention.wq; 0.3's llama3 attention.qkv_linear.wq
    attention = "layers.0.attention." if "layers.0.attention.wq.weight" in entries else "layers.0.attention.qkv_linear."
    wq = entries[attention + "wq.weight"]
    dim = wq.shape[1] if len(wq.shape) == 2 else 0
    if len(wq.shape) != 2 or wq.shape[0] % heads or (wq.shape[0] // heads) % 2:
        raise ShardckptUsageError(
            f"{checkpoint.url}: {attention}wq.weight of shape {list(wq.shape)} does not split into {heads} "
            "heads of an even size: check --heads"
        )
    head_dim = wq.shape[0] // heads
    wk = entries.get(attention + "wk.weight")
    found_kv = wk.shape[0] // head_dim if wk is not None and len(wk.shape) == 2 and wk.shape[0] % head_dim == 0 else 0
    if kv_heads is None:
        kv_heads = found_kv
    if not kv_heads or kv_heads != found_kv:
        raise ShardckptUsageError(
            f"{checkpoint.url}: {attention}wk.weight of shape {list(wk.shape) if wk else None} does not hold "
            f"{kv_heads} heads of {head_dim} rows ({heads} heads over {dim} columns): check --heads / --kv-heads"
        )
    chosen = []
    for entry in checkpoint.manifest.tensors:
        mapped = torchtitan_llama_name(entry.name)
        if mapped is None:
            continue
        name, permuted = mapped
        groups = {"q": heads, "k": kv_heads}.get(permuted or "", 0)
        if groups and (len(entry.shape) != 2 or entry.shape[0] != groups * head_dim):
            raise ShardckptUsageError(
                f"{checkpoint.url}: {entry.name} of shape {list(entry.shape)} is not {groups} heads of {head_dim} rows"
            )
        written = DTYPES[dtype] if dtype is not None and entry.dtype in FLOATING else entry.dtype
        chosen.append(ExportedTensor(entry.name, name, written, entry.shape, groups))
    return chosen


def plan_shards(tensors: list[ExportedTensor], max_shard_size: int) -> list[ExportShard]:
    """Fill files in order up to max_shard_size bytes (a larger tensor gets a file of its own), as transformers does.

    Within a file, tensors with larger elements come first, so every tensor starts aligned to its element size.
    """
    if max_shard_size < 1:
        raise ShardckptUsageError(f"max shard size must be positive, got {max_shard_size}")
    groups: list[list[ExportedTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if groups[-1] and size + tensor.nbytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(tensor)
        size += tensor.nbytes
    count = len(groups)
    return [
        ExportShard(
            f"model-{number:05d}-of-{count:05d}.safetensors",
            tuple(sorted(group, key=lambda t: -itemsize(t.dtype))),
        )
        for number, group in enumerate(groups, start=1)
    ]


def shard_header(shard: ExportShard) -> bytes:
    """The safetensors header of an output file: u64 length, then JSON padded with spaces to a multiple of 8."""
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}  # transformers refuses files without it
    position = 0
    for tensor in shard.tensors:
        entries[tensor.name] = {
            "dtype": tensor.dtype,
            "shape": list(tensor.shape),
            "data_offsets": [position, position + tensor.nbytes],
        }
        position += tensor.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def index_document(shards: list[ExportShard]) -> bytes:
    weight_map = {tensor.name: shard.file for shard in shards for tensor in shard.tensors}
    index = {"metadata": {"total_size": sum(s.nbytes for s in shards)}, "weight_map": weight_map}
    return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()


def export_hf_safetensors(
    url: str | Storage,
    out: str | Storage,
    *,
    dtype: str | None = None,
    include: str | None = None,
    exclude: str | None = None,
    strip_prefix: str = "",
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    memory_limit: int = DEFAULT_MEMORY_LIMIT,
    storage_options: dict[str, Any] | None = None,
    out_options: dict[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
    force: bool = False,
    heads: int | None = None,
    kv_heads: int | None = None,
) -> ExportReport:
    """Export the selected tensors of the checkpoint at `url` into the directory `out` (which must hold no export).

    A checkpoint torchtitan saved for a llama model (hf_names.is_torchtitan_llama), exported without include or
    strip_prefix, is exported as Hugging Face's LlamaForCausalLM names it (select_torchtitan_llama: needs `heads`).

    force=True first deletes a previous export in `out`: its index and the files that index names, nothing else
    (a file it does not name, or a checkpoint in `out`, is refused before anything is deleted).

    Tensor data in memory stays under `memory_limit` bytes (manifests and the interpreter come on top).
    `progress(nbytes, total)` is called as output bytes are written.
    """
    began = time.perf_counter()
    checkpoint = open_streaming(url, memory_limit, storage_options=storage_options)
    names = [entry.name for entry in checkpoint.manifest.tensors]
    if include is None and exclude is None and not strip_prefix and is_torchtitan_llama(names):
        selected = select_torchtitan_llama(checkpoint, dtype=dtype, heads=heads, kv_heads=kv_heads)
    else:
        selected = select_tensors(checkpoint, dtype=dtype, include=include, exclude=exclude, strip_prefix=strip_prefix)
    shards = plan_shards(selected, max_shard_size)
    target = open_storage(out, out_options)
    existing = [name for name in target.list() if name.endswith(".safetensors") or name == INDEX_FILE]
    if force:
        _delete_previous_export(target, existing)
    elif existing:
        raise AlreadyExistsError(
            f"{target.url} already holds an export ({existing[0]}); export into a new directory, or pass "
            "force=True (--force) to replace that export"
        )
    total = sum(shard.nbytes for shard in shards)
    report = ExportReport(checkpoint.url, target.url)
    arena = chunk_arena(memory_limit)
    for shard in shards:
        with target.open_new(shard.file) as handle:
            handle.write(shard_header(shard))
            for tensor in shard.tensors:
                _write_tensor(checkpoint, tensor, handle, arena, total, progress)
        report.shards.append(shard)
    target.write_new(INDEX_FILE, index_document(shards))
    report.seconds = time.perf_counter() - began
    return report


MAX_INDEX_BYTES = 256 << 20  # a previous index is read whole to learn what --force may delete


def _delete_previous_export(target: Storage, existing: list[str]) -> None:
    """Delete the previous export in `target`: INDEX_FILE first (so a crash never leaves an index naming missing
    files), then the shards it names. Refuse, deleting nothing, when `target` holds a checkpoint or a file the
    index does not name."""
    names = set(target.list())
    if names & {layout.COMMITTED, layout.DATA_DIR, layout.RANKS_DIR}:
        raise AlreadyExistsError(f"{target.url} holds a shardckpt checkpoint: --force never replaces one")
    if not existing:
        return
    where = target.describe(INDEX_FILE)
    if INDEX_FILE not in names:
        raise AlreadyExistsError(
            f"{target.url} holds {existing[0]} but no {INDEX_FILE}: --force replaces only "
            "files a previous export's index names; remove them yourself"
        )
    try:
        index = json.loads(target.read_small(INDEX_FILE, MAX_INDEX_BYTES))
        files = set(index["weight_map"].values())
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise FormatError(f"{where} is not an export index ({exc}): --force replaces nothing") from None
    bad = sorted(str(f) for f in files if not isinstance(f, str) or "/" in f or "\\" in f or f in ("", ".", ".."))
    if bad:
        raise FormatError(f"{where} names {bad[0]!r}, not a file of this directory: --force replaces nothing")
    unnamed = sorted(name for name in existing if name != INDEX_FILE and name not in files)
    if unnamed:
        raise AlreadyExistsError(
            f"{target.url} holds {unnamed[0]}, which {INDEX_FILE} does not name: --force "
            "replaces only a previous export's files; remove it yourself"
        )
    target.delete(INDEX_FILE)
    for name in sorted(files & names):
        target.delete(name)


def _write_tensor(
    checkpoint: Checkpoint,
    tensor: ExportedTensor,
    handle: Any,
    arena: torch.Tensor,
    total: int,
    progress: Callable[[int, int], None] | None,
) -> None:
    if tensor.heads:
        _write_permuted(checkpoint, tensor, handle, total, progress)
        return
    stored = checkpoint.entry(tensor.source).dtype
    converts = stored != tensor.dtype
    per_element = itemsize(stored) + (itemsize(tensor.dtype) if converts else 0)
    elements = chunk_elements(checkpoint, arena, per_element)
    converted = None
    if converts:  # the converted chunk lives in the arena too, after the chunk read from the checkpoint
        converted, _ = arena_view(arena, elements * itemsize(stored), elements, torch_dtype(tensor.dtype))
    for chunk in read_chunks(checkpoint, tensor.source, elements, arena):
        data = chunk if converted is None else converted[: chunk.numel()].copy_(chunk)
        handle.write(memoryview(host_bytes(data)))  # type: ignore[arg-type]  # numpy arrays are buffers
        if progress is not None:
            progress(data.numel() * data.element_size(), total)


def _write_permuted(
    checkpoint: Checkpoint, tensor: ExportedTensor, handle: Any, total: int, progress: Callable[[int, int], None] | None
) -> None:
    """A wq/wk weight head by head, each head's rows reordered as torchtitan's _permute does for HF: row 2a + b of
    a head (pair a, element b of Meta's interleaved RoPE) becomes row b * head_dim / 2 + a (HF's rotate_half)."""
    rows, columns = tensor.shape
    head_dim = rows // tensor.heads
    for head in range(tensor.heads):
        block = checkpoint.read(tensor.source, offsets=(head * head_dim, 0), shape=(head_dim, columns))
        block = block.view(head_dim // 2, 2, columns).transpose(0, 1).reshape(head_dim, columns)
        data = block.to(torch_dtype(tensor.dtype)).contiguous()
        handle.write(memoryview(host_bytes(data)))  # type: ignore[arg-type]  # numpy arrays are buffers
        if progress is not None:
            progress(data.numel() * data.element_size(), total)
