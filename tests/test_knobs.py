"""knobs: every tunable default in one module, each overridable by SHARDCKPT_<NAME>; a bad override is a usage
error naming the variable, its value and what is valid, raised where the knob is read (not at import)."""

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


def _command(env: dict[str, str], *arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardckpt.cli", *arguments], capture_output=True, text=True, env=env, timeout=60
    )


def test_a_malformed_knob_fails_only_what_reads_it_with_a_typed_error(tmp_path) -> None:
    """Before, a malformed knob failed `import shardckpt.knobs` with a traceback, and so every CLI command, --help
    included (cli/gc read SHARDCKPT_GC_GRACE as its parser was built); now what reads it raises, saying what is
    valid."""
    import os

    bad = {"SHARDCKPT_BLOCK_SIZE": "abc", "SHARDCKPT_COMPRESSION_STORAGE_PACE": "sometimes", "SHARDCKPT_GC_GRACE": "?"}
    env = {**os.environ, **bad, "SHARDCKPT_WRITE_BEHIND_MIN": "-5", "SHARDCKPT_INSPECT_GROUP_MIN": "x"}
    for arguments in (["--help"], ["ls", str(tmp_path)]):
        shown = _command(env, *arguments)
        assert shown.returncode == 0 and "Traceback" not in shown.stderr, (arguments, shown.stderr)
    refused = _command(env, "gc", str(tmp_path), "--dry-run")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert "SHARDCKPT_GC_GRACE='?' is not valid: a number >= 0 (default 3600.0)" in refused.stderr
    result = _knob(env, "knobs.MAX_GAP")
    assert result.returncode == 0 and result.stdout.split() == ["32768"], result.stderr
    for name, valid in (("BLOCK_SIZE", "a whole number >= 0"), ("COMPRESSION_STORAGE_PACE", "0 or 1")):
        result = _knob(env, f"knobs.{name}")
        assert "ShardckptUsageError" in result.stderr, result.stderr
        assert f"SHARDCKPT_{name}={bad['SHARDCKPT_' + name]!r} is not valid: {valid}" in result.stderr
    result = _knob({**os.environ, "SHARDCKPT_SHARE_MEMORY": "2"}, "knobs.SHARE_MEMORY")  # a flag: 0 or 1 only
    assert "SHARDCKPT_SHARE_MEMORY='2' is not valid: 0 or 1" in result.stderr, result.stderr


def test_the_defaults_users_see_come_from_knobs() -> None:
    import inspect

    import shardckpt
    from shardckpt import knobs
    from shardckpt.cli.main import build_parser
    from shardckpt.ops import gc

    assert inspect.signature(shardckpt.save).parameters["block_size"].default is None  # knobs.BLOCK_SIZE, at the save
    assert inspect.signature(shardckpt.load).parameters["max_gap"].default is None  # knobs.MAX_GAP, at the load
    assert gc.DEFAULT_GRACE == knobs.GC_GRACE
    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    assert f"(default {knobs.GC_GRACE:g})" in " ".join(commands["gc"].format_help().split())


def test_a_knob_the_parameter_it_defaults_would_refuse_is_refused_naming_the_variable() -> None:
    """Before, SHARDCKPT_MAX_REQUEST=0 and SHARDCKPT_FULL_EVERY=0 passed the knob check and were then refused as
    `max_request` and `full_every`, parameters the user never passed; SHARDCKPT_MAX_REQUEST=1 made reads crawl."""
    import os

    for name, value, valid in (
        ("MAX_REQUEST", "0", "a whole number >= 4096"),
        ("MAX_REQUEST", "1", "a whole number >= 4096"),
        ("RESIDENT_MAX_REQUEST", "64", "a whole number >= 4096"),
        ("FULL_EVERY", "0", "a whole number >= 1"),
        ("MAX_IN_FLIGHT", "0", "a whole number >= 1"),
        ("COMPRESSION_LEVEL", "23", "a whole number in -131072..22"),
    ):
        result = _knob({**os.environ, f"SHARDCKPT_{name}": value}, f"knobs.{name}")
        assert "ShardckptUsageError" in result.stderr, (name, result.stderr)
        assert f"SHARDCKPT_{name}={value!r} is not valid: {valid}" in result.stderr, result.stderr


def test_negative_compression_levels_are_valid_knob_values() -> None:
    """zstd's negative levels (its fastest) were refused as "a whole number >= 0" though the parameter takes them."""
    import os

    env = {**os.environ, "SHARDCKPT_COMPRESSION_LEVEL": "-5", "SHARDCKPT_MAX_REQUEST": "4096"}
    result = _knob(env, "knobs.COMPRESSION_LEVEL, knobs.MAX_REQUEST")
    assert result.returncode == 0 and result.stdout.split() == ["-5", "4096"], result.stderr


