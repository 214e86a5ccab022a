"""Restricted unpickling of DeepSpeed ZeRO checkpoint files (`zero_pp_rank_*_mp_rank_*_{model,optim}_states.pt`).

Admits only the globals DeepSpeed writes there, each as a local stand-in that records plain values; runs nothing.

The admitted table, found by listing the GLOBAL/STACK_GLOBAL opcodes of real DeepSpeed 0.19 ZeRO-3 files:
- torch's tensor rebuilds (`_rebuild_tensor_v2/_v3`, `_rebuild_from_type_v2` with `torch.Tensor`, the flat fp32
  groups carry a `ds_id` attribute), storage classes and dtypes: dcp_pickle's stand-ins, which only describe a
  tensor (StoredTensor); its bytes are located in the zip later.
- `torch.Size` (param_shapes): a tuple of ints. `collections.OrderedDict` (module, param_shapes): a dict (the
  module state dict's `_metadata` attribute, torch's module versions, is dropped).
- `deepspeed.runtime.zero.config.ZeroStageEnum` (zero_stage): its integer value.
- `deepspeed.runtime.fp16.loss_scaler.LossScaler` / `DynamicLossScaler` (loss_scaler), and `argparse.Namespace`
  (the `args` client state Megatron-DeepSpeed saves): a RecordedObject keeping the attribute dict it is given.
Anything else, including a class DeepSpeed never writes, is refused by dcp_pickle's find_class before it runs;
dcp_pickle.unpickle scans the opcodes first (pickle_scan), so a tiny pickle cannot make the C unpickler allocate
GBs; every admitted object is sealed (a BUILD on it is refused); and the result is checked as a tree
(unpickled.check_tree), so the importer's walks over it are bounded.
"""

from __future__ import annotations

from typing import Any

from shardckpt.errors import FormatError
from shardckpt.interop.dcp_pickle import (
    REBUILD_V2,
    REBUILD_V3,
    SIZE,
    TENSOR_RECORD_ADMITTED,
    StoredTensor,
    storage_ref,
    tree_budget,
    unpickle,
)
from shardckpt.interop.unpickled import Sealed, StandIn, brief, check_tree, spread_keys

LABEL = "a DeepSpeed checkpoint"  # completes "refuses the pickled global X (not a name ... uses)"
MAX_PICKLE_BYTES = 256 << 20  # data.pkl of one rank file: metadata only, the tensor bytes are separate entries
_ATTRIBUTE_TYPES = (bool, int, float, str, type(None))  # what the live adapter keeps of a loss scaler


class RecordedObject(metaclass=Sealed):
    """Stand-in for an instance pickled as NEWOBJ + BUILD: keeps the attributes it is given, has no behaviour."""

    __slots__ = ("values",)
    kind = "object"
    values: dict[str, Any]

    def __new__(cls, *args: object) -> RecordedObject:
        if args:  # DeepSpeed's classes pickle with no constructor arguments
            raise FormatError(f"a pickled {cls.kind} is constructed with arguments {brief(args)}")
        instance = super().__new__(cls)
        object.__setattr__(instance, "values", {})
        return instance

    def __setstate__(self, state: object) -> None:
        if not isinstance(state, dict) or not all(isinstance(key, str) for key in state):
            raise FormatError(f"a pickled {self.kind} has state {type(state).__name__}, not an attribute dict")
        object.__setattr__(self, "values", dict(state))

    def __setattr__(self, name: str, value: object) -> None:
        raise FormatError(f"a pickle may not set the attribute {name[:40]!r} of a pickled {self.kind}")

    def __delattr__(self, name: str) -> None:
        raise FormatError(f"a pickle may not delete the attribute {name[:40]!r} of a pickled {self.kind}")


class LossScalerState(RecordedObject):
    __slots__ = ()
    kind = "deepspeed.runtime.fp16.loss_scaler.LossScaler"


class DynamicLossScalerState(RecordedObject):
    __slots__ = ()
    kind = "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"


class NamespaceState(RecordedObject):
    __slots__ = ()
    kind = "argparse.Namespace"


