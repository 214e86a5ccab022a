"""Restricted unpicklers for the pickles inside PyTorch DCP checkpoints: `.metadata` and `.distcp` record headers.

The only module of shardckpt that imports pickle; it exists to read another tool's files, never to write any.

Why here and nowhere else: shardckpt's own format is pickle-free (SPEC.md), because unpickling runs whatever
callables a file names. DCP stores its metadata as a pickle and wraps every record in a torch.save zip whose
`data.pkl` is a pickle, so an importer cannot avoid reading pickle opcodes. Each unpickler below admits an
explicit table of (module, name) pairs and refuses every other global with a FormatError *before* anything is
called, so a hostile file cannot reach os.system, eval, getattr or an import:

- `.metadata`: stand-ins for DCP's metadata classes (Pickled subclasses that keep the state a pickle gives them),
  torch dtypes, layouts and memory formats, collections.OrderedDict, set/frozenset. Functions DCP's pickles call
  (torch.Size, the layout lookup, the memory format enum, pathlib paths) are StandIns that only map values. The
  result is then checked field by field and converted into this module's frozen dataclasses.
- a tensor record's `data.pkl`: torch's rebuild functions and storage classes are replaced by stand-ins that
  only *describe* the tensor (storage key, dtype, offset, size, stride); the bytes are read from the zip by the
  importer, never by torch.load.
- a bytes record's `data.pkl`: plain values (numbers, strings, bytes, lists, dicts, tuples) load, checked as a
  tree (unpickled.check_tree); the only globals are the ones protocol 2 writes for them (bytes as
  `_codecs.encode`, OrderedDict) as stand-ins that rebuild bytes or a dict, and the other types torch.save
  writes for plain Python values (set, complex, slice, deque, ...) as stand-ins that refuse them by name.
Nothing admitted is shared mutable state: torch's own classes are never handed to a pickle, and a BUILD on any
admitted object is refused (unpickled.py says why). Before any unpickler runs, pickle_scan checks the opcodes.

The generic parts (RestrictedUnpickler, unpickle, the tensor stand-ins REBUILD_V2/REBUILD_V3/SIZE/storage_ref) are
public: deepspeed_pickle builds its own admitted table from them, so pickle is still imported only here.
"""

from __future__ import annotations

import collections
import io
import pickle
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from shardckpt.errors import FormatError
from shardckpt.format.limits import MAX_DEPTH
from shardckpt.interop.pickle_scan import check_pickle
from shardckpt.interop.unpickled import (
    IdentityFrozenset,
    IdentityTuple,
    Pickled,
    Sealed,
    StandIn,
    brief,
    check_tree,
    refuse_state,
    spread_keys,
)

MAX_RECORD_PICKLE_BYTES = 16 << 20  # data.pkl of one record: a tensor description or one plain value
DCP_LABEL = "a DCP checkpoint"  # completes "refuses the pickled global X (not a name ... uses)"
MAX_KEY_PATH = MAX_DEPTH  # keys in a value's path: a deeper value could not be stored as an object anyway
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


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """What a tensor record's data.pkl says: storage `key` of `storage_bytes` bytes, viewed as `dtype`."""

    key: str
    storage_bytes: int
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    __setstate__ = refuse_state  # dataclass(slots=True) would add one that writes the fields


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


def check_memo_indices(data: bytes, where: str) -> None:
    """Refuse a pickle the C unpickler could be made to allocate for (see pickle_scan); nothing is run."""
    check_pickle(data, where)


def torch_values(kinds: tuple[type, ...]) -> dict[tuple[str, str], Any]:
    # vars() rather than getattr: torch's module __getattr__ would import submodules for unknown names.
    return {("torch", name): value for name, value in vars(torch).items() if isinstance(value, kinds)}


def _layout_named(name: object) -> torch.layout:
    """Stand-in for torch.serialization._get_layout: a lookup, nothing else."""
    layouts = {str(value): value for value in vars(torch).values() if isinstance(value, torch.layout)}
    if not isinstance(name, str) or name not in layouts:
        raise FormatError(f"unknown torch layout {brief(name)}")
    return layouts[name]


def _path_text(*parts: object) -> str:
    """Stand-in for pathlib paths (StorageMeta.checkpoint_id): the path as text."""
    if not all(isinstance(part, str) for part in parts):
        raise FormatError(f"a pickled path has non-text parts {brief(parts)}")
    return "/".join(str(part) for part in parts)


