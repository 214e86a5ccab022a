"""The step of a save that names none: from the state dict's own counter, else from the checkpoint's name.

A checkpoint without a step sorts by commit time alone, so two saves of one root could come out in the wrong order.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

# The counters training code keeps at the top of its state (DCP and Lightning scripts, DeepSpeed's client state,
# Megatron), in the order they are tried.
STEP_KEYS = ("step", "global_step", "iteration")
# Names checkpoint directories are given by hand or by other tools: step-100, step_100, global_step100 (DeepSpeed),
# iter_0000100 (Megatron), checkpoint-100 (transformers' Trainer).
_NAMED = re.compile(r"(?:step|global_step|iter|iteration|checkpoint)[-_]?([0-9]{1,18})", re.IGNORECASE)


class NoStepWarning(UserWarning):
    """A save recorded no step (none given, none in the state or the name): latest(), retention and gc rank the
    checkpoint below every checkpoint of a known step in its root, however recent it is."""


def no_step_message(url: str) -> str:
    return (
        f"{url}: saved without a step (no step=, no top-level 'step', 'global_step' or 'iteration' in the state, no "
        "step-N in its name): latest(), retention and gc rank it below every checkpoint of its root that has a "
        "step, however recent it is; pass step="
    )


def inferred_step(state: Mapping[str, Any], url: str) -> int | None:
    """The step a save without step= records: a top-level 'step', 'global_step' or 'iteration' that is an int or
    a 0-d integer tensor (else such an entry of the one top-level dict that has one), else the number in the
    checkpoint's name (step-N, step_N, global_stepN, iter_N, checkpoint-N); None when there is none."""
    found = _counter(state)
    if found is None:
        # One level down, when exactly one entry holds a counter: {"trainer": {"step": ...}} (the bundled loop),
        # torchtitan's {"train_state": {"step": ...}}; two different ones are no answer.
        nested = {_counter(value) for value in state.values() if isinstance(value, Mapping)} - {None}
        found = nested.pop() if len(nested) == 1 else None
    return found if found is not None else step_in_name(url)


def _counter(state: Mapping[str, Any]) -> int | None:
    for key in STEP_KEYS:
        value = state.get(key)
        if (
            type(value) is torch.Tensor  # a DTensor or a subclass has no one local value to read
            and value.ndim == 0
            and not value.is_floating_point()
            and not value.is_complex()
            and value.dtype is not torch.bool
            and value.device.type != "meta"
        ):
            value = int(value.item())  # then as an int: a uint64 beyond int64 is no step either
        if isinstance(value, int) and not isinstance(value, bool):
            return value if -(1 << 63) <= value < 1 << 63 else None
    return None


def step_in_name(url: str) -> int | None:
    """The step a checkpoint's name spells (its last path segment), or None."""
    match = _NAMED.fullmatch(url.rstrip("/").rsplit("/", 1)[-1])
    return None if match is None else int(match.group(1))