def test_an_uncompressed_save_ignores_a_bad_compression_level(tmp_path, monkeypatch) -> None:
    """As it ignores SHARDCKPT_COMPRESSION_THREADS and _STORAGE_PACE; a compressed save still names the variable."""
    import pytest
    import torch

    import shardckpt
    from shardckpt import knobs

    why = "SHARDCKPT_COMPRESSION_LEVEL='abc' is not valid"
    monkeypatch.delattr(knobs, "COMPRESSION_LEVEL")  # as knobs leaves a refused override (see its end)
    monkeypatch.setitem(knobs._REFUSED, "COMPRESSION_LEVEL", why)
    shardckpt.save({"w": torch.ones(3)}, str(tmp_path / "raw"), step=1)
    with pytest.raises(shardckpt.ShardckptUsageError, match=why):
        shardckpt.save({"w": torch.ones(3)}, str(tmp_path / "zstd"), step=1, compression="zstd")


def test_a_malformed_crash_point_is_refused_not_ignored(monkeypatch) -> None:
    """SHARDCKPT_CRASH_AT (the fault-injection tests' kill switch) misspelt never fired: a test expecting a crash
    would pass without one."""
    import pytest

    from shardckpt.crashpoints import crash_point
    from shardckpt.errors import ShardckptUsageError

    for value in ("abc", "before_commit:x", "before_commit@0", "before_commit@", "before_comit:1@2"):
        monkeypatch.setenv("SHARDCKPT_CRASH_AT", value)
        with pytest.raises(ShardckptUsageError, match=f"SHARDCKPT_CRASH_AT={value!r} is not valid"):
            crash_point("writing_data", 0)
    for value in ("before_commit", "before_commit:1@2", "writing_data:1", "during_gc@8"):  # armed elsewhere: no kill
        monkeypatch.setenv("SHARDCKPT_CRASH_AT", value)
        crash_point("writing_data", 0)


