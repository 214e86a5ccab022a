"""Run a command on a real pseudo-terminal of a given width, as a person at a terminal runs it.

For the CLI's terminal layout (tables that fit, progress bars); the output comes back without colour codes.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import termios
import time
from collections.abc import Sequence

_COLOUR = re.compile(r"\x1b\[[0-9;]*m")  # select graphic rendition only: any other escape stays visible


def run_in_terminal(argv: Sequence[str], columns: int, env: dict[str, str], timeout: float = 120) -> tuple[int, str]:
    """(exit code, what the terminal received) of `argv` with stdout and stderr on a pty `columns` wide; colour codes
    are removed, every other escape sequence is kept (a test can look for them)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {key: value for key, value in env.items() if key not in ("COLUMNS", "LINES")}
    process = subprocess.Popen(list(argv), stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if process.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 1 << 16)
            except OSError:  # EIO: the command closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if process.poll() is None:
            process.kill()
        os.close(master)
    text = b"".join(chunks).decode("utf-8", "replace").replace("\r\n", "\n")
    return code, _COLOUR.sub("", text)
