"""Converting a DeepSpeed ZeRO-3 checkpoint (`engine.save_checkpoint`) into a committed shardckpt checkpoint.

Each data-parallel rank's pair of files becomes one rank, which writes only its own flat slices (padding dropped).

ZeRO-3 partitions every parameter on its own: with n elements over W ranks each rank holds ps = ceil(n / W) of
them, rank r the row-major elements [r * ps, min((r + 1) * ps, n)), padded to ps (the padding is garbage, not
zeros). A sub-group's fp32 master buffer (`fp32_flat_groups[i]`) and each Adam moment
(`optimizer_state_dict.state[i]`) concatenate their parameters' partitions in `param_shapes[i]` order, so every
slice is a flat element range of one parameter and is written as such (ShardWriter.add(flat_offset=...)).

The names are the live adapter's (shardckpt.statedict.deepspeed) and the bundled FSDP2 loop's: `model.<fqn>`,
`optim.state.<fqn>.{exp_avg,exp_avg_sq,step}`, the objects `optim.param_groups`, `scheduler`, `deepspeed`, and
the client state under its own keys. Both pickles of a rank are read by deepspeed_pickle's restricted unpickler;
tensor bytes are views of the (memory-mapped) zip entries, never torch.load.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch

from shardckpt.catalog.chain import read_commit_marker
from shardckpt.errors import AlreadyExistsError, FormatError, NotFoundError, ShardckptError, ShardckptUsageError
from shardckpt.format import layout
from shardckpt.format.limits import MAX_DEPTH
from shardckpt.format.strict import check_name, check_shape
from shardckpt.format.values import check_plain
from shardckpt.interop.dcp_pickle import StoredTensor
from shardckpt.interop.deepspeed_pickle import (
    MAX_PICKLE_BYTES,
    RecordedObject,
    plain_attributes,
    read_checkpoint_pickle,
)
from shardckpt.interop.import_io import ImportReport, SourceDir, with_progress
from shardckpt.interop.torch_zip import ZipEntries, tensor_view, zip_entries
from shardckpt.interop.unpickled import brief
from shardckpt.statedict.names import model_entry, optimizer_entry
from shardckpt.storage import Storage, open_storage
from shardckpt.torch_bytes import format_dtype
from shardckpt.write.commit import commit
from shardckpt.write.writer import ShardWriter

LATEST = "latest"
_MAX_LATEST_BYTES = 4096
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}")
_OPTIM_FILE = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
# What save_checkpoint itself puts in model_states; every other key is the caller's client_state.
_ENGINE_KEYS = frozenset(
    {
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "frozen_param_fragments",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "checkpoint_parallel_dimensions",
        "universal_checkpoint_info",
        "ds_config",
        "ds_version",
    }
)
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_RESERVED = ("model", "optim", "scheduler", "deepspeed")  # names of this importer's own entries


def optim_file(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def model_file(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


# ------------------------------------------------------------------------------------------ one rank


@dataclass
class _Pickled:
    """One rank file: its zip entries (for tensor bytes) and what its data.pkl holds."""

    where: str
    entries: ZipEntries
    content: dict[str, Any]

    def tensor(
        self, value: object, what: str, dtype: torch.dtype | None = None, ndim: int | None = None
    ) -> torch.Tensor:
        if not isinstance(value, StoredTensor):
            raise FormatError(f"{self.where}: {what} is a {type(value).__name__}, not a tensor")
        if (dtype is not None and value.dtype != dtype) or (ndim is not None and len(value.size) != ndim):
            raise FormatError(f"{self.where}: {what} is {value.dtype} {list(value.size)}, expected {ndim}-D {dtype}")
        return tensor_view(self.entries, value, f"{self.where} ({what})")

    def get(self, key: str, kind: type, what: str | None = None) -> Any:
        """content[key], which must be a `kind` (dict, list or int; never a bool)."""
        value = self.content.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise FormatError(f"{self.where}: {what or key} is {brief(value)}, not a {kind.__name__}")
        return value


def _read(source: SourceDir, name: str, mapped: ExitStack) -> _Pickled:
    where = source.describe(name)
    entries = zip_entries(source.whole(name, mapped), where)
    content = read_checkpoint_pickle(entries.pickle_bytes(MAX_PICKLE_BYTES), where)
    if not isinstance(content, dict):
        raise FormatError(f"{where}: holds a {type(content).__name__}, not DeepSpeed's checkpoint dict")
    return _Pickled(where, entries, content)


@dataclass
class _Rank:
    rank: int
    model: _Pickled
    optim: _Pickled
    zero: _Pickled  # optim's `optimizer_state_dict`: DeepSpeed's ZeRO-3 optimizer state
    base: dict[str, Any]  # the torch optimizer's state_dict: `state` per sub-group, `param_groups`


def _read_rank(source: SourceDir, rank: int, mapped: ExitStack) -> _Rank:
    model, optim = _read(source, model_file(rank), mapped), _read(source, optim_file(rank), mapped)
    zero = _Pickled(optim.where, optim.entries, optim.get("optimizer_state_dict", dict))
    stage = zero.content.get("zero_stage")
    if stage != 3:
        raise FormatError(
            f"{optim.where}: ZeRO stage {brief(stage, 20)}; only stage 3 (partitioned parameters) is imported"
        )
    if "ds_zero_partition_groups" in zero.content:
        raise FormatError(f"{optim.where}: expert (AutoEP) partition groups are not supported")
    if model.content.get("optimizer") is not None:
        raise FormatError(f"{model.where}: holds a whole optimizer state: not a ZeRO checkpoint")
    base = zero.get("optimizer_state_dict", dict, "optimizer_state_dict.optimizer_state_dict")
    if not isinstance(base.get("state"), dict) or not isinstance(base.get("param_groups"), list):
        raise FormatError(f"{optim.where}: the base optimizer state lacks a `state` dict or `param_groups` list")
    return _Rank(rank, model, optim, zero, base)


# ------------------------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class _Param:
    fqn: str
    shape: tuple[int, ...]
    offset: int  # of its partition within the sub-group's flat buffer
    size: int  # ps = ceil(numel / world)

    def span(self, rank: int) -> tuple[int, int]:
        """(first element, count) of the parameter that `rank` holds: its partition without the padding."""
        numel = math.prod(self.shape)
        first = min(rank * self.size, numel)
        return first, max(0, min(self.size, numel - first))


@dataclass
class _Plan:
    """What rank 0 says every rank holds; the other ranks are checked against it."""

    world: int
    param_shapes: Any  # as pickled, to compare other ranks' with
    sub_groups: list[list[_Param]]
    frozen: list[_Param]
    aliases: dict[str, list[str]]  # shared (tied) parameter -> the names that alias it
    moments: list[list[str]]  # per sub-group: its per-element optimizer state keys (exp_avg, ...)
    steps: list[float | None]
    group_of: list[int]  # per sub-group: its base optimizer param group
    names: set[str]  # of all parameters
    buffers: list[str] = field(default_factory=list)


def _shapes(value: object, where: str, what: str) -> list[tuple[str, tuple[int, ...]]]:
    if not isinstance(value, dict):
        raise FormatError(f"{where}: {what} is a {type(value).__name__}, not a name -> shape dict")
    result = []
    for name, shape in value.items():
        check_name(name, f"{where}: {what} name")
        if not isinstance(shape, tuple):
            raise FormatError(f"{where}: {what}[{name!r}] is {brief(shape)}, not a torch.Size")
        result.append((name, check_shape(shape, f"{where}: {what}[{name!r}]")))
    return result


def _plan(rank0: _Rank, world: int) -> _Plan:
    model = rank0.model
    shapes = model.get("param_shapes", list)
    params: list[list[_Param]] = []
    for index, group in enumerate(shapes):
        offset, members = 0, []
        for fqn, shape in _shapes(group, model.where, f"param_shapes[{index}]"):
            size = -(-math.prod(shape) // world)
            members.append(_Param(fqn, shape, offset, size))
            offset += size
        params.append(members)
    frozen_shapes = model.content.get("frozen_param_shapes") or {}
    frozen = [_Param(n, s, 0, -(-math.prod(s) // world)) for n, s in _shapes(frozen_shapes, model.where, "frozen")]
    shared = model.content.get("shared_params") or {}
    if not isinstance(shared, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in shared.items()):
        raise FormatError(f"{model.where}: shared_params is {brief(shared)}, not a name -> name dict")
    aliases: dict[str, list[str]] = {}
    for alias, source in shared.items():
        aliases.setdefault(source, []).append(check_name(alias, f"{model.where}: shared_params"))
    names = [p.fqn for group in params for p in group] + [p.fqn for p in frozen]
    if len(set(names)) != len(names) or set(aliases) - set(names) or set(shared) & set(names):
        raise FormatError(f"{model.where}: a parameter name appears twice in param_shapes/frozen/shared_params")
    group_of = _group_of(rank0, len(params))
    moments, steps = [], []
    for index in range(len(params)):
        moments.append(_moment_keys(rank0, index))
        steps.append(_step(rank0, index))
    plan = _Plan(world, shapes, params, frozen, aliases, moments, steps, group_of, set(names))
    plan.buffers = _buffer_names(model, plan)
    return plan


def _group_of(rank0: _Rank, sub_groups: int) -> list[int]:
    """Which base optimizer param group each sub-group belongs to (its `params` are sub-group indices)."""
    owner: dict[int, int] = {}
    for group_index, group in enumerate(rank0.base["param_groups"]):
        members = group.get("params") if isinstance(group, dict) else None
        if not isinstance(members, list) or not all(isinstance(m, int) and 0 <= m < sub_groups for m in members):
            raise FormatError(f"{rank0.optim.where}: param_groups[{group_index}].params names no valid sub-groups")
        owner.update({member: group_index for member in members})
    if sorted(owner) != list(range(sub_groups)):
        raise FormatError(f"{rank0.optim.where}: param_groups do not cover the {sub_groups} sub-groups exactly")
    return [owner[index] for index in range(sub_groups)]


def _sub_state(rank: _Rank, index: int) -> dict[str, Any]:
    """The base optimizer's state of sub-group `index` (empty before the first step)."""
    state = rank.base["state"].get(index, {})
    if not isinstance(state, dict) or not all(isinstance(key, str) for key in state):
        raise FormatError(f"{rank.optim.where}: the optimizer state of sub-group {index} is not a dict of names")
    return state


