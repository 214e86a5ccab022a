"""Recognising a torch optimizer's own state_dict() (state keyed by parameter position) inside a state dict.

Such state moves only between identical parameter orders and shardings; shardckpt, like DCP, wants state keyed by
parameter FQN (torch.distributed.checkpoint.state_dict.get_state_dict), and this names the entries that are not.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

FQN_HINT = (
    "use torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer), which keys optimizer state by "
    "parameter FQN (the same on any world size), and set_state_dict(model, optimizer, ...) after the load"
)


def positional_optimizer_states(state: Any, prefix: str = "") -> list[str]:
    """Names of the entries of `state` that look like torch.optim.Optimizer.state_dict(): a mapping with "state"
    and "param_groups" whose groups list parameters by integer position."""
    found: list[str] = []
    if isinstance(state, Mapping):
        if _is_positional(state):
            return [prefix or "the state dict"]
        for key, value in state.items():
            found.extend(positional_optimizer_states(value, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(state, (list, tuple)):
        for index, value in enumerate(state):
            found.extend(positional_optimizer_states(value, f"{prefix}.{index}" if prefix else str(index)))
    return found


def _is_positional(state: Mapping[Any, Any]) -> bool:
    groups, per_param = state.get("param_groups"), state.get("state")
    if not isinstance(groups, list) or not isinstance(per_param, Mapping):
        return False
    params = [p for group in groups if isinstance(group, Mapping) for p in group.get("params", ())]
    positional = [p for p in params if isinstance(p, int) and not isinstance(p, bool)]
    return bool(positional) or any(isinstance(key, int) for key in per_param)


def optimizer_hint(state: Any) -> str:
    """A sentence for a load that found entries missing, when positional optimizer state explains it ('' if not)."""
    names = positional_optimizer_states(state)
    if not names:
        return ""
    return (
        f"; {', '.join(repr(n) for n in names[:3])} looks like optimizer.state_dict(), which keys state by parameter "
        f"position, not by name: {FQN_HINT}"
    )