class OrderedDictState(dict[Any, Any], metaclass=Sealed):
    """Stand-in for collections.OrderedDict: a dict. A module state dict's `_metadata` attribute is dropped."""

    __slots__ = ()

    def __init__(self, pairs: object = ()) -> None:
        # A call with pairs hashes their keys, which pickle_stack cannot see: checked first (spread_keys).
        if not isinstance(pairs, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
            raise FormatError(f"OrderedDict() of {brief(pairs, 40)}: only a list of (key, value) pairs is read")
        spread_keys([pair[0] for pair in pairs], "OrderedDict()")
        super().__init__(pairs)

    def __setstate__(self, state: object) -> None:
        if not isinstance(state, dict):
            raise FormatError(f"a pickled OrderedDict has state {type(state).__name__}, not an attribute dict")


def _tensor_class() -> None:
    """Stand-in for the class `torch.Tensor` as _rebuild_from_type_v2 names it: a marker, never called."""
    raise FormatError("torch.Tensor is named as a type to rebuild, not called")


TENSOR_CLASS = StandIn(_tensor_class, "torch.Tensor")


def _rebuild_from_type(func: object, new_type: object, args: object, state: object) -> StoredTensor:
    """Stand-in for torch._tensor._rebuild_from_type_v2: a plain tensor whose attributes (ds_id) are dropped."""
    if func not in (REBUILD_V2, REBUILD_V3) or new_type is not TENSOR_CLASS or not isinstance(args, tuple):
        raise FormatError(f"a tensor rebuild names {brief(func)} for {brief(new_type)}: only plain tensors are read")
    if state is not None and not isinstance(state, dict):
        raise FormatError(f"a tensor carries state of type {type(state).__name__}, not an attribute dict")
    rebuilt: StoredTensor = func(*args)
    return rebuilt


def _zero_stage(value: object) -> int:
    """Stand-in for ZeroStageEnum(value): the stage number."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 3:
        raise FormatError(f"ZeroStageEnum({brief(value, 40)}) is not a ZeRO stage")
    return value


_LOSS_SCALER = "deepspeed.runtime.fp16.loss_scaler"
ADMITTED: dict[tuple[str, str], Any] = {
    **TENSOR_RECORD_ADMITTED,
    ("collections", "OrderedDict"): OrderedDictState,
    ("torch._tensor", "_rebuild_from_type_v2"): StandIn(_rebuild_from_type, "torch._tensor._rebuild_from_type_v2"),
    ("torch", "Tensor"): TENSOR_CLASS,
    ("torch", "Size"): SIZE,
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): StandIn(_zero_stage, "ZeroStageEnum"),
    (_LOSS_SCALER, "LossScaler"): LossScalerState,
    (_LOSS_SCALER, "DynamicLossScaler"): DynamicLossScalerState,
    ("argparse", "Namespace"): NamespaceState,
}


def read_checkpoint_pickle(data: bytes, where: str) -> Any:
    """The structure a rank file's data.pkl holds: dicts, lists and plain values, StoredTensors, RecordedObjects."""
    if len(data) > MAX_PICKLE_BYTES:
        raise FormatError(f"{where}: data.pkl of {len(data)} bytes exceeds {MAX_PICKLE_BYTES}")
    try:
        content = unpickle(data, where, ADMITTED, storage_ref, LABEL)
    except FormatError as exc:
        if str(exc).startswith(where):
            raise
        raise FormatError(f"{where}: {exc}") from None  # a stand-in's own complaint: say which file
    # As a tree, so the importer's walks, comparisons and messages over it do bounded work.
    check_tree(content, where, tree_budget(len(data)), _recorded_values)
    return content


def _recorded_values(node: object) -> list[object] | None:
    return list(node.values.values()) if isinstance(node, RecordedObject) else None


def plain_attributes(value: object) -> dict[str, Any]:
    """The attributes of a RecordedObject that are plain scalars (a DynamicLossScaler's dtype is left out)."""
    if not isinstance(value, RecordedObject):
        return {}
    return {key: item for key, item in value.values.items() if isinstance(item, _ATTRIBUTE_TYPES)}