def _moment_keys(rank: _Rank, index: int) -> list[str]:
    """The per-element state of a sub-group (exp_avg, exp_avg_sq, ...): every tensor but the step."""
    keys = sorted(k for k, v in _sub_state(rank, index).items() if isinstance(v, StoredTensor) and k != "step")
    for key in keys:
        if not _KEY.fullmatch(key):  # it becomes part of a tensor name: no dots, nothing odd
            raise FormatError(f"{rank.optim.where}: optimizer state key {key[:80]!r} is not an identifier")
    return keys


def _step(rank: _Rank, index: int) -> float | None:
    step = _sub_state(rank, index).get("step")
    if isinstance(step, StoredTensor):
        values = rank.zero.tensor(step, f"the step of sub-group {index}")
        if values.numel() != 1 or values.dtype.is_complex or values.dtype == torch.bool:
            raise FormatError(
                f"{rank.optim.where}: the step of sub-group {index} is a {values.dtype} {list(values.shape)}"
            )
        return float(values.reshape(()).item())
    if isinstance(step, (int, float)) and not isinstance(step, bool):
        return float(step)
    if step is not None:
        raise FormatError(f"{rank.optim.where}: the step of sub-group {index} is {brief(step)}")
    return None


def _check_rank(rank: _Rank, plan: _Plan) -> None:
    """Everything a rank must agree on with rank 0 before its slices are written."""
    model, zero, where = rank.model, rank.zero, rank.optim.where
    if model.content.get("param_shapes") != plan.param_shapes:
        raise FormatError(f"{model.where}: param_shapes differ from rank 0's")
    counts = {
        "partition_count": zero.content.get("partition_count"),
        "dp_world_size": model.content.get("dp_world_size"),
    }
    for key, value in counts.items():
        if value != plan.world:
            raise FormatError(
                f"{where if key == 'partition_count' else model.where}: {key} is {brief(value, 40)}, but rank 0 "
                f"says {plan.world} ranks (hpZ, MiCS and expert partitions are not supported)"
            )
    dimensions = model.content.get("checkpoint_parallel_dimensions") or {}
    if model.content.get("mp_world_size", 1) != 1 or not isinstance(dimensions, dict) or set(dimensions.values()) - {1}:
        raise FormatError(f"{model.where}: tensor or pipeline parallelism: parameters are not in their global shapes")
    flats = zero.get("fp32_flat_groups", list)
    if len(flats) != len(plan.sub_groups):
        raise FormatError(
            f"{where}: {len(flats)} fp32_flat_groups for {len(plan.sub_groups)} sub-groups in param_shapes"
        )
    for index, members in enumerate(plan.sub_groups):
        flat, need = flats[index], sum(p.size for p in members)
        numel = math.prod(flat.size) if isinstance(flat, StoredTensor) else -1
        if numel != need:
            raise FormatError(
                f"{where}: fp32_flat_groups[{index}] holds {numel} elements; its parameters' partitions need {need} "
                f"(ceil(numel / {plan.world}) each)"
            )
        if _moment_keys(rank, index) != plan.moments[index] or _step(rank, index) != plan.steps[index]:
            raise FormatError(
                f"{where}: the optimizer state of sub-group {index} differs in keys or step from rank 0's"
            )


