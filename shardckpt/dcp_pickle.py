"""Restricted unpicklers for the pickles inside PyTorch DCP checkpoints: `.metadata` and `.distcp` record headers.

The only module of shardckpt that imports pickle; it exists to read another tool's files, never to write any.

Why here and nowhere else: shardckpt's own format is pickle-free (SPEC.md), because unpickling runs whatever
callables a file names. DCP stores its metadata as a pickle and wraps every record in a torch.save zip whose
`data.pkl` is a pickle, so an importer cannot avoid reading pickle opcodes. Each unpickler below admits an
explicit table of (module, name) pairs and refuses every other global with a FormatError *before* anything is
called, so a hostile file cannot reach os.system, eval, getattr or an import:

- `.metadata`: DCP's own metadata classes (plain dataclasses), torch.Size, torch dtypes, layouts and memory
  formats, collections.OrderedDict, set/frozenset. Functions DCP's pickles call (the layout lookup, pathlib
  paths) are replaced by local stand-ins that only map strings to values. The result is then checked field by
  field and converted into this module's frozen dataclasses; nothing else of it is kept.
- a tensor record's `data.pkl`: torch's rebuild functions and storage classes are replaced by stand-ins that
  only *describe* the tensor (storage key, dtype, offset, size, stride); the bytes are read from the zip by the
  importer, never by torch.load.
- a bytes record's `data.pkl`: no global at all, so only plain values (numbers, strings, lists, dicts,
  tuples) load; anything else is refused and the importer skips it with a message.

The generic parts (RestrictedUnpickler, unpickle, the tensor stand-ins rebuild_v2/rebuild_v3/storage_ref) are
public: deepspeed_pickle builds its own admitted table from them, so pickle is still imported only here.
"""

from __future__ import annotations

import collections
import io
import pickle
import pickletools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

from shardckpt.errors import FormatError

MAX_RECORD_PICKLE_BYTES = 16 << 20  # data.pkl of one record: a tensor description or one plain value
DCP_LABEL = "a DCP checkpoint"  # completes "refuses the pickled global X (not a name ... uses)"
_RECORD_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}")  # a file directly in the DCP directory


# --------------------------------------------------------------------------------------------- results


@dataclass(frozen=True)
class DcpRecord:
    """Bytes [offset, offset + length) of file `path` (relative to the DCP directory): one torch.save zip."""

    path: str
    offset: int
    length: int


@dataclass(frozen=True)
class DcpChunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    record: DcpRecord


@dataclass(frozen=True)
class DcpTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[DcpChunk, ...]


@dataclass(frozen=True)
class DcpValue:
    """A non-tensor entry (BytesStorageMetadata) and its path in the original nested state dict."""

    name: str
    path: tuple[str | int, ...]
    record: DcpRecord


@dataclass(frozen=True)
class DcpMetadata:
    tensors: tuple[DcpTensor, ...]
    values: tuple[DcpValue, ...]
    tensor_paths: dict[str, tuple[str | int, ...]]
    version: str | None


@dataclass(frozen=True)
class StoredTensor:
    """What a tensor record's data.pkl says: storage `key` of `storage_bytes` bytes, viewed as `dtype`."""

    key: str
    storage_bytes: int
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


# ------------------------------------------------------------------------------------ the unpickler


class RestrictedUnpickler(pickle.Unpickler):
    """Resolves a global only through `admitted`; `label` names the kind of file in the refusal message."""

    def __init__(
        self,
        data: bytes,
        where: str,
        admitted: Mapping[tuple[str, str], Any],
        persistent: Callable[[Any], Any] | None = None,
        label: str = DCP_LABEL,
    ) -> None:
        super().__init__(io.BytesIO(data))
        self._where, self._admitted, self._persistent, self._label = where, admitted, persistent, label

    def find_class(self, module: str, name: str) -> Any:
        # Exact pairs only: a dotted name ("Metadata.__init__") or another module never resolves.
        try:
            return self._admitted[(module, name)]
        except (KeyError, TypeError):
            raise FormatError(
                f"{self._where}: refuses the pickled global {module}.{name} (not a name {self._label} uses; "
                "nothing was run)"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise FormatError(f"{self._where}: unexpected persistent reference in a pickle")
        return self._persistent(pid)


def unpickle(
    data: bytes,
    where: str,
    admitted: Mapping[tuple[str, str], Any],
    persistent: Callable[[Any], Any] | None = None,
    label: str = DCP_LABEL,
) -> Any:
    """Load `data` admitting only the globals in `admitted`; every failure is a FormatError naming `where`."""
    check_memo_indices(data, where)  # before the C unpickler can be made to allocate for a far memo index
    try:
        return RestrictedUnpickler(data, where, admitted, persistent, label).load()
    except FormatError:
        raise
    except Exception as exc:  # a malformed pickle fails in many ways; all of them mean "not a file of this kind"
        raise FormatError(f"{where}: not a readable pickle ({type(exc).__name__}: {exc})") from None


_MEMO_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})


