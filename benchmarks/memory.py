"""Peak resident memory of one operation inside a running process (Linux), for the benchmarks' RSS rows.

The peak (VmHWM) is reset through /proc/self/clear_refs before the operation, so earlier rows do not count.
"""

from __future__ import annotations

from collections.abc import Callable


def _status(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no {field} in /proc/self/status")


def reset_peak() -> bool:
    """Make the current RSS the peak; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5\n")
        return True
    except OSError:
        return False


def peak_above(run: Callable[[], object]) -> int | None:
    """Bytes by which the process's peak RSS during `run()` exceeds its RSS just before (None if unknown)."""
    try:
        if not reset_peak():
            return None
        before = _status("VmRSS")
        run()
        return _status("VmHWM") - before
    except OSError:
        return None