# ------------------------------------------------------------------------------------------- writing


def _write_rank(
    storage: Storage, rank: _Rank, plan: _Plan, attempt: str, step: int | None, objects: dict[str, Any]
) -> int:
    """Write `rank`'s slices (and, on rank 0, steps, buffers and objects); returns the tensor bytes written."""
    writer = ShardWriter(storage, rank=rank.rank, world_size=plan.world, attempt=attempt, step=step)
    written = 0

    def add(name: str, values: torch.Tensor, shape: tuple[int, ...], first: int | None) -> None:
        nonlocal written
        try:
            format_dtype(values.dtype)
        except ShardckptError:
            raise FormatError(f"tensor {name!r}: dtype {values.dtype} cannot be stored in shardckpt") from None
        try:
            writer.add(name, values, global_shape=shape, flat_offset=first)
        except ShardckptUsageError as exc:  # e.g. two entries of the files mapping to one tensor name
            raise FormatError(f"{rank.model.where}: {exc}") from None
        written += values.numel() * values.element_size()

    flats = rank.zero.content["fp32_flat_groups"]
    for index, members in enumerate(plan.sub_groups):
        fp32 = rank.zero.tensor(flats[index], f"fp32_flat_groups[{index}]", torch.float32, 1)
        state = _sub_state(rank, index)
        moments = {k: rank.zero.tensor(state[k], f"state[{index}].{k}", ndim=1) for k in plan.moments[index]}
        for key, values in moments.items():
            if values.numel() != fp32.numel():
                raise FormatError(
                    f"{rank.optim.where}: state[{index}].{key} has {values.numel()} elements, not {fp32.numel()}"
                )
        for param in members:
            first, length = param.span(rank.rank)
            part = slice(param.offset, param.offset + length)
            for name in (param.fqn, *plan.aliases.get(param.fqn, ())):
                add(model_entry(name), fp32[part], param.shape, first)
            for key, values in moments.items():
                add(optimizer_entry(param.fqn, key), values[part], param.shape, first)
            if rank.rank == 0 and plan.steps[index] is not None:  # one step per sub-group: written once
                add(optimizer_entry(param.fqn, "step"), torch.tensor(plan.steps[index], dtype=torch.float32), (), None)
    fragments = rank.model.content.get("frozen_param_fragments") or {}
    for param in plan.frozen:
        if not isinstance(fragments, dict) or param.fqn not in fragments:
            raise FormatError(f"{rank.model.where}: no frozen_param_fragments entry for {param.fqn!r}")
        values = rank.model.tensor(fragments[param.fqn], f"frozen_param_fragments[{param.fqn!r}]").reshape(-1)
        first, length = param.span(rank.rank)
        if values.numel() != param.size:
            raise FormatError(
                f"{rank.model.where}: frozen {param.fqn!r} holds {values.numel()} elements, not {param.size}"
            )
        for name in (param.fqn, *plan.aliases.get(param.fqn, ())):
            add(model_entry(name), values[:length], param.shape, first)
    if rank.rank == 0:
        for name in plan.buffers:
            buffer = rank.model.tensor(rank.model.content["module"][name], f"buffer {name!r}")
            add(model_entry(name), buffer, tuple(buffer.shape), None)
        for name, value in objects.items():
            writer.add_object(name, value)
    writer.close()
    return written