def _size(dims: object) -> tuple[int, ...]:
    """Stand-in for torch.Size: the dimensions as a tuple of integers (hashed by identity: see IdentityTuple)."""
    return IdentityTuple(ints(dims, "torch.Size"))


def _set(items: object = ()) -> set[Any]:
    """Stand-in for set(items): the items checked before they are hashed (unpickled.spread_keys)."""
    return set(spread_keys(items, "set()"))


def _frozenset(items: object = ()) -> IdentityFrozenset:
    """Stand-in for frozenset(items), checked as set(); hashed by identity (see IdentityFrozenset)."""
    return IdentityFrozenset(spread_keys(items, "frozenset()"))


class CheckedOrderedDict(collections.OrderedDict[Any, Any], metaclass=Sealed):
    """collections.OrderedDict whose constructor's pairs are checked before their keys are hashed (spread_keys)."""

    def __init__(self, pairs: object = ()) -> None:
        if not isinstance(pairs, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
            raise FormatError(f"OrderedDict() of {brief(pairs, 40)}: only a list of (key, value) pairs is read")
        spread_keys([pair[0] for pair in pairs], "OrderedDict()")
        super().__init__(pairs)


def _checked_dict(pairs: object = ()) -> dict[Any, Any]:
    """Stand-in for a value record's OrderedDict: a dict, its pairs checked as CheckedOrderedDict's."""
    return dict(CheckedOrderedDict(pairs))


SIZE = StandIn(_size, "torch.Size")


def _memory_format_code(value: object) -> int:
    """Stand-in for DCP's _MEM_FORMAT_ENCODING(value): the code (contiguous, channels last, preserve)."""
    if isinstance(value, bool) or value not in (0, 1, 2):
        raise FormatError(f"_MEM_FORMAT_ENCODING({brief(value, 40)}) is not a memory format")
    return int(value)


# Stand-ins for DCP's metadata classes: each instance keeps the state the pickle gives it (a dataclass's __dict__,
# TensorProperties' tuple), and read_dcp_metadata reads the fields it needs from there.
class MetadataState(Pickled):
    __slots__ = ()
    kind = "torch.distributed.checkpoint.metadata.Metadata"


class TensorStorageState(Pickled):
    __slots__ = ()
    kind = "TensorStorageMetadata"


class BytesStorageState(Pickled):
    __slots__ = ()
    kind = "BytesStorageMetadata"


class ChunkState(Pickled):
    __slots__ = ()
    kind = "ChunkStorageMetadata"


class TensorPropertiesState(Pickled):
    __slots__ = ()
    kind = "TensorProperties"

    def dtype(self) -> object:
        """The dtype: first in the tuple TensorProperties.__getstate__ returns (a dict from older versions)."""
        if isinstance(self.state, tuple) and self.state:
            return self.state[0]
        return self.field("dtype")


class MetadataIndexState(Pickled):
    __slots__ = ()
    kind = "MetadataIndex"


class StorageMetaState(Pickled):
    __slots__ = ()
    kind = "StorageMeta"


class StorageInfoState(Pickled):
    __slots__ = ()
    kind = "_StorageInfo"


_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_PATH_CLASSES = ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path")
_PATH = StandIn(_path_text, "pathlib.Path")

METADATA_ADMITTED: dict[tuple[str, str], Any] = {
    (_METADATA_MODULE, "Metadata"): MetadataState,
    (_METADATA_MODULE, "TensorStorageMetadata"): TensorStorageState,
    (_METADATA_MODULE, "BytesStorageMetadata"): BytesStorageState,
    (_METADATA_MODULE, "ChunkStorageMetadata"): ChunkState,
    (_METADATA_MODULE, "TensorProperties"): TensorPropertiesState,
    (_METADATA_MODULE, "MetadataIndex"): MetadataIndexState,
    (_METADATA_MODULE, "StorageMeta"): StorageMetaState,
    (_METADATA_MODULE, "_MEM_FORMAT_ENCODING"): StandIn(_memory_format_code, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): StorageInfoState,
    ("torch", "Size"): SIZE,
    **torch_values((torch.dtype, torch.layout, torch.memory_format)),  # torch's own, immutable
    ("torch.serialization", "_get_layout"): StandIn(_layout_named, "torch.serialization._get_layout"),
    ("collections", "OrderedDict"): CheckedOrderedDict,
    ("builtins", "set"): StandIn(_set, "set"),
    ("builtins", "frozenset"): StandIn(_frozenset, "frozenset"),
    **{(module, n): _PATH for module in ("pathlib", "pathlib._local") for n in _PATH_CLASSES},
}


# ------------------------------------------------------------------------------------------ .metadata


def read_dcp_metadata(data: bytes, where: str) -> DcpMetadata:
    """Decode a DCP `.metadata` pickle with the restricted unpickler, then check and convert every field."""
    raw = unpickle(data, where, METADATA_ADMITTED)
    if not isinstance(raw, MetadataState):
        raise FormatError(f"{where}: holds a {type(raw).__name__}, not DCP Metadata")
    entries, storage = raw.field("state_dict_metadata"), raw.field("storage_data")
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise FormatError(f"{where}: state_dict_metadata and storage_data must be dicts")
    records: dict[tuple[str, tuple[int, ...] | None], DcpRecord] = {}
    for key, info in storage.items():
        if not isinstance(key, MetadataIndexState) or not isinstance(info, StorageInfoState):
            raise FormatError(f"{where}: storage_data maps {type(key).__name__} to {type(info).__name__}")
        fqn = _text(key.field("fqn"), f"{where}: storage key")
        offset = key.field("offset")
        records[(fqn, None if offset is None else ints(offset, f"{where}: {fqn!r} offset"))] = _record(
            info, f"{where}: {fqn!r}"
        )
    planner = raw.field("planner_data")
    paths = planner if isinstance(planner, dict) else {}
    tensors, values, tensor_paths = [], [], {}
    for name, entry in entries.items():
        name = _text(name, f"{where}: state dict key")
        path = _path(paths.get(name), name)
        if isinstance(entry, BytesStorageState):
            record = records.get((name, None))
            if record is None:
                raise FormatError(f"{where}: no storage record for value {name!r}")
            values.append(DcpValue(name, path, record))
        elif isinstance(entry, TensorStorageState):
            tensors.append(_tensor(name, entry, records, where))
            tensor_paths[name] = path
        else:
            raise FormatError(f"{where}: entry {name!r} is a {type(entry).__name__}")
    version = raw.field("version")
    return DcpMetadata(tuple(tensors), tuple(values), tensor_paths, version if isinstance(version, str) else None)


def _tensor(
    name: str,
    entry: TensorStorageState,
    records: dict[tuple[str, tuple[int, ...] | None], DcpRecord],
    where: str,
) -> DcpTensor:
    where = f"{where}: tensor {name!r}"
    properties = entry.field("properties")
    dtype = properties.dtype() if isinstance(properties, TensorPropertiesState) else None
    if not isinstance(dtype, torch.dtype):
        raise FormatError(f"{where}: dtype is {brief(dtype)}")
    shape = ints(entry.field("size"), f"{where} size")
    chunks = entry.field("chunks")
    if not isinstance(chunks, list):
        raise FormatError(f"{where}: chunks must be a list")
    result = []
    for chunk in chunks:
        if not isinstance(chunk, ChunkState):
            raise FormatError(f"{where}: a chunk is a {type(chunk).__name__}")
        offsets = ints(chunk.field("offsets"), f"{where} chunk offsets")
        sizes = ints(chunk.field("sizes"), f"{where} chunk sizes")
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise FormatError(f"{where}: chunk at {list(offsets)} of shape {list(sizes)} for shape {list(shape)}")
        if any(o + s > d for o, s, d in zip(offsets, sizes, shape)):
            raise FormatError(f"{where}: chunk at {list(offsets)} of shape {list(sizes)} exceeds {list(shape)}")
        record = records.get((name, offsets))
        if record is None:
            raise FormatError(f"{where}: no storage record for the chunk at {list(offsets)}")
        result.append(DcpChunk(offsets, sizes, record))
    return DcpTensor(name, dtype, shape, tuple(result))


def _record(info: StorageInfoState, where: str) -> DcpRecord:
    path = _text(info.field("relative_path"), f"{where} relative_path")
    if not _RECORD_NAME.fullmatch(path) or ".." in path:
        raise FormatError(f"{where}: record file {path!r} is not a plain file name in the DCP directory")
    offset, length = info.field("offset"), info.field("length")
    if not isinstance(offset, int) or not isinstance(length, int) or not _in_range(offset) or not _in_range(length):
        raise FormatError(f"{where}: record offset/length {brief(offset, 40)}/{brief(length, 40)} out of range")
    transforms = info.field("transform_descriptors")
    if transforms:
        raise FormatError(
            f"{where}: the record uses storage transforms {brief(transforms)} (e.g. compression), "
            "which this importer does not read"
        )
    return DcpRecord(path, offset, length)


def _in_range(value: int) -> bool:
    return not isinstance(value, bool) and 0 <= value < 1 << 62


def _text(value: object, where: str) -> str:
    if not isinstance(value, str) or not value or "\x00" in value:
        raise FormatError(f"{where}: expected a non-empty name, got {brief(value)}")
    return value


def ints(value: object, where: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or len(value) > 64:
        raise FormatError(f"{where}: expected a sequence of at most 64 integers, got {brief(value)}")
    if any(isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 62 for v in value):
        raise FormatError(f"{where}: expected non-negative integers, got {brief(value)}")
    return tuple(int(v) for v in value)


def _path(value: object, name: str) -> tuple[str | int, ...]:
    """The key path DCP's planner recorded for `name`; the dotted name itself when none is usable.

    At most MAX_KEY_PATH keys, each a string or a non-negative integer below 2^62: the importer nests values
    along these paths and prints them, so their number and size are bounded.
    """
    if not isinstance(value, tuple) or not 0 < len(value) <= MAX_KEY_PATH:
        return (name,)
    for part in value:
        if not isinstance(part, str) and not (isinstance(part, int) and _in_range(part)):
            return (name,)
    return tuple(value)


# ---------------------------------------------------------------------------------------- records


# Slotted and frozen: a BUILD on one (a shared storage class, or a rebuilt tensor's description) is refused.
@dataclass(frozen=True, slots=True)
class StorageClass:
    dtype: torch.dtype

    __setstate__ = refuse_state  # dataclass(slots=True) would add one that writes the fields


@dataclass(frozen=True, slots=True)
class StorageRef:
    key: str
    dtype: torch.dtype
    numel: int

    __setstate__ = refuse_state  # dataclass(slots=True) would add one that writes the fields


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
        raise FormatError(f"unexpected persistent reference {brief(pid, 200)}")
    _, kind, key, _location, numel = pid
    if not isinstance(key, str) or isinstance(numel, bool) or not isinstance(numel, int) or not 0 <= numel < 1 << 62:
        raise FormatError(f"bad storage reference {brief(pid, 200)}")
    return StorageRef(key, kind.dtype, numel)


def _stored(storage: object, offset: object, size: object, stride: object, dtype: torch.dtype) -> StoredTensor:
    if not isinstance(storage, StorageRef) or isinstance(offset, bool) or not isinstance(offset, int):
        raise FormatError(f"a tensor rebuild got storage {brief(storage)} at offset {brief(offset)}")
    shape, strides = ints(size, "tensor size"), ints(stride, "tensor stride")
    if len(strides) != len(shape) or offset < 0:
        raise FormatError(f"tensor size {list(shape)}, stride {list(strides)}, offset {offset} do not match")
    return StoredTensor(storage.key, storage.numel * storage.dtype.itemsize, dtype, offset, shape, strides)


def _check_extra(requires_grad: object, hooks: object, metadata: object) -> None:
    if not isinstance(requires_grad, bool) or hooks or metadata:
        raise FormatError(f"tensor with hooks {brief(hooks)} or metadata {brief(metadata)} is not a plain tensor")


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
        raise FormatError(f"tensor dtype {brief(dtype)} is not a torch dtype")
    return _stored(storage, offset, size, stride, dtype)


REBUILD_V2 = StandIn(rebuild_v2, "torch._utils._rebuild_tensor_v2")
REBUILD_V3 = StandIn(rebuild_v3, "torch._utils._rebuild_tensor_v3")

TENSOR_RECORD_ADMITTED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): REBUILD_V2,
    ("torch._utils", "_rebuild_tensor_v3"): REBUILD_V3,
    **{("torch", name): StorageClass(dtype) for name, dtype in _LEGACY_STORAGES.items()},
    ("torch", "UntypedStorage"): StorageClass(torch.uint8),
    ("torch.storage", "UntypedStorage"): StorageClass(torch.uint8),
    **torch_values((torch.dtype,)),
    ("collections", "OrderedDict"): CheckedOrderedDict,
}