def check_memo_indices(data: bytes, where: str) -> None:
    """Scan the opcodes (nothing is run) and refuse a memo index beyond those assigned so far.

    The C unpickler grows its memo array to twice any index a PUT names, so a 10-byte pickle naming index 2^32
    would allocate tens of GB; picklers number memo entries 0, 1, 2, ... in order, so no real file does that.
    Pure Python and so slower than the unpickler itself: meant for pickles of metadata size, not for bulk data.
    """
    assigned = 0
    try:
        for opcode, argument, _ in pickletools.genops(data):
            if opcode.name in _MEMO_PUTS:
                if not isinstance(argument, int) or not 0 <= argument <= assigned:
                    raise FormatError(f"{where}: memo index {argument!r:.40} out of order (at most {assigned})")
                assigned += 1
            elif opcode.name == "MEMOIZE":
                assigned += 1
    except FormatError:
        raise
    except Exception as exc:  # genops reads every argument: a length past the end, an unknown opcode
        raise FormatError(f"{where}: not a readable pickle ({type(exc).__name__}: {exc})") from None


def torch_values(kinds: tuple[type, ...]) -> dict[tuple[str, str], Any]:
    # vars() rather than getattr: torch's module __getattr__ would import submodules for unknown names.
    return {("torch", name): value for name, value in vars(torch).items() if isinstance(value, kinds)}


def _layout_named(name: object) -> torch.layout:
    """Stand-in for torch.serialization._get_layout: a lookup, nothing else."""
    layouts = {str(value): value for value in vars(torch).values() if isinstance(value, torch.layout)}
    if not isinstance(name, str) or name not in layouts:
        raise FormatError(f"unknown torch layout {name!r}")
    return layouts[name]


def _path_text(*parts: object) -> str:
    """Stand-in for pathlib paths (StorageMeta.checkpoint_id): the path as text."""
    if not all(isinstance(part, str) for part in parts):
        raise FormatError(f"a pickled path has non-text parts {parts!r}")
    return "/".join(str(part) for part in parts)


_METADATA_CLASSES = (
    "Metadata",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "MetadataIndex",
    "StorageMeta",
    "_MEM_FORMAT_ENCODING",
)
_PATH_CLASSES = ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path")

METADATA_ADMITTED: dict[tuple[str, str], Any] = {
    **{("torch.distributed.checkpoint.metadata", n): getattr(dcp_metadata, n) for n in _METADATA_CLASSES},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_filesystem._StorageInfo,
    ("torch", "Size"): torch.Size,
    **torch_values((torch.dtype, torch.layout, torch.memory_format)),
    ("torch.serialization", "_get_layout"): _layout_named,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    **{(module, n): _path_text for module in ("pathlib", "pathlib._local") for n in _PATH_CLASSES},
}


# ------------------------------------------------------------------------------------------ .metadata


