"""One rank launched like torchrun launches it (RANK, WORLD_SIZE set) that never calls init_process_group.

`python no_group_worker.py SCENARIO ARGS_JSON`: SCENARIO save, load or checkpointer; the verdict (the error raised,
or none) goes to RESULT_DIR/rank-<r>.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch

import shardckpt


def main() -> None:
    scenario, args = sys.argv[1], json.loads(sys.argv[2])
    rank = int(os.environ["RANK"])
    state = {"weight": torch.arange(6.0).reshape(2, 3), "step": 1}
    try:
        if scenario == "save":
            shardckpt.save(state, args["url"], step=1)
        elif scenario == "load":
            shardckpt.load(state, args["url"])
        else:
            shardckpt.Checkpointer(args["url"])
        result = {"ok": True, "raised": None}
    except Exception as exc:
        result = {"ok": True, "raised": type(exc).__name__, "message": str(exc)}
    with open(os.path.join(args["result_dir"], f"rank-{rank}.json"), "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
