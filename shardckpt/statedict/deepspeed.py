"""A live DeepSpeed ZeRO-3 engine as shardckpt state: FQN-keyed fp32 weights and optimizer moments, global shapes.

Each rank saves the flat slice of every parameter its ZeRO-3 partition holds and loads its slices on any world size.

ZeRO-3 partitions each parameter on its own: with n elements over W ranks every rank holds ps = ceil(n / W) of
them, rank r the row-major elements [r * ps, min((r + 1) * ps, n)), zero-padded to ps; a sub-group's fp32 master
buffer (and each Adam moment) is the concatenation of its parameters' partitions. Every slice is therefore a flat
element range of one parameter, which the format stores as is (FlatPartition), so no rank gathers anything.

The names are those of the bundled FSDP2 loop (torch's get_state_dict): `model.<fqn>`, `optim.state.<fqn>.<key>`,
`optim.param_groups` (hyperparameters and FQNs), `scheduler`; plus the object `deepspeed` (engine counters and
loss scaler), so a checkpoint crosses between the engines in both directions.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shardckpt.errors import ShardckptUsageError
from shardckpt.statedict.flat import FlatPartition
from shardckpt.statedict.names import model_entry, optimizer_entry

ENGINE_KEY = "deepspeed"
SCHEDULER_KEY = "scheduler"
# What a checkpoint written by another engine (FSDP2) lacks; everything else a load asks for must be there.
OPTIONAL_ON_LOAD = (ENGINE_KEY, SCHEDULER_KEY)
_COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")
_SCALER_STATE = (int, float, bool, str, type(None))


@dataclass(frozen=True)
class _Slot:
    """One trainable parameter's slice on this rank: where it sits in its sub-group's flat buffers."""

    fqn: str
    shape: tuple[int, ...]
    sub_group: int
    offset: int  # within the sub-group's flat buffer
    first: int  # first element of the parameter this rank holds
    length: int


def _plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return isinstance(value, _SCALER_STATE)


class DeepSpeedZero3:
    """Save and load a `deepspeed.initialize` ZeRO-3 engine through shardckpt, on any world size.

    state_dict() gives views of the engine's own buffers (nothing copied; the Checkpointer stages them for an
    async save); for a load, load_state() gives destinations and finish_load() pushes what was read into the
    engine: fp32 master weights into its parameter partitions, moments and steps into the optimizer, counters.
    """

    def __init__(self, engine: Any) -> None:
        optimizer = getattr(engine, "optimizer", None)
        if optimizer is None or not hasattr(optimizer, "fp32_partitioned_groups_flat"):
            raise ShardckptUsageError(
                f"{type(optimizer).__name__} is not a DeepSpeed ZeRO stage 3 optimizer: this adapter saves the "
                "fp32 partitions of `zero_optimization.stage: 3` engines"
            )
        if getattr(optimizer, "swap_optimizer", False) or getattr(optimizer, "params_in_nvme_and_cpu", False):
            raise ShardckptUsageError(
                "ZeRO-3 with NVMe offload keeps partitions on NVMe; this adapter needs them in memory"
            )
        if getattr(engine, "mp_world_size", 1) != 1:
            raise ShardckptUsageError(
                f"model parallelism of size {engine.mp_world_size}: parameters are not in their global shapes"
            )
        self.engine, self.optimizer = engine, optimizer
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.names = {param: name for name, param in engine.module.named_parameters()}
        self.slots: list[_Slot] = []
        for sub_group, params in enumerate(optimizer.fp16_groups):
            count = optimizer._get_sub_group_partition_count(sub_group)
            if count != world:
                raise ShardckptUsageError(
                    f"sub-group {sub_group} is partitioned over {count} of {world} ranks (hpZ, MiCS or expert "
                    "groups): only partitions over the whole data-parallel world are supported"
                )
            self.slots.extend(self._slots(sub_group, params, optimizer._get_sub_group_partition_rank(sub_group)))
        trainable = {slot.fqn for slot in self.slots}
        self.frozen = [(n, p) for n, p in engine.module.named_parameters() if n not in trainable]

    def _slots(self, sub_group: int, params: Sequence[Any], rank: int) -> Iterator[_Slot]:
        offset = 0
        for param in params:
            name = self.names.get(param)
            if name is None:
                raise ShardckptUsageError(f"a parameter of sub-group {sub_group} is not in engine.module")
            numel, size = int(param.ds_numel), int(param.partition_numel())
            first = min(rank * size, numel)
            yield _Slot(name, tuple(param.ds_shape), sub_group, offset, first, max(0, min(size, numel - first)))
            offset += size

    # ------------------------------------------------------------------------------------------- views

    def _flat(self, buffer: torch.Tensor, slot: _Slot, name: str) -> FlatPartition:
        return FlatPartition(buffer[slot.offset : slot.offset + slot.length], [(name, slot.shape)], slot.first)

    def _moment_keys(self) -> list[str]:
        """The optimizer's per-element state (exp_avg, exp_avg_sq, ...), the same for every sub-group."""
        keys: set[str] | None = None
        for flat in self.optimizer.fp32_partitioned_groups_flat:
            state = self.optimizer.optimizer.state.get(flat, {})
            found = {k for k, v in state.items() if torch.is_tensor(v) and v.numel() == flat.numel() > 0}
            keys = found if keys is None else keys & found
        return sorted(keys or ())

    def _step_of(self, sub_group: int) -> Any:
        flat = self.optimizer.fp32_partitioned_groups_flat[sub_group]
        return self.optimizer.optimizer.state.get(flat, {}).get("step")

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of the engine state under the FSDP2 loop's names (views of the live buffers)."""
        flats = self.optimizer.fp32_partitioned_groups_flat
        model: dict[str, Any] = {
            slot.fqn: self._flat(flats[slot.sub_group], slot, model_entry(slot.fqn)) for slot in self.slots
        }
        model.update(self._frozen_views())
        model.update(self._buffers())
        moments, optim_state = self._moment_keys(), {}
        for slot in self.slots:
            state = self.optimizer.optimizer.state.get(flats[slot.sub_group], {})
            if not state:
                continue  # no optimizer step taken yet: nothing to save but the weights
            entry: dict[str, Any] = {
                key: self._flat(state[key], slot, optimizer_entry(slot.fqn, key)) for key in moments
            }
            step = state.get("step")
            if step is not None:
                entry["step"] = torch.as_tensor(step, dtype=torch.float32).detach().reshape(())
            optim_state[slot.fqn] = entry
        result: dict[str, Any] = {"model": model, ENGINE_KEY: self._engine_state()}
        if optim_state:  # none before the first optimizer step
            result["optim"] = {"state": optim_state, "param_groups": self._param_groups()}
        scheduler = getattr(self.engine, "lr_scheduler", None)
        if scheduler is not None:
            result[SCHEDULER_KEY] = scheduler.state_dict()
        return result

    def _frozen_views(self) -> dict[str, Any]:
        """Frozen parameters live only in their partitions (ds_tensor), in the module's dtype."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        views: dict[str, Any] = {}
        for name, param in self.frozen:
            numel, size = int(param.ds_numel), int(param.partition_numel())
            if getattr(param, "ds_tensor", None) is None or size * world < numel:
                raise ShardckptUsageError(f"frozen parameter {name!r} is not partitioned over the {world} ranks")
            first = min(rank * size, numel)
            length = max(0, min(size, numel - first))
            views[name] = FlatPartition(
                param.ds_tensor.view(-1)[:length], [(model_entry(name), tuple(param.ds_shape))], first
            )
        return views

    def _buffers(self) -> dict[str, torch.Tensor]:
        """Persistent module buffers: ZeRO-3 keeps them whole on every rank."""
        module = self.engine.module
        transient = {
            f"{prefix}.{name}" if prefix else name
            for prefix, sub in module.named_modules()
            for name in getattr(sub, "_non_persistent_buffers_set", ())
        }
        return {name: buffer for name, buffer in module.named_buffers() if name not in transient}

    def _param_groups(self) -> list[dict[str, Any]]:
        """The base optimizer's hyperparameters per group, with the FQNs of its parameters (get_state_dict's form)."""
        groups = self.optimizer.optimizer.param_groups
        fqns: list[list[str]] = [[] for _ in groups]
        for slot in self.slots:
            fqns[self.optimizer.sub_group_to_group_id[slot.sub_group]].append(slot.fqn)
        return [
            {**{k: v for k, v in group.items() if k != "params" and _plain(v)}, "params": names}
            for group, names in zip(groups, fqns)
        ]

    def _engine_state(self) -> dict[str, Any]:
        scaler = getattr(self.optimizer, "loss_scaler", None)
        return {
            **{key: int(getattr(self.engine, key, 0)) for key in _COUNTERS},
            "dp_world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "loss_scaler": {k: v for k, v in vars(scaler).items() if isinstance(v, _SCALER_STATE)} if scaler else {},
            "dynamic_loss_scale": bool(getattr(self.optimizer, "dynamic_loss_scale", False)),
            "overflow": bool(getattr(self.optimizer, "overflow", False)),
        }

    # ------------------------------------------------------------------------------------------- load

    def load_state(self, *, optimizer: bool = True) -> dict[str, Any]:
        """Destinations for a load: the same names, views of the buffers to fill, plain values to replace.

        optimizer=False: the weights only (the optimizer keeps its state).
        """
        self.optimizer.checkpoint_event_prologue()  # every parameter partitioned: the partitions are the truth
        self._ensure_optimizer_state()
        state = self.state_dict()
        if not optimizer:
            del state["optim"]
        for entry in state.get("optim", {}).get("state", {}).values():
            if "step" in entry:
                entry["step"] = torch.zeros((), dtype=torch.float32)
        state[ENGINE_KEY] = None  # stays None when the checkpoint comes from another engine
        if SCHEDULER_KEY in state:
            state[SCHEDULER_KEY] = None
        return state

    def _ensure_optimizer_state(self) -> None:
        """Before the first step torch's Adam has no state; create it (zeros) so the moments have somewhere to go."""
        base = self.optimizer.optimizer
        if not isinstance(base, torch.optim.Adam | torch.optim.AdamW):
            if any(not base.state.get(flat) for flat in self.optimizer.fp32_partitioned_groups_flat):
                raise ShardckptUsageError(
                    f"{type(base).__name__} has no state before its first step; take one step before loading"
                )
            return
        for sub_group, flat in enumerate(self.optimizer.fp32_partitioned_groups_flat):
            state = base.state[flat]
            if state:
                continue
            group = base.param_groups[self.optimizer.sub_group_to_group_id[sub_group]]
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(flat)
            state["exp_avg_sq"] = torch.zeros_like(flat)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(flat)

    def finish_load(self, state: Mapping[str, Any]) -> None:
        """After shardckpt filled `state` (from load_state()): steps, hyperparameters, partitions, counters."""
        optimizer = self.optimizer
        if "optim" in state:  # not when loading the weights only
            self._restore_steps(state["optim"]["state"])
            self._restore_param_groups(state["optim"]["param_groups"])
        # As DeepSpeed's own load does: fp32 master -> module-dtype partitions -> the parameters' partitions.
        for sub_group, fp32 in enumerate(optimizer.fp32_partitioned_groups_flat):
            if fp32.numel() > 0:
                optimizer.fp16_partitioned_groups_flat[sub_group].data.copy_(fp32.data)
        for sub_group, flat in enumerate(optimizer.fp16_partitioned_groups_flat):
            partitions = optimizer.fp16_partitioned_groups[sub_group]
            for partition, value in zip(partitions, optimizer.unflatten(flat, partitions)):
                partition.data = value.data
        persistent = getattr(optimizer, "persistent_parameters", [])
        if persistent:
            persistent[0].partition(persistent)
        optimizer.checkpoint_event_epilogue()  # re-gathers the persistent parameters from their new partitions
        self._restore_engine(state.get(ENGINE_KEY), state.get(SCHEDULER_KEY))

    def _restore_steps(self, optim_state: Mapping[str, Any]) -> None:
        steps: dict[int, set[float]] = {}
        for slot in self.slots:
            step = optim_state.get(slot.fqn, {}).get("step")
            if step is not None:
                steps.setdefault(slot.sub_group, set()).add(float(step))
        for sub_group, values in steps.items():
            if len(values) != 1:
                raise ShardckptUsageError(
                    f"the parameters of ZeRO-3 sub-group {sub_group} were saved at different optimizer steps "
                    f"{sorted(values)}; DeepSpeed keeps one step per sub-group"
                )
            state = self.optimizer.optimizer.state[self.optimizer.fp32_partitioned_groups_flat[sub_group]]
            value = values.pop()
            old = state.get("step")
            state["step"] = torch.tensor(value, dtype=old.dtype) if torch.is_tensor(old) else type(old or 0)(value)

    def _restore_param_groups(self, saved: Any) -> None:
        """Hyperparameters by FQN: each live group takes those of the saved group holding its first parameter."""
        if not isinstance(saved, list):
            return
        owner = {fqn: group for group in saved if isinstance(group, dict) for fqn in group.get("params", ())}
        groups = self.optimizer.optimizer.param_groups
        for group_id, group in enumerate(groups):
            first = next(
                (s.fqn for s in self.slots if self.optimizer.sub_group_to_group_id[s.sub_group] == group_id), None
            )
            source = owner.get(first) if first is not None else None
            if source is None:
                continue
            for key, value in source.items():
                if key != "params":
                    group[key] = (
                        tuple(value) if isinstance(group.get(key), tuple) and isinstance(value, list) else value
                    )

    def _restore_engine(self, engine_state: Any, scheduler_state: Any) -> None:
        if isinstance(engine_state, dict):
            for key in _COUNTERS:
                if isinstance(engine_state.get(key), int):
                    setattr(self.engine, key, engine_state[key])
            scaler = getattr(self.optimizer, "loss_scaler", None)
            for key, value in (engine_state.get("loss_scaler") or {}).items():
                if scaler is not None and key in vars(scaler) and isinstance(value, _SCALER_STATE):
                    setattr(scaler, key, value)
            for key in ("dynamic_loss_scale", "overflow"):
                if isinstance(engine_state.get(key), bool):
                    setattr(self.optimizer, key, engine_state[key])
        scheduler = getattr(self.engine, "lr_scheduler", None)
        if scheduler is not None and isinstance(scheduler_state, dict):
            scheduler.load_state_dict(scheduler_state)
