"""What the commands print, through the real `shardckpt` entry point, piped and on a real terminal (a pty) at 80 and
60 columns: names shown whole and distinct, untrusted names never markup and never terminal escapes (issues 23, 26).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import shardckpt
from shardckpt.cli.common import EXIT_FAILED, EXIT_OK, human_bytes
from tests.helpers.terminal import run_in_terminal

ENTRY_POINT = str(Path(sys.executable).with_name("shardckpt"))
WIDTHS = (80, 60)
TENSORS = [f"optim.state.blocks.{b}.attn.qkv.weight.exp_avg_sq" for b in range(12)] + [
    f"model.blocks.{b}.attn.qkv.weight" for b in range(3)
]
OBJECT = "optim.param_groups.0.schedule.warmup_cosine_with_restarts"
RUNS = ["experiment-alpha-lr3e-4-seed1-step-00000100", "experiment-alpha-lr3e-4-seed2-step-00000100"]


def piped(*args: str, columns: int = 80) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": str(columns)}
    return subprocess.run([ENTRY_POINT, *args], capture_output=True, text=True, timeout=120, env=env)


def on_terminal(*args: str, columns: int) -> tuple[int, str]:
    return run_in_terminal([ENTRY_POINT, *args], columns, dict(os.environ))


def plain_names(output: str, header: str) -> list[str]:
    """The first column of a piped table: one record a line under its header line, up to a blank or other line."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header + "  "))
    names = []
    for line in lines[start + 1 :]:
        if "  " not in line:
            break
        names.append(line.split("  ")[0])
    return names


def terminal_names(output: str, header: str, columns: int) -> list[str]:
    """The names column of a terminal table, each name put back together from the lines it folded onto."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header + " "))
    assert set(lines[start + 1].strip()) == {"─"}, output
    end = next(i for i in range(start + 2, len(lines)) if not lines[i].strip())  # a terminal table ends blank
    table = [lines[start], *lines[start + 2 : end]]
    # The names column ends where every line has the 3-cell gap before the next column (names hold no 3 spaces).
    width = next(w for w in range(len(header), columns) if all(not line[w : w + 3].strip() for line in table))
    names: list[str] = []
    piece = ""
    for line in lines[start + 2 :]:
        assert len(line) <= columns, output
        if not line.strip():
            break  # a terminal table ends with a blank line
        first, others = line[:width].rstrip(), line[width:].strip()
        if others or not names:
            names.append(first)
        else:  # the name goes on: folded (the line was full) or wrapped at a space (which the wrap took)
            names[-1] += first if len(piece) == width else " " + first
        piece = first
    return names


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root of two long-named checkpoints (and a `latest` link) that differ in one tensor, with long names."""
    root = tmp_path_factory.mktemp("tables") / "root"
    state: dict[str, object] = {name: torch.ones(64, 256) for name in TENSORS}
    state[OBJECT] = {"lr": 3e-4, "warmup": 2000}
    shardckpt.save(state, str(root / RUNS[0]), step=100)
    state[TENSORS[5]] = torch.zeros(64, 256)
    state[TENSORS[7]] = torch.zeros(64, 256)
    shardckpt.save(state, str(root / RUNS[1]), step=101)
    os.symlink(RUNS[1], root / "latest")
    return root


@pytest.mark.parametrize("columns", WIDTHS)
def test_every_table_shows_each_name_whole_piped_and_on_a_terminal(saved: Path, columns: int) -> None:
    """Issue 26.5: inspect, ls, diff and du, at 80 and 60 columns: every name whole and distinct, every header and
    number whole; a pipe gets one record per line, a terminal a table no wider than the console."""
    a, b = str(saved / RUNS[0]), str(saved / RUNS[1])
    cases = [
        (("inspect", a), "tensor", sorted(TENSORS)),
        (("inspect", a), "object", [OBJECT]),
        (("ls", str(saved)), "checkpoint", [RUNS[0], f"latest -> {RUNS[1]}", RUNS[1]]),
        (("diff", a, b), "tensor", sorted([TENSORS[5], TENSORS[7]])),
        (("du", str(saved)), "checkpoint", [*RUNS, "total"]),
    ]
    for argv, header, names in cases:
        result = piped(*argv, columns=columns)
        assert result.returncode in (EXIT_OK, EXIT_FAILED), result.stderr
        assert sorted(plain_names(result.stdout, header)) == sorted(names), result.stdout
        assert "─" not in result.stdout and "\x1b" not in result.stdout  # plain text: no box, no colour
        code, shown = on_terminal(*argv, columns=columns)
        assert code == result.returncode, shown
        assert sorted(terminal_names(shown, header, columns)) == sorted(names), shown
    shape = "[64, 256]"
    for output in (piped("inspect", a, columns=columns).stdout, on_terminal("inspect", a, columns=columns)[1]):
        assert shape in output and "dty " not in output
    du = piped("du", "--json", str(saved))
    total = human_bytes(json.loads(du.stdout)["total"]["total_bytes"])
    for output in (piped("du", str(saved), columns=columns).stdout, on_terminal("du", str(saved), columns=columns)[1]):
        assert any(line.startswith("total ") and line.rstrip().endswith(total) for line in output.splitlines()), output


