"""Checkpointer: what a training loop keeps around — cadence, retention, async saves, preemption, resume.

maybe_save(step, state) saves every `every_steps` (and once more when a preemption signal arrived), prunes to
`keep_last`, and with async_save returns after a host staging copy while the write and commit run behind.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shardckpt import knobs
from shardckpt.api import latest
from shardckpt.catalog import read_commit_marker
from shardckpt.catalog.retention import retain
from shardckpt.distributed import protocol
from shardckpt.distributed.collectives import Group, broadcast_bytes
from shardckpt.errors import DistributedError, ShardckptError, ShardckptUsageError
from shardckpt.format.manifest import GlobalManifest
from shardckpt.read.checkpoint import DEFAULT_MAX_IN_FLIGHT
from shardckpt.statedict.staging import StagingBuffers, stage
from shardckpt.storage import open_storage

State = Mapping[str, Any] | Callable[[], Mapping[str, Any]]
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


@dataclass(frozen=True)
class SaveRecord:
    """What one save cost: the training stall (staging or the whole save), the save time, the bytes committed.

    warning: set (on the coordinator) when the root holds a newer committed checkpoint than this one (another
    run's?): latest() and restore_latest resume from that one, not from this.
    """

    step: int
    url: str
    stall_seconds: float
    save_seconds: float
    bytes: int
    warning: str | None = None


class Checkpointer:
    """Saves `state` under `root` as root/step-XXXXXXXX every `every_steps` steps, keeping the newest `keep_last`.

    All ranks of the group call every method together. preemption_signals: on SIGTERM or SIGUSR1 (on any rank)
    the next maybe_save writes a checkpoint of that step and `should_stop` turns true. Retention never deletes the
    checkpoint just saved; when the root already holds a higher step (a new run pointed at an old root, a forgotten
    resume), each save warns (warnings.warn and SaveRecord.warning): the old run's steps stay the newest.
    """

    def __init__(
        self,
        root: str,
        *,
        every_steps: int = 100,
        keep_last: int = 3,
        async_save: bool = False,
        process_group: Any = None,
        storage_options: dict[str, Any] | None = None,
        preemption_signals: tuple[signal.Signals, ...] = PREEMPTION_SIGNALS,
        block_size: int = knobs.BLOCK_SIZE,
        on_save: Callable[[SaveRecord], None] | None = None,
    ) -> None:
        if every_steps < 1 or keep_last < 1:
            raise ShardckptUsageError(f"every_steps and keep_last must be >= 1, got {every_steps}, {keep_last}")
        self.root, self.every_steps, self.keep_last, self.async_save = (
            root.rstrip("/"),
            every_steps,
            keep_last,
            async_save,
        )
        self.storage_options, self.block_size, self.on_save = storage_options, block_size, on_save
        self.group = protocol.resolve_group(process_group)
        # Background saves run their collectives on a group of their own, so they never interleave with training's.
        self._save_group = (
            dist.new_group(backend="gloo") if async_save and isinstance(self.group, Group) else process_group
        )
        self._buffers = StagingBuffers()
        self._pending: threading.Thread | None = None
        self._pending_error: BaseException | None = None
        self._signal_seen = False
        self.should_stop = False
        self.last_saved_step: int | None = None
        self.records: list[SaveRecord] = []
        for number in preemption_signals:
            signal.signal(number, self._on_signal)

    # ----------------------------------------------------------------------------------------------- resume

    def restore_latest(
        self,
        state: Mapping[str, Any],
        *,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        optional: Sequence[str] = (),
        cast: bool = False,
    ) -> int | None:
        """Fill `state` from the newest committed checkpoint under root (chosen once, by the coordinator); its step,
        or None when the root holds no committed checkpoint (`state` untouched: start from scratch).

        optional: entries the checkpoint may lack; cast: convert floating-point dtypes (both: see shardckpt.load).
        """
        url = self.latest_url()
        if url is None:
            return None
        protocol.load(
            state,
            url,
            process_group=self.group.handle if isinstance(self.group, Group) else None,
            storage_options=self.storage_options,
            max_in_flight=max_in_flight,
            strict=True,
            optional=optional,
            cast=cast,
        )
        manifest_step = self._step_of(url)
        self.last_saved_step = manifest_step
        return manifest_step

    def latest_url(self) -> str | None:
        """URL of the newest committed checkpoint under root (shardckpt.latest on the coordinator, shared)."""
        if not isinstance(self.group, Group):
            return latest(self.root, storage_options=self.storage_options)
        # Rank 0 looks; its answer, or its failure, reaches every rank (a failure must not leave them waiting).
        message: dict[str, str | None] = {"url": None}
        if self.group.rank == 0:
            try:
                message = {"url": latest(self.root, storage_options=self.storage_options)}
            except Exception as exc:
                message = {"error": f"{type(exc).__name__}: {exc}"}
        try:
            reply = json.loads(broadcast_bytes(self.group, json.dumps(message).encode(), 0))
        except RuntimeError as exc:  # a peer died, or the group's timeout passed
            raise DistributedError("finding the newest checkpoint", {self.group.rank: str(exc)}) from exc
        if "error" in reply:
            raise DistributedError(f"finding the newest checkpoint under {self.root}", {0: reply["error"]})
        url: str | None = reply["url"]
        return url

    # ------------------------------------------------------------------------------------------------- save

    def maybe_save(self, step: int, state: State, *, force: bool = False) -> bool:
        """Save at this step if the cadence, `force` or a preemption signal asks for it; True when it saved."""
        preempted = self._preemption_requested()
        if not (force or preempted or step % self.every_steps == 0) or step == self.last_saved_step:
            if preempted:
                self.should_stop = True
            return False
        self.save(step, state, wait=preempted)
        if preempted:
            self.should_stop = True
        return True

    def save(self, step: int, state: State, *, wait: bool = False) -> None:
        """Save now; with async_save the write runs in the background unless `wait`."""
        # The stall counts everything the training thread waits for: a previous save still running, building the
        # state dict, and the staging copy (or the whole save, when synchronous).
        began = time.perf_counter()
        self.wait()  # one save at a time: a second one queues behind the first
        url = f"{self.root}/step-{step:08d}"
        if not self.async_save:
            # protocol.save builds a callable state itself: a rank whose state fails tells every other rank.
            manifest, warning = self._save(state, url, step)
            elapsed = time.perf_counter() - began
            self._record(SaveRecord(step, url, elapsed, elapsed, manifest.total_bytes, warning))
            return
        failed: BaseException | None = None
        try:
            staged: State = stage(state() if callable(state) else state, self._buffers)
        except Exception as exc:
            # The other ranks' background saves wait for this one: take part, failing, so that all learn it.
            failed = exc
            staged = _failing(exc)
        stall = time.perf_counter() - began
        self._pending = threading.Thread(target=self._background, args=(staged, url, step, stall), daemon=True)
        self._pending.start()
        if wait or failed is not None:
            self.wait()

    def wait(self) -> None:
        """Block until the background save (if any) committed; re-raise its error on this rank."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        if self._pending_error is not None:
            error, self._pending_error = self._pending_error, None
            raise error

    def close(self) -> None:
        self.wait()

    # ------------------------------------------------------------------------------------------- internals

    def _save(self, state: State, url: str, step: int) -> tuple[GlobalManifest, str | None]:
        """Save, then (coordinator) retention; the manifest and the warning about a newer checkpoint, if any."""
        manifest = protocol.save(
            state,
            url,
            process_group=self._save_group,
            storage_options=self.storage_options,
            step=step,
            block_size=self.block_size,
        )
        warning = None
        if self.group.rank == 0:
            # The checkpoint just saved stays whatever its place in the order: it is what this run has.
            try:
                retained = retain(open_storage(self.root, self.storage_options), self.keep_last, keep=(_name_of(url),))
            except ShardckptError as exc:
                # The save is committed and durable: a retention failure costs space, not data, so it warns.
                warning = f"{url} is committed, but retention under {self.root} failed: {exc}"
                warnings.warn(warning, UserWarning, stacklevel=2)
                self.last_saved_step = step
                return manifest, warning
            newest = retained.newest
            newest_step = None if newest is None or newest.marker is None else newest.marker.step
            if newest is not None and newest_step is not None and newest_step > step:
                warning = (
                    f"step {step} is below step {newest_step} of {newest.url}, the newest committed checkpoint "
                    f"under {self.root} (another run's?): latest() and restore_latest resume from that one, and "
                    f"retention keeps the newest {self.keep_last} by step plus the checkpoint just saved "
                    f"({url}); use a fresh root, or resume from it"
                )
                warnings.warn(warning, UserWarning, stacklevel=2)
        self.last_saved_step = step
        return manifest, warning

    def _background(self, staged: State, url: str, step: int, stall: float) -> None:
        began = time.perf_counter()
        try:
            manifest, warning = self._save(staged, url, step)
        except BaseException as exc:  # surfaced by the next wait() on the training thread
            self._pending_error = exc
            return
        self._record(SaveRecord(step, url, stall, time.perf_counter() - began, manifest.total_bytes, warning))

    def _record(self, record: SaveRecord) -> None:
        self.records.append(record)
        if self.on_save is not None:
            self.on_save(record)

    def _on_signal(self, number: int, frame: object) -> None:
        # Only a flag: the checkpoint itself needs collectives, which run at the next maybe_save.
        self._signal_seen = True

    def _preemption_requested(self) -> bool:
        """True on every rank when any rank received a preemption signal (one tiny all-reduce per call)."""
        if not isinstance(self.group, Group):
            return self._signal_seen
        flag = torch.tensor([1 if self._signal_seen else 0], dtype=torch.int32, device=self.group.device)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group.handle)
        except RuntimeError as exc:  # a peer died, or the group's timeout passed
            raise DistributedError("the preemption check", {self.group.rank: str(exc)}) from exc
        return bool(flag.item())

    def _step_of(self, url: str) -> int | None:
        marker = read_commit_marker(open_storage(url, self.storage_options))
        return None if marker is None else marker.step


def _name_of(url: str) -> str:
    """The last path segment of a checkpoint URL: its name under the root."""
    return url.rstrip("/").rsplit("/", 1)[-1]


def _failing(error: BaseException) -> Callable[[], Mapping[str, Any]]:
    """A state that raises `error` when the save builds it: this rank's part in a save it cannot make."""

    def build() -> Mapping[str, Any]:
        raise error

    return build
