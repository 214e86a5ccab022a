"""The entry names of a training state as torch's get_state_dict gives them: model.<fqn>, optim.state.<fqn>.<key>.

The DeepSpeed adapter and the DeepSpeed importer write these names, so their checkpoints load in the FSDP2 loop.
"""

from __future__ import annotations


def model_entry(fqn: str) -> str:
    """The entry of parameter or buffer `fqn` of the model."""
    return f"model.{fqn}"


def optimizer_entry(fqn: str, key: str) -> str:
    """The entry of optimizer state `key` (exp_avg, exp_avg_sq, step) of parameter `fqn`."""
    return f"optim.state.{fqn}.{key}"