def _buffer_names(model: _Pickled, plan: _Plan) -> list[str]:
    """The module's persistent buffers: whole tensors in `module` (the parameters there are empty placeholders)."""
    names, module = model.get("buffer_names", list), model.get("module", dict)
    for name in names:
        check_name(name, f"{model.where}: buffer_names")
        if name in plan.names or not isinstance(module.get(name), StoredTensor):
            raise FormatError(f"{model.where}: buffer {name!r} is not a tensor in `module`, or is also a parameter")
    return list(names)


# ------------------------------------------------------------------------------------------- objects


def _plain(value: Any) -> str | None:
    """None when `value` can be stored as an object; otherwise why not."""
    try:
        check_plain(value, "value")
    except FormatError as exc:
        found = _foreign(value)
        return f"holds {found}, not plain data" if found else str(exc).removeprefix("value: ")
    return None


def _foreign(value: Any, depth: int = 0) -> str | None:
    """What non-plain thing `value` holds: a tensor or a pickled object (named by its class)."""
    if isinstance(value, StoredTensor):
        return "a tensor"
    if isinstance(value, RecordedObject):
        return f"a pickled {value.kind}"
    if depth > MAX_DEPTH:  # check_plain has refused it already; only the wording is at stake
        return None
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, (list, tuple)) else ()
    return next((found for item in items if (found := _foreign(item, depth + 1))), None)


