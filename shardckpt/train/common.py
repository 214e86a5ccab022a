"""What both training loops share: options, process-group start-up, AdamW settings, the schedule, RNG state.

The FSDP2 loop (fsdp2.py) and the DeepSpeed loop (deepspeed_loop.py) take these from here, so their checkpoints
interchange; loop.py chooses between them.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from shardckpt import knobs
from shardckpt.format.codec import CODECS
from shardckpt.write.encode_ahead import PACES


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="shardckpt train",
        description="Train a small GPT with FSDP2 (ZeRO-3) on every rank, checkpointing with shardckpt. "
        "Launch with torchrun --nproc-per-node N -m shardckpt.train ...; resumes on any number of ranks.",
    )
    parser.add_argument("--ckpt", required=True, help="root URL under which checkpoints step-XXXXXXXX are written")
    parser.add_argument("--steps", type=int, default=60, help="train until this step")
    parser.add_argument(
        "--ckpt-every",
        type=_every,
        default=10,
        metavar="N|auto",
        help="checkpoint every N steps (and at the end); auto: every sqrt(2 x cost x MTBF) seconds in steps, from the "
        "measured save cost and the failures recorded under --ckpt (logged each time it changes)",
    )
    cadence = parser.add_argument_group("--ckpt-every auto")
    cadence.add_argument(
        "--ckpt-every-default",
        type=int,
        default=10,
        metavar="N",
        help="interval until a failure is recorded and a save measured (default 10)",
    )
    cadence.add_argument("--ckpt-every-min", type=int, default=1, metavar="N", help="at least N steps apart")
    cadence.add_argument("--ckpt-every-max", type=int, metavar="N", help="at most N steps apart")
    cadence.add_argument("--ckpt-every-min-seconds", type=float, default=0.0, metavar="S", help="at least S s apart")
    cadence.add_argument("--ckpt-every-max-seconds", type=float, metavar="S", help="at most S s apart")
    cadence.add_argument(
        "--ckpt-mtbf-prior",
        type=float,
        default=knobs.CADENCE_MTBF_PRIOR,
        metavar="S",
        help="counts as one more failure per S seconds while failures are few (0: none; default %(default)g)",
    )
    parser.add_argument("--keep-last", type=int, default=3, help="committed checkpoints to keep")
    parser.add_argument("--resume", action="store_true", help="continue from the newest committed checkpoint")
    parser.add_argument(
        "--ignore-existing",
        action="store_true",
        help="start at step 0 even though --ckpt already holds committed checkpoints, naming this run's "
        "step-XXXXXXXX-<run id> so that they never meet the names other runs took (without it, and without "
        "--resume, such a root is refused: its higher steps would stay the newest, and a later --resume would "
        "continue the old run)",
    )
    parser.add_argument("--async-save", action="store_true", help="stage to host memory, write in the background")
    parser.add_argument(
        "--compression",
        choices=CODECS,
        help="store every checkpoint block losslessly compressed (format 1.2; level: SHARDCKPT_COMPRESSION_LEVEL)",
    )
    parser.add_argument(
        "--compression-pace",
        choices=PACES,
        help="with --compression: codec (default) compresses every block; storage never lets a save wait for the "
        "codec (a block not compressed when the writer reaches it is stored raw)",
    )
    parser.add_argument(
        "--freeze-base",
        action="store_true",
        help="FSDP2 engine: train only the last block, the final norm and the head (embeddings and the other blocks "
        "frozen), so most of the checkpointed state never changes",
    )
    parser.add_argument(
        "--incremental",
        action="store_true",
        help="incremental checkpoints: pieces unchanged since the newest checkpoint are stored by reference to it "
        "(the log shows bytes written against bytes saved)",
    )
    parser.add_argument(
        "--full-every",
        type=int,
        default=knobs.FULL_EVERY,
        metavar="N",
        help="with --incremental: every N-th checkpoint is a full one (default %(default)d)",
    )
    tier = parser.add_argument_group("node-local tier (docs/guide/local-tier.md)")
    tier.add_argument(
        "--local-root",
        metavar="DIR",
        help="also checkpoint into DIR on every node (tmpfs or local NVMe) between persistent saves; a resume takes "
        "the newest step the surviving nodes hold when it is newer than --ckpt's",
    )
    tier.add_argument("--local-every", type=int, default=10, metavar="N", help="a local checkpoint every N steps")
    tier.add_argument("--local-keep", type=int, default=2, metavar="K", help="local checkpoints kept per node")
    tier.add_argument("--peers", type=int, default=1, help="other nodes keeping a copy of each rank's local files")
    parser.add_argument("--global-batch", type=int, default=12, help="samples per step over all ranks")
    parser.add_argument("--lr", type=float, default=1e-2, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=5, help="linear warmup steps")
    parser.add_argument(
        "--schedule-steps",
        type=int,
        help="length of the warmup + cosine schedule (default: --steps of a fresh run; a resume keeps the "
        "checkpoint's, so a larger --steps trains on at the final lr; pass this to stretch the decay instead)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--loss-log", help="append one JSON line per step (rank 0) to this file")
    parser.add_argument("--pid-dir", help="write each rank's process id to PID_DIR/rank-<r>.pid")
    parser.add_argument("--cpu", action="store_true", help="use gloo on the CPU even when CUDA is available")
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="DeepSpeed engine only: bf16 weights and activations over fp32 master weights (which are checkpointed)",
    )
    parser.add_argument(
        "--engine",
        choices=("fsdp2", "deepspeed"),
        default="fsdp2",
        help="ZeRO-3 engine: torch FSDP2 (default) or DeepSpeed (pip install shardckpt[deepspeed]); checkpoints "
        "of one resume in the other",
    )
    parser.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    if args.compression_pace is not None and args.compression is None:
        parser.error("--compression-pace applies only with --compression zstd")  # as save(compression_pace=) says
    return args


def _every(text: str) -> int | str:
    """--ckpt-every: a positive number of steps, or auto."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of steps or 'auto', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number of steps >= 1 or 'auto', got {value}")
    return value


