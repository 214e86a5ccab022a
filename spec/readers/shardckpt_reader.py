"""The reference library as a conformance reader (spec/conformance.py): `python shardckpt_reader.py [--verify] PATH`
prints one JSON answer: what the checkpoint holds, or the error class of SPEC 13 that refused it.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from typing import Any

ERRORS = ("FormatError", "CoverageError", "IntegrityError", "NotCommittedError", "NotFoundError", "StorageError")


def tagged(value: Any) -> Any:
    """A plain value as the tagged JSON of spec/vectors/README.md ($tuple, $bytes, $map, $float)."""
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$float": repr(value)}
    if isinstance(value, bytes):
        return {"$bytes": value.hex()}
    if isinstance(value, tuple):
        return {"$tuple": [tagged(item) for item in value]}
    if isinstance(value, list):
        return [tagged(item) for item in value]
    if isinstance(value, dict):
        if all(isinstance(key, str) and not key.startswith("$") for key in value):
            return {key: tagged(item) for key, item in value.items()}
        return {"$map": [[tagged(key), tagged(item)] for key, item in value.items()]}
    raise TypeError(f"no JSON form for {type(value).__name__}")


def error_class(exc: BaseException) -> str:
    """The SPEC 13 class an exception is (the library raises subclasses, e.g. NotFoundError of StorageError)."""
    return next((kind.__name__ for kind in type(exc).__mro__ if kind.__name__ in ERRORS), type(exc).__name__)


def read(path: str) -> dict[str, Any]:
    import torch

    import shardckpt
    from shardckpt.errors import ShardckptError
    from shardckpt.torch_bytes import TORCH_TO_FORMAT

    try:
        checkpoint = shardckpt.open(path)
        tensors = {}
        for name in checkpoint.tensors:
            tensor = checkpoint.read(name)
            flat = tensor.contiguous().reshape(-1)
            raw = b"" if flat.numel() == 0 else flat.view(torch.uint8).numpy().tobytes()
            tensors[name] = {
                "dtype": TORCH_TO_FORMAT[tensor.dtype],
                "shape": list(tensor.shape),
                "sha256": hashlib.sha256(raw).hexdigest(),
            }
        world_size = checkpoint.manifest.world_size
        return {
            "ok": True,
            "world_size": world_size,
            "step": checkpoint.step,
            "tensors": tensors,
            "objects": tagged(checkpoint.objects),
            "rank_objects": {str(rank): tagged(checkpoint.rank_objects(rank)) for rank in range(world_size)},
        }
    except ShardckptError as exc:
        return {"ok": False, "error": error_class(exc), "message": str(exc)}


def verify(path: str) -> dict[str, Any]:
    from shardckpt.ops.verify import verify as verify_checkpoint

    report = verify_checkpoint(path)
    return {"ok": report.ok, "problems": [str(problem) for problem in report.problems]}


def main(argv: list[str]) -> int:
    answer = verify(argv[-1]) if "--verify" in argv[:-1] else read(argv[-1])
    print(json.dumps(answer, allow_nan=False))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