def _param_groups(rank0: _Rank, plan: _Plan, report: ImportReport) -> list[dict[str, Any]]:
    """The base optimizer's groups as get_state_dict gives them: plain hyperparameters, `params` as FQNs."""
    groups = []
    for index, group in enumerate(rank0.base["param_groups"]):
        hyper = {}
        for key, value in group.items():
            if key == "params":
                continue
            why = _plain(value) if isinstance(key, str) else "not a name"
            if why is None:
                hyper[key] = value
            else:
                report.skipped.append((f"optim.param_groups[{index}].{key}", why))
        members = [p.fqn for sub, params in enumerate(plan.sub_groups) if plan.group_of[sub] == index for p in params]
        groups.append({**hyper, "params": members})
    return groups


def _objects(rank0: _Rank, plan: _Plan, report: ImportReport) -> dict[str, Any]:
    """Rank 0's objects: optim.param_groups, scheduler, deepspeed, and the client state that is plain data."""
    model, zero = rank0.model, rank0.zero
    objects: dict[str, Any] = {}
    if any(_sub_state(rank0, index) for index in range(len(plan.sub_groups))):  # after the first step
        objects["optim.param_groups"] = _param_groups(rank0, plan, report)
    scheduler = model.content.get("lr_scheduler")
    if scheduler is not None:
        why = _plain(scheduler)
        if why is None:
            objects["scheduler"] = scheduler
        else:
            report.skipped.append(("scheduler", why))
    objects["deepspeed"] = {
        **{key: model.get(key, int) for key in ("global_steps", "global_samples", "skipped_steps", "dp_world_size")},
        "ds_version": model.content.get("ds_version") if isinstance(model.content.get("ds_version"), str) else None,
        "loss_scaler": plain_attributes(zero.content.get("loss_scaler")),
        "dynamic_loss_scale": bool(zero.content.get("dynamic_loss_scale", False)),
        "overflow": bool(zero.content.get("overflow", False)),
    }
    for key in ("data_sampler", "random_ltd", "universal_checkpoint_info"):
        if model.content.get(key) is not None:
            report.skipped.append((key, "DeepSpeed engine state this importer does not carry over"))
    for key, value in model.content.items():
        if key in _ENGINE_KEYS:
            continue
        if not isinstance(key, str) or not key or "\x00" in key or key.split(".")[0] in _RESERVED:
            report.skipped.append((brief(key), "client_state key clashes with the imported entries or is not a name"))
            continue
        why = _plain(value)
        if why is None:
            objects[key] = value
        else:
            report.skipped.append((key, why))
    return objects