def read_dcp_metadata(data: bytes, where: str) -> DcpMetadata:
    """Decode a DCP `.metadata` pickle with the restricted unpickler, then check and convert every field."""
    raw = unpickle(data, where, METADATA_ADMITTED)
    if not isinstance(raw, dcp_metadata.Metadata):
        raise FormatError(f"{where}: holds a {type(raw).__name__}, not DCP Metadata")
    entries = getattr(raw, "state_dict_metadata", None)
    storage = getattr(raw, "storage_data", None)
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise FormatError(f"{where}: state_dict_metadata and storage_data must be dicts")
    records: dict[tuple[str, tuple[int, ...] | None], DcpRecord] = {}
    for key, info in storage.items():
        if not isinstance(key, dcp_metadata.MetadataIndex) or not isinstance(info, dcp_filesystem._StorageInfo):
            raise FormatError(f"{where}: storage_data maps {type(key).__name__} to {type(info).__name__}")
        fqn = _text(getattr(key, "fqn", None), f"{where}: storage key")
        offset = getattr(key, "offset", None)
        records[(fqn, None if offset is None else ints(offset, f"{where}: {fqn!r} offset"))] = _record(
            info, f"{where}: {fqn!r}"
        )
    planner = getattr(raw, "planner_data", None)
    paths = planner if isinstance(planner, dict) else {}
    tensors, values, tensor_paths = [], [], {}
    for name, entry in entries.items():
        name = _text(name, f"{where}: state dict key")
        path = _path(paths.get(name), name)
        if isinstance(entry, dcp_metadata.BytesStorageMetadata):
            record = records.get((name, None))
            if record is None:
                raise FormatError(f"{where}: no storage record for value {name!r}")
            values.append(DcpValue(name, path, record))
        elif isinstance(entry, dcp_metadata.TensorStorageMetadata):
            tensors.append(_tensor(name, entry, records, where))
            tensor_paths[name] = path
        else:
            raise FormatError(f"{where}: entry {name!r} is a {type(entry).__name__}")
    version = getattr(raw, "version", None)
    return DcpMetadata(tuple(tensors), tuple(values), tensor_paths, version if isinstance(version, str) else None)


def _tensor(
    name: str,
    entry: dcp_metadata.TensorStorageMetadata,
    records: dict[tuple[str, tuple[int, ...] | None], DcpRecord],
    where: str,
) -> DcpTensor:
    where = f"{where}: tensor {name!r}"
    dtype = getattr(getattr(entry, "properties", None), "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise FormatError(f"{where}: dtype is {dtype!r}")
    shape = ints(getattr(entry, "size", None), f"{where} size")
    chunks = getattr(entry, "chunks", None)
    if not isinstance(chunks, list):
        raise FormatError(f"{where}: chunks must be a list")
    result = []
    for chunk in chunks:
        if not isinstance(chunk, dcp_metadata.ChunkStorageMetadata):
            raise FormatError(f"{where}: a chunk is a {type(chunk).__name__}")
        offsets = ints(getattr(chunk, "offsets", None), f"{where} chunk offsets")
        sizes = ints(getattr(chunk, "sizes", None), f"{where} chunk sizes")
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise FormatError(f"{where}: chunk at {list(offsets)} of shape {list(sizes)} for shape {list(shape)}")
        if any(o + s > d for o, s, d in zip(offsets, sizes, shape)):
            raise FormatError(f"{where}: chunk at {list(offsets)} of shape {list(sizes)} exceeds {list(shape)}")
        record = records.get((name, offsets))
        if record is None:
            raise FormatError(f"{where}: no storage record for the chunk at {list(offsets)}")
        result.append(DcpChunk(offsets, sizes, record))
    return DcpTensor(name, dtype, shape, tuple(result))


def _record(info: dcp_filesystem._StorageInfo, where: str) -> DcpRecord:
    path = _text(getattr(info, "relative_path", None), f"{where} relative_path")
    if not _RECORD_NAME.fullmatch(path) or ".." in path:
        raise FormatError(f"{where}: record file {path!r} is not a plain file name in the DCP directory")
    offset, length = getattr(info, "offset", None), getattr(info, "length", None)
    if not isinstance(offset, int) or not isinstance(length, int) or not _in_range(offset) or not _in_range(length):
        raise FormatError(f"{where}: record offset/length {offset!r}/{length!r} out of range")
    if getattr(info, "transform_descriptors", None):
        raise FormatError(
            f"{where}: the record uses storage transforms {info.transform_descriptors!r} (e.g. compression), "
            "which this importer does not read"
        )
    return DcpRecord(path, offset, length)


def _in_range(value: int) -> bool:
    return not isinstance(value, bool) and 0 <= value < 1 << 62


def _text(value: object, where: str) -> str:
    if not isinstance(value, str) or not value or "\x00" in value:
        raise FormatError(f"{where}: expected a non-empty name, got {value!r}")
    return value


def ints(value: object, where: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or len(value) > 64:
        raise FormatError(f"{where}: expected a sequence of at most 64 integers, got {value!r}")
    if any(isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 62 for v in value):
        raise FormatError(f"{where}: expected non-negative integers, got {value!r}")
    return tuple(int(v) for v in value)


def _path(value: object, name: str) -> tuple[str | int, ...]:
    """The key path DCP's planner recorded for `name`; the dotted name itself when none is usable."""
    if isinstance(value, tuple) and value and all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in value):
        return tuple(value)
    return (name,)


# ---------------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class StorageClass:
    dtype: torch.dtype


@dataclass(frozen=True)
class StorageRef:
    key: str
    dtype: torch.dtype
    numel: int


_LEGACY_STORAGES = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "BFloat16Storage": torch.bfloat16,
    "ComplexDoubleStorage": torch.complex128,
    "ComplexFloatStorage": torch.complex64,
}


