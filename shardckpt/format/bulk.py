"""Building or walking the objects of a manifest with 100,000+ tensors: the cycle collector paused meanwhile.

Manifests hold no reference cycles, but every container they create counts toward Python's collection thresholds,
and each full collection walks every object of the process (a training job's torch modules included).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Run the block with the cycle collector off; it is switched back on only if it was on before.

    Nesting is free. Two threads overlapping: the first to leave turns it back on while the other still runs,
    which costs that one speed, never correctness (objects are only collected later, not lost).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