# ------------------------------------------------------------------------------------------- driver


def import_deepspeed(
    ds_dir: str,
    url: str | Storage,
    *,
    tag: str | None = None,
    step: int | None = None,
    storage_options: dict[str, Any] | None = None,
    source_options: dict[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ImportReport:
    """Write the DeepSpeed ZeRO-3 checkpoint in `ds_dir` as a new committed checkpoint at `url`.

    `ds_dir`: the save dir (its `latest` names the tag, or give `tag`) or the tag dir itself. One rank per
    DeepSpeed data-parallel rank. `step`: default the engine's global_steps. `progress(nbytes, total)` as data
    bytes are written. Client state that is not plain data is skipped and listed in the report; anything that
    cannot be read exactly raises a ShardckptError before the commit.
    """
    began = time.perf_counter()
    root = SourceDir(ds_dir, source_options, kind="a DeepSpeed checkpoint directory", index="partition_count")
    source, tag_name = _tag_dir(root, tag)
    present = source.names()  # one listing: no request per rank file
    ranks = _rank_numbers(source, present)
    target = open_storage(url, storage_options)
    if read_commit_marker(target) is not None:
        raise AlreadyExistsError(f"{target.url} already holds a committed checkpoint; import into a new location")
    report = ImportReport(source.url, target.url)
    with ExitStack() as mapped:
        rank0 = _read_rank(source, 0, mapped)
        world = rank0.zero.get("partition_count", int)
        _check_ranks(source, set(present), ranks, world)
        plan = _plan(rank0, world)
        _check_rank(rank0, plan)
        objects = _objects(rank0, plan, report)
        sizes = _tensor_sizes(rank0, plan)
        total = sum(sizes.values())
        version = objects["deepspeed"]["ds_version"]
        step = rank0.model.get("global_steps", int) if step is None else step
    attempt = layout.new_attempt()
    counting = with_progress(target, progress, total)
    for number in range(world):
        with ExitStack() as mapped:  # the maps close only after _write_rank's views are gone
            rank = _read_rank(source, number, mapped)  # rank 0 again: its views of the last maps are gone
            _check_rank(rank, plan)
            report.tensor_bytes += _write_rank(counting, rank, plan, attempt, step, objects if number == 0 else {})
    about = {"imported_from": "deepspeed", "ds_version": version, "tag": tag_name, "source": ds_dir}
    commit(target, world_size=world, attempt=attempt, step=step, metadata=about)
    report.world_size, report.objects = world, len(objects)
    report.tensors = len(sizes)
    report.seconds = time.perf_counter() - began
    return report


def _tag_dir(root: SourceDir, tag: str | None) -> tuple[SourceDir, str]:
    """The directory holding the rank files: root/<tag>, root/<contents of latest>, or root itself."""
    if tag is None and root.exists(LATEST):
        text = root.read_all(LATEST, _MAX_LATEST_BYTES).decode("utf-8", errors="replace").strip()
        if not _TAG.fullmatch(text) or ".." in text:
            raise FormatError(
                f"{root.describe(LATEST)}: {text[:80]!r} is not a checkpoint tag (a plain directory name)"
            )
        tag = text
    if tag is None:
        return root, root.url.rsplit("/", 1)[-1]
    if not _TAG.fullmatch(tag) or ".." in tag:
        raise FormatError(f"tag {tag[:80]!r} is not a plain directory name")
    return root.child(tag), tag


def _rank_numbers(source: SourceDir, present: list[str]) -> set[int]:
    """The ranks of the optimizer files present; refuses layouts other than ZeRO-3 without model parallelism."""
    ranks: set[int] = set()
    for name in present:
        match = _OPTIM_FILE.fullmatch(name)
        if match is None:
            continue
        if match.group(1):
            raise FormatError(f"{source.describe(name)}: a bf16 ZeRO-1/2 optimizer file; only ZeRO-3 is imported")
        if int(match.group(3)) != 0:
            raise FormatError(
                f"{source.describe(name)}: model-parallel rank {int(match.group(3))}: tensor/pipeline parallel "
                "checkpoints are not imported (parameters are not in their global shapes)"
            )
        ranks.add(int(match.group(2)))
    if not ranks:
        raise FormatError(
            f"{source.url}: no {optim_file(0)} (nor a `{LATEST}` file naming a directory with one): not a DeepSpeed "
            "ZeRO checkpoint directory"
        )
    for name in (model_file(0), optim_file(0)):  # rank 0's files say how many ranks there are
        if name not in present:
            raise NotFoundError(f"{source.describe(name)} is missing (an incomplete save?)")
    return ranks


def _check_ranks(source: SourceDir, present: set[str], ranks: set[int], world: int) -> None:
    if world < 1:
        raise FormatError(f"{source.describe(optim_file(0))}: partition_count {world} is not a world size")
    extra = sorted(ranks - set(range(world)))
    if extra:
        raise FormatError(
            f"{source.describe(optim_file(extra[0]))}: rank {extra[0]} of a checkpoint whose partition_count is "
            f"{world} (files of two saves mixed?)"
        )
    for number in range(world):
        for name in (optim_file(number), model_file(number)):
            if name not in present:
                raise NotFoundError(
                    f"{source.describe(name)} is missing: partition_count says {world} ranks (an incomplete save?)"
                )


def _tensor_sizes(rank0: _Rank, plan: _Plan) -> dict[str, int]:
    """Every tensor the import writes, with its bytes over all ranks."""
    sizes: dict[str, int] = {}
    for index, members in enumerate(plan.sub_groups):
        for param in members:
            numel = math.prod(param.shape)
            for name in (param.fqn, *plan.aliases.get(param.fqn, ())):
                sizes[model_entry(name)] = numel * 4
            sizes.update({optimizer_entry(param.fqn, key): numel * 4 for key in plan.moments[index]})
            if plan.steps[index] is not None:
                sizes[optimizer_entry(param.fqn, "step")] = 4
    fragments = rank0.model.content.get("frozen_param_fragments") or {}
    for param in plan.frozen:
        fragment = fragments.get(param.fqn) if isinstance(fragments, dict) else None
        itemsize = fragment.dtype.itemsize if isinstance(fragment, StoredTensor) else 4
        for name in (param.fqn, *plan.aliases.get(param.fqn, ())):
            sizes[model_entry(name)] = math.prod(param.shape) * itemsize
    for name in plan.buffers:
        buffer = rank0.model.content["module"][name]
        sizes[model_entry(name)] = math.prod(buffer.size) * buffer.dtype.itemsize
    return sizes