def storage_ref(pid: Any) -> StorageRef:
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], StorageClass)):
        raise FormatError(f"unexpected persistent reference {pid!r:.200}")
    _, kind, key, _location, numel = pid
    if not isinstance(key, str) or isinstance(numel, bool) or not isinstance(numel, int) or not 0 <= numel < 1 << 62:
        raise FormatError(f"bad storage reference {pid!r:.200}")
    return StorageRef(key, kind.dtype, numel)


def _stored(storage: object, offset: object, size: object, stride: object, dtype: torch.dtype) -> StoredTensor:
    if not isinstance(storage, StorageRef) or isinstance(offset, bool) or not isinstance(offset, int):
        raise FormatError(f"a tensor rebuild got storage {storage!r:.100} at offset {offset!r:.100}")
    shape, strides = ints(size, "tensor size"), ints(stride, "tensor stride")
    if len(strides) != len(shape) or offset < 0:
        raise FormatError(f"tensor size {list(shape)}, stride {list(strides)}, offset {offset} do not match")
    return StoredTensor(storage.key, storage.numel * storage.dtype.itemsize, dtype, offset, shape, strides)


def _check_extra(requires_grad: object, hooks: object, metadata: object) -> None:
    if not isinstance(requires_grad, bool) or hooks or metadata:
        raise FormatError(f"tensor with hooks {hooks!r:.100} or metadata {metadata!r:.100} is not a plain tensor")


def rebuild_v2(
    storage: object, offset: object, size: object, stride: object, grad: object, hooks: object, meta: object = None
) -> StoredTensor:
    """Stand-in for torch._utils._rebuild_tensor_v2: the storage's own dtype."""
    _check_extra(grad, hooks, meta)
    dtype = storage.dtype if isinstance(storage, StorageRef) else torch.uint8
    return _stored(storage, offset, size, stride, dtype)


def rebuild_v3(
    storage: object,
    offset: object,
    size: object,
    stride: object,
    grad: object,
    hooks: object,
    dtype: object,
    meta: object = None,
) -> StoredTensor:
    """Stand-in for torch._utils._rebuild_tensor_v3 (dtypes without a legacy storage class: bytes + dtype)."""
    _check_extra(grad, hooks, meta)
    if not isinstance(dtype, torch.dtype):
        raise FormatError(f"tensor dtype {dtype!r:.100} is not a torch dtype")
    return _stored(storage, offset, size, stride, dtype)


TENSOR_RECORD_ADMITTED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v3"): rebuild_v3,
    **{("torch", name): StorageClass(dtype) for name, dtype in _LEGACY_STORAGES.items()},
    ("torch", "UntypedStorage"): StorageClass(torch.uint8),
    ("torch.storage", "UntypedStorage"): StorageClass(torch.uint8),
    **torch_values((torch.dtype,)),
    ("collections", "OrderedDict"): collections.OrderedDict,
}


def read_tensor_pickle(data: bytes, where: str) -> StoredTensor:
    """Describe the tensor a torch.save zip holds, from its data.pkl, without building it."""
    _check_size(data, where)
    result = unpickle(data, where, TENSOR_RECORD_ADMITTED, storage_ref)
    if not isinstance(result, StoredTensor):
        raise FormatError(f"{where}: holds a {type(result).__name__}, not one tensor")
    return result


def read_value_pickle(data: bytes, where: str) -> Any:
    """A plain value (numbers, strings, lists, dicts, tuples) from a bytes record's data.pkl; no global admitted."""
    _check_size(data, where)
    return unpickle(data, where, {("collections", "OrderedDict"): dict})


def _check_size(data: bytes, where: str) -> None:
    if len(data) > MAX_RECORD_PICKLE_BYTES:
        raise FormatError(f"{where}: data.pkl of {len(data)} bytes exceeds {MAX_RECORD_PICKLE_BYTES}")