def test_a_block_size_override_that_is_no_power_of_two_names_the_variable() -> None:
    import os

    code = "import torch, shardckpt; shardckpt.ShardWriter('memory://bs/c', rank=0, world_size=1)"
    env = {**os.environ, "SHARDCKPT_BLOCK_SIZE": "1000"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert "block_size (or SHARDCKPT_BLOCK_SIZE) must be a power of two in 4096..67108864, got 1000" in result.stderr


def test_a_bad_block_size_override_fails_a_save_naming_it_and_never_a_load(tmp_path) -> None:
    """Before, SHARDCKPT_BLOCK_SIZE=abc failed `shardckpt.load` as well: protocol.py and the writers read it for a
    default argument at import, and a load never uses it. Now a save reads it, and refuses it naming the variable."""
    import os

    import torch

    import shardckpt

    url = str(tmp_path / "step-1")
    shardckpt.save({"w": torch.ones(3)}, url)
    code = (
        "import torch, shardckpt\n"
        f"state = {{'w': torch.zeros(3)}}; shardckpt.load(state, {url!r}); print(state['w'].tolist(), flush=True)\n"
        f"shardckpt.save(state, {url + '-again'!r})\n"
    )
    env = {**os.environ, "SHARDCKPT_BLOCK_SIZE": "abc"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert result.stdout.splitlines() == ["[1.0, 1.0, 1.0]"], result.stderr
    assert "ShardckptUsageError: SHARDCKPT_BLOCK_SIZE='abc' is not valid: a whole number >= 0" in result.stderr
    assert not (tmp_path / "step-1-again").exists()


def test_every_saving_entry_point_reads_the_block_size_knob_when_it_saves(tmp_path, monkeypatch) -> None:
    """save, ShardWriter, the DCP StorageWriter, the Checkpointer and its local tier took the knob's value as their
    default when imported; they read it at the save now (the same value, unless the knob changed since)."""
    import glob

    import torch
    import torch.distributed.checkpoint as dcp

    import shardckpt
    import shardckpt.dcp
    from shardckpt import knobs

    monkeypatch.setattr(knobs, "BLOCK_SIZE", 8192)  # as SHARDCKPT_BLOCK_SIZE=8192 would, but after the import
    state = {"w": torch.ones(3)}
    sizes = {"save": shardckpt.save(state, str(tmp_path / "save"), step=1).block_size}
    writer = shardckpt.ShardWriter(str(tmp_path / "writer"), rank=0, world_size=1)
    writer.add("w", state["w"])
    writer.close()
    sizes["ShardWriter"] = shardckpt.commit(str(tmp_path / "writer"), world_size=1).block_size
    dcp.save(state, storage_writer=shardckpt.dcp.StorageWriter(str(tmp_path / "dcp"), step=1))
    manager = shardckpt.Checkpointer(
        str(tmp_path / "root"),
        every_steps=2,
        local_root=str(tmp_path / "local"),
        local_every_steps=1,
        preemption_signals=(),
    )
    manager.maybe_save(1, state)  # a local save
    manager.maybe_save(2, state)  # a persistent one
    manager.close()
    opened = {"dcp": str(tmp_path / "dcp"), "Checkpointer": shardckpt.latest(str(tmp_path / "root"))}
    opened["local tier"] = glob.glob(str(tmp_path / "local" / "*"))[0]
    sizes.update({what: shardckpt.open(url).manifest.block_size for what, url in opened.items()})
    assert sizes == dict.fromkeys(["save", "ShardWriter", "dcp", "Checkpointer", "local tier"], 8192)


def test_a_misspelt_crash_point_is_refused_before_any_work(tmp_path, monkeypatch) -> None:
    """Before, SHARDCKPT_CRASH_AT=before_comit was refused at the first crash point reached: after a save had
    created its files, after retention had deleted a COMMITTED marker, after gc had deleted one object of each
    of its actions."""
    import pytest
    import torch

    import shardckpt
    from shardckpt.catalog.retention import prune
    from shardckpt.ops.gc import gc
    from shardckpt.storage import open_storage

    for step in (1, 2):
        shardckpt.save({"w": torch.ones(3)}, str(tmp_path / f"step-{step}"))
    monkeypatch.setenv("SHARDCKPT_CRASH_AT", "before_comit")
    why = "SHARDCKPT_CRASH_AT='before_comit' is not valid"
    with pytest.raises(shardckpt.ShardckptUsageError, match=why):
        shardckpt.save({"w": torch.ones(3)}, str(tmp_path / "step-3"))
    with pytest.raises(shardckpt.ShardckptUsageError, match=why):
        prune(open_storage(str(tmp_path)), 1)
    with pytest.raises(shardckpt.ShardckptUsageError, match=why):
        gc(str(tmp_path), keep_last=1, grace=0)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step-1", "step-2"]
    assert (tmp_path / "step-1" / "COMMITTED").exists() and len(list((tmp_path / "step-1").rglob("*"))) > 2


def test_shared_read_knobs_below_what_the_read_uses_are_refused_naming_the_variable() -> None:
    """Before, SHARDCKPT_SHARE_ROUND=0 made a shared read cut rounds of one byte (a collective per segment), and
    SHARDCKPT_SHARE_DEPTH=0 or 1 and SHARDCKPT_SHARE_CHECKERS=0 were replaced by 2 and 1 without a word."""
    import os

    for name, value, valid in (
        ("SHARE_ROUND", "0", "a whole number >= 4096"),
        ("SHARE_ROUND", "4095", "a whole number >= 4096"),
        ("SHARE_DEPTH", "1", "a whole number >= 2"),
        ("SHARE_CHECKERS", "0", "a whole number >= 1"),
    ):
        result = _knob({**os.environ, f"SHARDCKPT_{name}": value}, f"knobs.{name}")
        assert f"ShardckptUsageError: SHARDCKPT_{name}={value!r} is not valid: {valid}" in result.stderr, result.stderr
    env = {**os.environ, "SHARDCKPT_SHARE_ROUND": "4096", "SHARDCKPT_SHARE_DEPTH": "2", "SHARDCKPT_SHARE_CHECKERS": "1"}
    result = _knob(env, "knobs.SHARE_ROUND, knobs.SHARE_DEPTH, knobs.SHARE_CHECKERS")
    assert result.returncode == 0 and result.stdout.split() == ["4096", "2", "1"], result.stderr


def test_a_malformed_read_knob_fails_loads_not_saves(tmp_path) -> None:
    """Before, the read knobs were default arguments of the load (and the Checkpointer's cadence knobs of its
    constructor), read when shardckpt's protocol module was imported: a malformed one failed saves as well."""
    import os

    bad = {"SHARDCKPT_MAX_GAP": "abc", "SHARDCKPT_MAX_IN_FLIGHT": "0", "SHARDCKPT_PREFETCH_AHEAD": "x"}
    bad.update({"SHARDCKPT_FULL_EVERY": "?", "SHARDCKPT_CADENCE_MTBF_PRIOR": "soon"})
    code = (
        "import torch, shardckpt; from shardckpt import knobs; state = {'w': torch.arange(4.0)}\n"
        f"shardckpt.save(state, {str(tmp_path / 'ckpt')!r}, step=1)\n"
        f"shardckpt.Checkpointer({str(tmp_path / 'root')!r}, full_every=3, mtbf_prior_seconds=60.0)\n"
        "print('saved')\n"
        f"shardckpt.load(state, {str(tmp_path / 'ckpt')!r})\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **bad}, timeout=120
    )
    assert done.stdout.split() == ["saved"], done.stderr
    assert "ShardckptUsageError: SHARDCKPT_MAX_IN_FLIGHT='0' is not valid" in done.stderr, done.stderr[-2000:]