def _hostile(tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "root"
    url = root / "step-\x1b[2J-[red]1"
    state = {
        "model.[/attn].w": torch.ones(4),
        "x\x1b]0;pwned\x07y": torch.ones(3),
        "c\x9b2Jz": torch.ones(2),
        "bidi\u202eflip": torch.ones(1),
        "obj[/x]": 3,
        "o\x1b[2J": "v:smile:",
    }
    shardckpt.save(state, str(url), step=1)
    shardckpt.save({"w": torch.ones(1)}, str(root / "step-2"), step=2)  # so that gc has the other to prune
    return root, url


ESCAPED = ["x\\x1b]0;pwned\\x07y", "c\\x9b2Jz", "bidi\\u202eflip", "model.[/attn].w", "o\\x1b[2J"]
ESCAPED.append("step-\\x1b[2J-[red]1")


def test_names_are_never_markup_nor_terminal_escapes(tmp_path: Path) -> None:
    """Issues 23.7 and 23.8: names holding a rich closing tag, ESC / 8-bit CSI / BEL sequences or a bidi override print
    literally, escaped as --json escapes them, piped and on a terminal; verify still reports the damage it found."""
    root, url = _hostile(tmp_path)
    for argv in (("inspect", str(url)), ("ls", str(root)), ("du", str(root)), ("inspect", str(url), "--tree")):
        for columns in WIDTHS:
            result = piped(*argv, columns=columns)
            code, shown = on_terminal(*argv, columns=columns)
            for output in (result.stdout + result.stderr, shown):
                assert result.returncode == code == EXIT_OK, output
                for raw in ("\x1b", "\x9b", "\x07", "\u202e"):
                    assert raw not in output, (argv, output)
            expected = [name for name in ESCAPED if argv[0] == "inspect" or name.startswith("step-")]
            expected = [name for name in expected if argv[-1] != "--tree" or "[/" not in name]
            for name in expected:
                assert name in result.stdout, (argv, name, result.stdout)
    inspected = piped("inspect", str(url)).stdout
    assert "obj[/x]" in inspected and "v:smile:" in inspected  # no markup, no emoji codes
    data = next((url / "data").iterdir())
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0xFF
    data.write_bytes(bytes(raw))
    for verified in (piped("verify", str(url)), piped("verify", str(url), "--json")):
        assert verified.returncode == EXIT_FAILED and "Traceback" not in verified.stderr, verified
        assert "MarkupError" not in verified.stderr and "\x1b" not in verified.stdout
    assert "BAD" in piped("verify", str(url)).stdout
    gc = piped("gc", str(root), "--keep-last", "1", "--dry-run")
    assert gc.returncode == EXIT_OK and "step-\\x1b[2J-[red]1" in gc.stdout + gc.stderr, gc


def test_import_dcp_prints_names_and_paths_holding_markup(tmp_path: Path) -> None:
    """Issue 23.7: import-dcp commits, then reports skipped entries and the target whatever their names hold."""
    source = tmp_path / "dcp"
    dcp.save({"w[/attn]": torch.ones(2), "when[/x]": datetime.date(2025, 1, 2)}, checkpoint_id=str(source))
    target = tmp_path / "out[/z]" / "step-1"
    result = piped("import-dcp", str(source), str(target), "--allow-skip")  # a date is not a plain value
    assert result.returncode == EXIT_OK and "Traceback" not in result.stderr, result.stderr
    assert "when[/x]" in result.stdout and "out[/z]" in result.stdout
    assert shardckpt.open(str(target)).tensors["w[/attn]"]


def test_a_committed_marker_quoting_markup_does_not_stop_gc(tmp_path: Path) -> None:
    """Issue 23.7: gc on a root where one COMMITTED is unreadable and its error quotes '[/x]'."""
    root = tmp_path / "root"
    for step in (1, 2, 3):
        shardckpt.save({"w": torch.ones(2)}, str(root / f"step-{step}"), step=step)
    marker = json.loads((root / "step-2" / "COMMITTED").read_text())
    (root / "step-2" / "COMMITTED").write_text(json.dumps({**marker, "attempt": "[/x]"}))  # its error quotes it
    for argv in (("gc", str(root), "--keep-last", "1"), ("ls", str(root)), ("du", str(root))):
        result = piped(*argv)
        assert result.returncode == EXIT_OK and "Traceback" not in result.stderr, (argv, result.stderr)
    kept = piped("gc", str(root), "--keep-last", "1", "--dry-run").stdout
    assert "step-2: kept" in kept and "[/x]" in kept, kept
