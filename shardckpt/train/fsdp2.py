"""The FSDP2 (ZeRO-3) trainer: a small GPT sharded over every rank, AdamW with warmup + cosine, checkpoints, resume.

Everything needed to continue is checkpointed: model, optimizer (by parameter FQN), scheduler, step, data
position and every rank's RNG state. The global batch is fixed, so a resume on another world size sees the
same samples in the same steps. DeepSpeedTrainer (deepspeed_loop.py) builds on this class.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.optim.lr_scheduler import LambdaLR

import shardckpt
from shardckpt.catalog.cadence import Cadence
from shardckpt.statedict.flatten import flatten
from shardckpt.train.common import (
    ADAMW_BETAS,
    ADAMW_WEIGHT_DECAY,
    WarmupCosine,
    freeze_base,
    frozen_by_freeze_base,
    rng_state,
    schedule_steps,
    set_rng_state,
)
from shardckpt.train.data import TokenStream
from shardckpt.train.model import GPT, GPTConfig, next_token_loss


class Trainer:
    def __init__(self, args: argparse.Namespace, rank: int, world: int, device: torch.device) -> None:
        if args.global_batch % world:
            raise SystemExit(f"--global-batch {args.global_batch} is not divisible by the world size {world}")
        self.args, self.rank, self.world, self.device = args, rank, world, device
        self.config = GPTConfig(args.vocab, args.seq_len, args.d_model, args.layers, args.heads)
        torch.manual_seed(args.seed)  # identical initial weights on every rank before sharding
        self.build(GPT(self.config).to(device))
        self.stream = TokenStream(args.seed, self.config.vocab, self.config.seq_len)
        self.step = 0
        self.storage_options = {k: v for k, _, v in (o.partition("=") for o in args.storage_option)}
        self.checkpointer = shardckpt.Checkpointer(
            args.ckpt,
            every_steps=args.ckpt_every,
            keep_last=args.keep_last,
            async_save=args.async_save,
            storage_options=self.storage_options,
            on_save=self.on_save,
            default_every_steps=args.ckpt_every_default,
            min_every_steps=args.ckpt_every_min,
            max_every_steps=args.ckpt_every_max,
            min_every_seconds=args.ckpt_every_min_seconds,
            max_every_seconds=args.ckpt_every_max_seconds,
            mtbf_prior_seconds=args.ckpt_mtbf_prior,
            on_cadence=self.on_cadence,
            incremental=args.incremental,
            full_every=args.full_every,
            compression=args.compression,
            compression_pace=args.compression_pace,
            # Beside another run's checkpoints the same cadence meets the same step names: this run's carry its id.
            run_names=args.ignore_existing and not args.resume,
            total_steps=args.steps,
            local_root=args.local_root,
            local_every_steps=args.local_every,
            local_keep=args.local_keep,
            peers=args.peers,
        )

    def build(self, model: GPT) -> None:
        """Shard the model with FSDP2 and make its optimizer and schedule (DeepSpeedTrainer does it with DeepSpeed)."""
        if self.args.freeze_base:  # before sharding: fully_shard keeps each parameter's requires_grad
            freeze_base(model)
        mesh = init_device_mesh(self.device.type, (self.world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=self.args.lr, betas=ADAMW_BETAS, weight_decay=ADAMW_WEIGHT_DECAY
        )
        self.scheduler = LambdaLR(self.optimizer, WarmupCosine(self.args.warmup, schedule_steps(self.args)))

    def state(self) -> dict[str, Any]:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {
            "model": model_state,
            "optim": optim_state,
            "scheduler": self.scheduler.state_dict(),
            "trainer": {"step": self.step, "data_position": self.step * self.args.global_batch},
            "rng": shardckpt.PerRank(rng_state(self.device)),
        }

    def resume(self) -> int | None:
        state = self.state()
        began = time.perf_counter()
        try:
            step = self.checkpointer.restore_latest(state)
        except shardckpt.DistributedError as exc:
            try:
                hint = self.freeze_base_hint(state)
            except shardckpt.ShardckptError:  # the hint is a courtesy: the load's own error is what matters
                hint = ""
            if not hint:
                raise
            raise shardckpt.DistributedError(
                exc.operation, {rank: f"{cause}; {hint}" for rank, cause in exc.failures.items()}
            ) from exc
        if step is None:
            return None
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["trainer"]["step"]
        return self._resumed(state, step, began)

    def freeze_base_hint(self, state: dict[str, Any]) -> str:
        """After a failed resume: the flag to pass when the checkpoint lacks exactly the optimizer state that
        --freeze-base leaves out (a run saved with it, resumed without it); '' otherwise."""
        url = self.checkpointer.latest_url()
        if self.args.freeze_base or url is None:
            return ""
        stored = shardckpt.open(url, storage_options=self.storage_options).tensors
        missing = [leaf.name for leaf in flatten(state) if leaf.is_tensor and leaf.name not in stored]
        frozen = tuple(f"optim.state.{name}." for name in frozen_by_freeze_base(self.model))
        if not missing or not all(name.startswith(frozen) for name in missing):
            return ""
        return (
            f"these are the optimizer state of the {len(frozen)} parameters --freeze-base keeps frozen: the "
            "checkpoint was saved with --freeze-base; pass --freeze-base to resume it"
        )

    def check_fresh_root(self) -> None:
        """Without --resume: refuse a --ckpt root that holds committed checkpoints, unless --ignore-existing.

        A forgotten --resume (or an old root reused) would train from scratch beside the old run's checkpoints,
        whose higher steps stay the newest: a later --resume would pick them, not this run's.
        """
        existing = self.checkpointer.latest_url()
        tier = self.checkpointer.tier
        if existing is None and tier is not None:
            # Local checkpoints of this job count as well: a later --resume would take their higher steps over this
            # run's (and the tier's retention would keep them over this run's lower ones).
            held = tier.held(self.checkpointer.group)
            if held and not self.args.ignore_existing:
                raise shardckpt.ShardckptUsageError(
                    f"--local-root {self.args.local_root} already holds local checkpoints of this job "
                    f"({', '.join(held)}); pass --resume to continue from the newest, or use a fresh --ckpt or "
                    "--local-root"
                )
        if existing is None:
            return
        if not self.args.ignore_existing:
            raise shardckpt.ShardckptUsageError(
                f"--ckpt {self.args.ckpt} already holds committed checkpoints (newest: {existing}); pass --resume to "
                "continue from it, use a fresh root, or pass --ignore-existing to start at step 0 beside them"
            )
        self._say(
            f"WARNING: starting at step 0 under {self.args.ckpt}, which already holds {existing}; this run's "
            f"checkpoints are named step-XXXXXXXX-{self.checkpointer.run_id}"
        )

    def _resumed(self, state: dict[str, Any], step: int, began: float) -> int:
        if state["rng"].value is not None:
            set_rng_state(state["rng"].value, self.device)
        self.keep_schedule()
        tier = self.checkpointer.tier
        restored = tier.last_restore if tier is not None else None
        # "resumed [from X ]at step N on W ranks": the form tests/soak.py reads.
        source = f"from local:{restored.name} " if restored is not None else ""
        self._say(f"resumed {source}at step {self.step} on {self.world} ranks in {time.perf_counter() - began:.2f} s")
        return step

    def keep_schedule(self) -> None:
        """After a resume: the schedule's length is the checkpoint's (restored with the scheduler's state), unless
        --schedule-steps asks for another; either way the log says so when --steps goes past it."""
        schedule = self.scheduler.lr_lambdas[0]
        if not isinstance(schedule, WarmupCosine):
            return
        wanted = self.args.schedule_steps
        if wanted is not None and wanted != schedule.total:
            self._say(f"WARNING: --schedule-steps {wanted} re-stretches the schedule of {schedule.total} steps")
            schedule.total = wanted
        elif self.args.steps > schedule.total:
            self._say(
                f"the lr schedule ends at step {schedule.total} (from the checkpoint); steps after it run at the final "
                "lr (pass --schedule-steps to stretch the decay instead)"
            )

    def batch(self) -> torch.Tensor:
        """This rank's samples of the current step: a fixed global batch, split evenly over the ranks."""
        per_rank = self.args.global_batch // self.world
        first = self.step * self.args.global_batch + self.rank * per_rank
        return self.stream.batch(first, per_rank).to(self.device)

    def train_step(self) -> float:
        loss = next_token_loss(self.model, self.batch())
        loss.backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self.finish_step(loss)

    def finish_step(self, loss: torch.Tensor) -> float:
        """Count the step; the global batch's mean loss (sum of equal-sized per-rank means / world)."""
        self.step += 1
        total = loss.detach().clone()
        dist.all_reduce(total)
        return float(total.item()) / self.world

    def on_save(self, record: shardckpt.SaveRecord) -> None:
        size = record.bytes / 2**20
        stall = f", training stalled {record.stall_seconds * 1e3:.1f} ms" if self.args.async_save else ""
        self._say(
            f"checkpoint step {record.step}: {size:.2f} MiB in {record.save_seconds:.3f} s "
            f"({size / max(record.save_seconds, 1e-9):.1f} MiB/s){stall} -> {record.url}"
        )
        if self.args.incremental:
            kind = "full" if record.parent is None else f"incremental on {record.parent.rstrip('/').rsplit('/', 1)[-1]}"
            self._say(
                f"checkpoint step {record.step}: wrote {record.bytes} bytes of {record.logical_bytes} logical "
                f"({record.bytes / max(record.logical_bytes, 1):.1%}, {kind})"
            )
        if record.warning:
            self._say(f"WARNING: {record.warning}")

    def on_cadence(self, cadence: Cadence) -> None:
        """--ckpt-every auto: the interval and why, each time it changes (the same decision on every rank)."""
        self._say(f"checkpoint interval: {cadence.why}")

    def run(self) -> None:
        count = sum(getattr(p, "ds_numel", p.numel()) for p in self.model.parameters())  # ZeRO-3: ds_numel
        self._say(
            f"training {count} parameters on {self.world} ranks "
            f"({dist.get_backend()}), global batch {self.args.global_batch}, steps {self.step}..{self.args.steps}"
        )
        while self.step < self.args.steps:
            loss = self.train_step()
            self._log(
                {
                    "step": self.step,
                    "loss": loss,
                    "loss_hex": loss.hex(),
                    "world": self.world,
                    "lr": self.scheduler.get_last_lr()[0],
                }
            )
            self.checkpointer.maybe_save(self.step, self.state)
            if self.checkpointer.should_stop:
                self._say(f"preempted: checkpoint of step {self.step} committed; exiting")
                break
        self.checkpointer.close()

    def _say(self, message: str) -> None:
        if self.rank == 0:
            print(f"[train] {message}", flush=True)

    def _log(self, record: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        print(f"[train] step {record['step']:4d}  loss {record['loss']:.4f}  lr {record['lr']:.2e}", flush=True)
        if self.args.loss_log:
            os.makedirs(os.path.dirname(os.path.abspath(self.args.loss_log)), exist_ok=True)
            with open(self.args.loss_log, "a") as handle:
                handle.write(json.dumps(record) + "\n")
