"""Dropping the page cache so that benchmark loads are cold.

Allowed for root on Linux; elsewhere the loads are measured warm and the report says so.
"""

from __future__ import annotations

import os


def drop_caches() -> bool:
    """Drop the page cache for cold reads when allowed (root on Linux); False when it is not."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("3\n")
        return True
    except OSError:
        return False
