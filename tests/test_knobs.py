"""knobs: every tunable default in one module, each overridable by SHARDCKPT_<NAME>; a bad override is a usage
error naming the variable, raised when the package is imported."""

from __future__ import annotations

import subprocess
import sys


def _knob(env: dict[str, str], expression: str) -> subprocess.CompletedProcess[str]:
    code = f"from shardckpt import knobs; print({expression})"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)


def test_an_environment_override_reaches_the_default_it_names() -> None:
    import os

    env = {**os.environ, "SHARDCKPT_MAX_GAP": "4096", "SHARDCKPT_GC_GRACE": "60.5"}
    result = _knob(env, "knobs.MAX_GAP, knobs.GC_GRACE, knobs.BLOCK_SIZE")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["4096", "60.5", "65536"]


def test_a_malformed_override_is_a_usage_error_naming_the_variable() -> None:
    import os

    for value in ("lots", "-1"):
        result = _knob({**os.environ, "SHARDCKPT_MAX_REQUEST": value}, "knobs.MAX_REQUEST")
        assert result.returncode != 0
        assert "ShardckptUsageError" in result.stderr and "SHARDCKPT_MAX_REQUEST" in result.stderr, result.stderr


def test_the_defaults_users_see_come_from_knobs() -> None:
    import inspect

    import shardckpt
    from shardckpt import knobs
    from shardckpt.cli import gc as gc_command
    from shardckpt.ops import gc

    assert inspect.signature(shardckpt.save).parameters["block_size"].default == knobs.BLOCK_SIZE
    assert inspect.signature(shardckpt.load).parameters["max_gap"].default == knobs.MAX_GAP
    assert gc.DEFAULT_GRACE == gc_command.DEFAULT_GRACE == knobs.GC_GRACE