def _latin1(text: object, encoding: object) -> bytes:
    """Stand-in for _codecs.encode, which torch.save's pickle protocol 2 writes for every non-empty bytes value as
    encode(the bytes as latin-1 text, "latin1"): the same bytes back, nothing else."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise FormatError(f"_codecs.encode({brief(text)}, {brief(encoding)}) is not how a pickle writes bytes")
    try:
        return text.encode("latin-1")
    except UnicodeEncodeError:
        raise FormatError("_codecs.encode of text beyond latin-1 is not how a pickle writes bytes") from None


def _bytes(*args: object) -> bytes:
    """Stand-in for bytes() and bytearray() as pickles call them: (), or the bytes (bytearray becomes bytes: a
    plain value has one binary type)."""
    if not args:
        return b""
    if len(args) == 1 and isinstance(args[0], (bytes, bytearray)):
        return bytes(args[0])
    if len(args) == 2 and isinstance(args[0], str) and args[1] in ("latin1", "latin-1"):
        return _latin1(*args)
    raise FormatError(f"bytes{brief(args)} is not how a pickle writes bytes")


def _not_plain(kind: str) -> StandIn:
    """A type torch.save pickles for a plain Python value that shardckpt cannot store as one (SPEC 7 values are
    None, bool, int, float, str, bytes, lists, tuples and string- or int-keyed maps): refused by name."""

    def refuse(*args: object) -> NoReturn:
        raise FormatError(
            f"a Python {kind}, which a shardckpt object cannot hold (plain values: None, bool, int, float, str, "
            "bytes, list, tuple, dict); convert it in the state before saving"
        )

    return StandIn(refuse, kind)


_BUILTINS = ("builtins", "__builtin__")  # torch.save writes pickle protocol 2: Python 2's module names
_NOT_PLAIN = {"set": "set", "frozenset": "frozenset", "complex": "complex", "slice": "slice", "range": "range"}
VALUE_ADMITTED: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): StandIn(_checked_dict, "OrderedDict"),
    ("_codecs", "encode"): StandIn(_latin1, "_codecs.encode"),
    **{(module, name): StandIn(_bytes, name) for module in _BUILTINS for name in ("bytes", "bytearray")},
    **{(module, name): _not_plain(kind) for module in _BUILTINS for name, kind in _NOT_PLAIN.items()},
    ("__builtin__", "xrange"): _not_plain("range"),
    ("collections", "deque"): _not_plain("collections.deque"),
    ("collections", "defaultdict"): _not_plain("collections.defaultdict"),
}


def read_tensor_pickle(data: bytes, where: str) -> StoredTensor:
    """Describe the tensor a torch.save zip holds, from its data.pkl, without building it."""
    _check_size(data, where)
    result = unpickle(data, where, TENSOR_RECORD_ADMITTED, storage_ref)
    if not isinstance(result, StoredTensor):
        raise FormatError(f"{where}: holds a {type(result).__name__}, not one tensor")
    return result


def read_value_pickle(data: bytes, where: str) -> Any:
    """A plain value (numbers, strings, lists, dicts, tuples) from a bytes record's data.pkl; no global admitted.

    Checked as a tree first (tree_budget): whatever walks, prints or stores the value later does bounded work.
    """
    _check_size(data, where)
    value = unpickle(data, where, VALUE_ADMITTED)
    check_tree(value, where, tree_budget(len(data)))
    return value


def tree_budget(pickle_bytes: int) -> int:
    """How large (check_tree) a value unpickled from `pickle_bytes` bytes may be: a few times its own size.

    A tree-shaped value is at most about its pickle's size (every node and every string byte is written out);
    more means shared parts repeated, which real values do a little and hostile ones 2^60 times.
    """
    return 16 * pickle_bytes + (4 << 20)


def _check_size(data: bytes, where: str) -> None:
    if len(data) > MAX_RECORD_PICKLE_BYTES:
        raise FormatError(f"{where}: data.pkl of {len(data)} bytes exceeds {MAX_RECORD_PICKLE_BYTES}")