def freeze_base(model: Any) -> None:
    """--freeze-base: only the last block, the final norm and the head of a GPT keep training."""
    frozen = set(frozen_by_freeze_base(model))
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name not in frozen)


def frozen_by_freeze_base(model: Any) -> list[str]:
    """The names of the parameters --freeze-base freezes (the same names once FSDP2 shards the model)."""
    kept = [model.blocks[-1], model.ln_f, model.head]
    trainable = {id(parameter) for module in kept for parameter in module.parameters()}
    return [name for name, parameter in model.named_parameters() if id(parameter) not in trainable]


# AdamW's settings, shared with the DeepSpeed variant of the loop so that their checkpoints interchange.
ADAMW_BETAS = (0.9, 0.95)
ADAMW_WEIGHT_DECAY = 0.01


class WarmupCosine:
    """The learning-rate factor: linear warmup, then cosine decay to `floor` at step `total`, `floor` after it.

    A callable object, not a closure: LambdaLR's state_dict saves its fields with the checkpoint, so a resume with a
    larger --steps keeps the schedule's length instead of silently stretching the decay (Trainer.keep_schedule).
    """

    def __init__(self, warmup: int, total: int, floor: float = 0.1) -> None:
        self.warmup, self.total, self.floor = warmup, total, floor

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * progress))


def schedule_steps(args: argparse.Namespace) -> int:
    """The schedule's length for a fresh run: --schedule-steps, else --steps."""
    return int(args.schedule_steps) if args.schedule_steps is not None else int(args.steps)


def init_distributed(use_cuda: bool, init: Callable[[str], Any] | None = None) -> tuple[int, int, torch.device]:
    """Start the process group (NCCL on a GPU, else gloo) through `init` (default dist.init_process_group; the
    DeepSpeed loop passes deepspeed.init_distributed); a plain `python -m shardckpt.train` is one rank."""
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )
    start = init or dist.init_process_group
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        start("nccl")
        return dist.get_rank(), dist.get_world_size(), torch.device("cuda", local_rank)
    start("gloo")
    return dist.get_rank(), dist.get_world_size(), torch.device("cpu")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rng_state(device: torch.device) -> dict[str, Any]:
    state = {"torch": bytes(torch.get_rng_state().numpy().tobytes()), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = bytes(torch.cuda.get_rng_state(device).numpy().tobytes())
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(state["cuda"]), dtype=torch.uint8), device)
