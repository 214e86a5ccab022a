"""Checkpointer: what a training loop keeps around — cadence, retention, async saves, preemption, resume.

maybe_save(step, state) saves every `every_steps` (and once more when a preemption signal arrived), prunes to
`keep_last`, and with async_save returns after a host staging copy while the write and commit run behind.
every_steps="auto" chooses the interval from the save cost and the failure history under the root (Young's rule).
"""

from __future__ import annotations

import json
import signal
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from shardckpt import knobs
from shardckpt.api import latest
from shardckpt.catalog import read_commit_marker
from shardckpt.catalog.cadence import Bounds, Cadence, History, Measurements, choose, history_of
from shardckpt.catalog.chain import read_opening
from shardckpt.catalog.events import (
    END,
    EVENTS_DIR,
    PREEMPTION,
    RESTART,
    SAVE,
    START,
    Event,
    EventWarning,
    new_run_id,
    prune_events,
    read_events,
    record_event,
    runs_of,
)
from shardckpt.catalog.listing import Listing, list_root
from shardckpt.catalog.retention import retain
from shardckpt.distributed import protocol
from shardckpt.distributed.collectives import Group, broadcast_bytes
from shardckpt.errors import DistributedError, ShardckptError, ShardckptUsageError
from shardckpt.format.codec import check_codec
from shardckpt.format.manifest import CommitMarker, GlobalManifest
from shardckpt.local_tier import LocalTier, job_of
from shardckpt.statedict.staging import StagingBuffers, stage
from shardckpt.storage import open_storage
from shardckpt.write.encode_ahead import given_pace

State = Mapping[str, Any] | Callable[[], Mapping[str, Any]]
# The global manifest's metadata key under which an incremental series records each save's place in it.
SERIES_KEY = "shardckpt.since_full"
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_NOT_YET = "the default: no checkpoint cost measured yet"


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
    bytes: int  # the data files written (for an incremental save: the changed pieces only)
    warning: str | None = None
    logical_bytes: int = 0  # the bytes of every tensor saved, written or stored by reference
    parent: str | None = None  # an incremental save's parent


class Checkpointer:
    """Saves `state` under `root` as root/step-XXXXXXXX every `every_steps` steps, keeping the newest `keep_last`.

    All ranks of the group call every method together. preemption_signals: on SIGTERM or SIGUSR1 (on any rank)
    the next maybe_save writes a checkpoint of that step and `should_stop` turns true. Retention never deletes the
    checkpoint just saved; when the root already holds a higher step (a new run pointed at an old root, a forgotten
    resume), each save warns (warnings.warn and SaveRecord.warning): the old run's steps stay the newest.

    every_steps="auto": after each save the interval becomes sqrt(2 x cost x MTBF) seconds (catalog/cadence.py),
    cost the median training stall (async) or save time (sync) of recent saves, MTBF from the failure history in
    ROOT/events/, in steps of the median measured step time; clamped to min/max_every_seconds, then to
    min/max_every_steps; `default_every_steps` (within the step bounds) until there is a failure, a cost and a
    step time to use.
    on_cadence receives each new decision (a Cadence, the same on every rank). record_failures (default: on with
    "auto"): the coordinator appends a start/restart event at the first restore_latest or save, a preemption
    event when a signal made it save, and an end event at close() (a run that crashes never writes one).
    clock: Unix seconds, for event times and the cadence's measurements (tests pass a fake one).

    incremental: each save uses the newest committed checkpoint under root as its parent (shardckpt.save(parent=)):
    pieces whose bytes did not change are stored by reference to the file that holds them; every `full_every`-th
    save is a full one, whatever retention deleted, which bounds how many checkpoints references keep alive
    (SPEC 14). Each save records its place in the series in its manifest's metadata (SERIES_KEY: the incremental
    saves since the last full one, itself included), so a restarted job continues the series; a newest checkpoint
    that stores references but records no place (another writer's) is followed by a full save.

    run_names: name each checkpoint step-XXXXXXXX-<run_id> (run_id: fresh for each Checkpointer, the id its failure
    history events carry), so that a run started beside other runs' checkpoints (the training loop's
    --ignore-existing) never meets a name they took; without it a taken name fails the save (AlreadyExistsError).

    total_steps: the run's last step (the step number maybe_save gets last); maybe_save saves it whatever the cadence,
    so the final state is never lost between two cadence steps. close(step, state) does the same for any loop.

    local_root: a node-local tier (docs/guide/local-tier.md): every `local_every_steps` steps that are not a
    persistent save, a local checkpoint into local_root on each node (tmpfs: no fsync), its files also kept by
    `peers` ranks on other nodes, the newest `local_keep` kept; restore_latest takes the newest local step that the
    surviving nodes hold between them when it is newer than the newest persistent checkpoint. local_job names the
    job the local copies belong to (default: root); other jobs' copies are never used, and deleted at the next save.
    """

    def __init__(
        self,
        root: str,
        *,
        every_steps: int | Literal["auto"] = 100,
        keep_last: int = 3,
        async_save: bool = False,
        process_group: Any = None,
        storage_options: dict[str, Any] | None = None,
        preemption_signals: tuple[signal.Signals, ...] = PREEMPTION_SIGNALS,
        block_size: int | None = None,
        on_save: Callable[[SaveRecord], None] | None = None,
        default_every_steps: int = 100,
        min_every_steps: int = 1,
        max_every_steps: int | None = None,
        min_every_seconds: float = 0.0,
        max_every_seconds: float | None = None,
        mtbf_prior_seconds: float | None = None,
        record_failures: bool | None = None,
        on_cadence: Callable[[Cadence], None] | None = None,
        clock: Callable[[], float] = time.time,
        incremental: bool = False,
        full_every: int | None = None,
        run_names: bool = False,
        total_steps: int | None = None,
        local_root: str | None = None,
        local_every_steps: int = 10,
        local_keep: int = 2,
        peers: int = 1,
        local_job: str | None = None,
        local_durable: bool | None = None,
        compression: str | None = None,
        compression_pace: str | None = None,
    ) -> None:
        self.compression = check_codec(compression)  # every save of the manager: save(..., compression=)
        self.compression_pace = given_pace(compression_pace, self.compression)
        self.auto = every_steps == "auto"
        self.bounds = Bounds(min_every_steps, max_every_steps, min_every_seconds, max_every_seconds)
        if self.auto and isinstance(default_every_steps, int) and default_every_steps >= 1:
            # The default obeys the step bounds too (--ckpt-every-max 4 with the loop's default of 10 means 4).
            every_steps = min(max(default_every_steps, self.bounds.min_steps), self.bounds.max_steps or 1 << 62)
        elif self.auto:
            every_steps = default_every_steps
        if not isinstance(every_steps, int) or every_steps < 1 or keep_last < 1:
            raise ShardckptUsageError(
                f"every_steps (or default_every_steps with 'auto') must be >= 1, keep_last >= 1, got "
                f"{every_steps!r}, {keep_last!r}"
            )
        # The knobs' values when not given, read here (not at import, where a malformed one failed every load).
        full_every = knobs.FULL_EVERY if full_every is None else full_every
        mtbf_prior_seconds = knobs.CADENCE_MTBF_PRIOR if mtbf_prior_seconds is None else mtbf_prior_seconds
        if not isinstance(full_every, int) or full_every < 1:
            raise ShardckptUsageError(f"full_every must be an integer >= 1, got {full_every!r}")
        self.incremental, self.full_every = incremental, full_every
        if total_steps is not None and (isinstance(total_steps, bool) or not isinstance(total_steps, int)):
            raise ShardckptUsageError(f"total_steps must be an integer or None, got {total_steps!r}")
        self.total_steps = total_steps
        if not mtbf_prior_seconds >= 0:
            raise ShardckptUsageError(f"mtbf_prior_seconds must be >= 0, got {mtbf_prior_seconds!r}")
        self.root, self.every_steps, self.keep_last, self.async_save = (
            root.rstrip("/"),
            every_steps,
            keep_last,
            async_save,
        )
        self.default_every_steps, self.mtbf_prior_seconds = every_steps, mtbf_prior_seconds
        self.record_failures = self.auto if record_failures is None else record_failures
        self.on_cadence, self.clock = on_cadence, clock
        self.cadence: Cadence | None = None  # the current automatic decision
        self.run_id = new_run_id()
        self.run_names = run_names
        self._measured = Measurements(knobs.CADENCE_WINDOW)
        self._events: list[Event] | None = None  # coordinator: the history read at the run's start, plus its own
        self._saved_ms: list[int] = []  # coordinator: when the root's committed checkpoints were created, at the start
        self._events_source = f"{self.root}/{EVENTS_DIR}"
        self._started = self._ended = self._preemption_recorded = False
        self._anchor: int | None = None  # auto: the step the interval counts from (last save, or the run's start)
        self.storage_options, self.block_size, self.on_save = storage_options, block_size, on_save
        self.group = protocol.resolve_group(process_group)
        if run_names:  # the coordinator's id, on every rank: all ranks must save under one name
            self.run_id = str(self._from_coordinator("sharing the run id", lambda: self.run_id))
        # Background saves run their collectives on a group of their own, so they never interleave with training's.
        self._save_group = (
            dist.new_group(backend="gloo") if async_save and isinstance(self.group, Group) else process_group
        )
        self._buffers = StagingBuffers()
        self.tier = (
            None
            if local_root is None
            else LocalTier(
                local_root,
                group=self.group,
                job=job_of(self.root) if local_job is None else local_job,
                every_steps=local_every_steps,
                keep=local_keep,
                peers=peers,
                durable=local_durable,
                block_size=block_size,
                persistent=self.root,
            )
        )
        self._series: tuple[str, str, int] | None = None  # (name, attempt, place in the series) of the last save
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
        max_in_flight: int | None = None,
        optional: Sequence[str] = (),
        cast: bool = False,
    ) -> int | None:
        """Fill `state` from the newest committed checkpoint under root (chosen once, by the coordinator); its step,
        or None when the root holds no committed checkpoint (`state` untouched: start from scratch).

        optional: entries the checkpoint may lack; cast: convert floating-point dtypes (both: see shardckpt.load).
        """
        url = self.latest_url()
        began = self.clock()
        if self.tier is not None:
            restored = self.tier.restore(
                state,
                self.group,
                # One read of the marker (rank 0's), not one per rank: thousands of ranks on an object store.
                newer_than=None
                if url is None
                else self._from_coordinator("reading its step", lambda: self._step_of(url)),
                optional=optional,
                cast=cast,
                max_in_flight=max_in_flight,
            )
            if restored is not None:
                self.last_saved_step = restored.step
                self._start_run(restored.step, resumed=True, began=began, load_ms=round((self.clock() - began) * 1000))
                return restored.step
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
        self._start_run(manifest_step, resumed=True, began=began, load_ms=round((self.clock() - began) * 1000))
        return manifest_step

    def latest_url(self) -> str | None:
        """URL of the newest committed checkpoint under root (shardckpt.latest on the coordinator, shared)."""
        url: str | None = self._from_coordinator(
            "finding the newest checkpoint", lambda: latest(self.root, storage_options=self.storage_options)
        )
        return url

    def _from_coordinator(self, what: str, look: Callable[[], Any]) -> Any:
        """`look()` (a JSON value) run by rank 0 and shared: its answer, or its failure, reaches every rank (a
        failure must not leave them waiting)."""
        if not isinstance(self.group, Group):
            return look()
        message: dict[str, Any] = {"value": None}
        if self.group.rank == 0:
            try:
                message = {"value": look()}
            except Exception as exc:
                message = {"error": f"{type(exc).__name__}: {exc}"}
        try:
            reply = json.loads(broadcast_bytes(self.group, json.dumps(message).encode(), 0))
        except RuntimeError as exc:  # a peer died, or the group's timeout passed
            raise DistributedError(what, {self.group.rank: str(exc)}) from exc
        if "error" in reply:
            raise DistributedError(f"{what} under {self.root}", {0: reply["error"]})
        return reply["value"]

    # ------------------------------------------------------------------------------------------------- save

    def maybe_save(self, step: int, state: State, *, force: bool = False) -> bool:
        """Save at this step if the cadence, `force` or a preemption signal asks for it; True when it saved."""
        _check_step(step)
        self._start_run(None, resumed=False)
        if self.auto:
            self._measured.step_seen(step, self.clock())
            if self._anchor is None:
                self._anchor = self.last_saved_step if self.last_saved_step is not None else step - 1
                self._adopt(Cadence(self.every_steps, "default", f"every {self.every_steps} steps, {_NOT_YET}"))
        preempted = self._preemption_requested(step)
        due = step - self._anchor >= self.every_steps if self._anchor is not None else step % self.every_steps == 0
        # The final state is what a finished run is for: saved whatever the cadence says.
        force = force or step == self.total_steps
        if not (force or preempted or due) or step == self.last_saved_step:
            if self.tier is not None and self.tier.due(step) and step != self.last_saved_step and not preempted:
                self._save_local(step, state)
            if preempted:
                self._record_preemption(step)
                self.should_stop = True
            return False
        self.save(step, state, wait=preempted)
        if preempted:
            self._record_preemption(step)
            self.should_stop = True
        return True

    def save(self, step: int, state: State, *, wait: bool = False) -> None:
        """Save now; with async_save the write runs in the background unless `wait`."""
        _check_step(step)
        # The stall counts everything the training thread waits for: a previous save still running, building the
        # state dict, and the staging copy (or the whole save, when synchronous).
        self._start_run(None, resumed=False)
        began = self.clock()
        self.wait()  # one save at a time: a second one queues behind the first
        url = self.url_of(step)
        parent, place = self._parent_for(url)
        if not self.async_save:
            # protocol.save builds a callable state itself: a rank whose state fails tells every other rank.
            manifest, warning = self._save(state, url, step, parent, place)
            elapsed = self.clock() - began
            self._record(_record_of(step, url, elapsed, elapsed, manifest, warning, parent))
            self._saved(step, elapsed)
            return
        failed: BaseException | None = None
        try:
            staged: State = stage(state() if callable(state) else state, self._buffers)
        except Exception as exc:
            # The other ranks' background saves wait for this one: take part, failing, so that all learn it.
            failed = exc
            staged = _failing(exc)
        stall = self.clock() - began
        self._pending = threading.Thread(
            target=self._background, args=(staged, url, step, stall, parent, place), daemon=True
        )
        self._pending.start()
        if wait or failed is not None:
            self.wait()
        self._saved(step, stall)

    def _save_local(self, step: int, state: State) -> None:
        """A local-tier save of this step; with async_save behind training, as a persistent one."""
        assert self.tier is not None
        self.wait()
        tier = self.tier
        if not self.async_save:
            tier.save(state, step, self.group)
            return
        try:
            staged: State = stage(state() if callable(state) else state, self._buffers)
        except Exception as exc:
            staged = _failing(exc)

        def run() -> None:
            try:
                tier.save(staged, step, self._save_group_resolved())
            except BaseException as exc:  # surfaced by the next wait() on the training thread
                self._pending_error = exc

        self._pending = threading.Thread(target=run, daemon=True)
        self._pending.start()

    def _save_group_resolved(self) -> Any:
        return protocol.resolve_group(self._save_group)

    def url_of(self, step: int) -> str:
        """The URL this Checkpointer saves the checkpoint of `step` under."""
        return f"{self.root}/step-{step:08d}" + (f"-{self.run_id}" if self.run_names else "")

    def wait(self) -> None:
        """Block until the background save (if any) committed; re-raise its error on this rank."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        if self._pending_error is not None:
            error, self._pending_error = self._pending_error, None
            raise error

    def close(self, step: int | None = None, state: State | None = None) -> None:
        """Wait for the last save; with record_failures, mark the run's clean end in the failure history (unless a
        preemption signal stopped it: that was recorded when it saved).

        step, state: the run's final state, saved now unless this step is already saved (a cadence rarely falls on
        the last step), so that latest() is where training ended.
        """
        if (step is None) != (state is None):
            raise ShardckptUsageError("close(step, state): pass both (to save the final state) or neither")
        if step is not None and state is not None and step != self.last_saved_step:
            self.save(step, state, wait=True)
        self.wait()
        if self._started and not self._ended and not self._preemption_recorded:
            self._ended = True
            self._append_event(END, self.last_saved_step)

    # ------------------------------------------------------------------------------------------- internals

    def _parent_for(self, url: str) -> tuple[str | None, int]:
        """(all ranks) The parent of the next save (None: a full save) and the save's place in the series (0: full).

        The count is what the newest committed checkpoint recorded, not what the root still holds: retention
        deletes the saves between the last full one and the newest (only what references name stays), so counting
        the incremental checkpoints on disk would never reach `full_every`."""
        if not self.incremental:
            return None, 0

        def look() -> list[Any]:
            listing = list_root(self.root, storage_options=self.storage_options)
            newest = listing.newest()
            if newest is None or newest.marker is None:
                return [None, -1]
            return [newest.url, self._place_of(listing, newest.name, newest.marker)]

        newest, place = self._from_coordinator("choosing the parent of an incremental save", look)
        if newest is None or place < 0 or place + 1 >= self.full_every or _name_of(newest) == _name_of(url):
            return None, 0
        return str(newest), place + 1

    def _place_of(self, listing: Listing, name: str, marker: CommitMarker) -> int:
        """(coordinator) The newest checkpoint's place in the series: 0 when it is full, what its manifest records
        when it references others (remembered from this run's own last save), -1 when that is unknown."""
        if not marker.references:
            return 0
        if self._series is not None and self._series[:2] == (name, marker.attempt):
            return self._series[2]
        try:
            metadata = read_opening(listing.root.child(name)).manifest.metadata
        except ShardckptError as exc:
            warnings.warn(f"{listing.root.child(name).url}: {exc}; the next save is a full one", UserWarning, 4)
            return -1
        place = metadata.get(SERIES_KEY)
        return place if isinstance(place, int) and not isinstance(place, bool) and 0 < place < 1 << 62 else -1

    def _save(
        self, state: State, url: str, step: int, parent: str | None = None, place: int = 0
    ) -> tuple[GlobalManifest, str | None]:
        """Save, then (coordinator) retention; the manifest and the warning about a newer checkpoint, if any."""
        manifest = protocol.save(
            state,
            url,
            process_group=self._save_group,
            storage_options=self.storage_options,
            step=step,
            block_size=self.block_size,
            parent=parent,
            piece_hashes=True if self.incremental else None,  # every save of the series may be the next's parent
            metadata={SERIES_KEY: place} if self.incremental else None,
            compression=self.compression,
            compression_pace=self.compression_pace,
        )
        # A save that found nothing to reference is a full one in all but its record: the next counts from it.
        self._series = (_name_of(url), manifest.attempt, place if manifest.references else 0)
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

    def _background(
        self, staged: State, url: str, step: int, stall: float, parent: str | None = None, place: int = 0
    ) -> None:
        began = self.clock()
        try:
            manifest, warning = self._save(staged, url, step, parent, place)
        except BaseException as exc:  # surfaced by the next wait() on the training thread
            self._pending_error = exc
            return
        self._record(_record_of(step, url, stall, self.clock() - began, manifest, warning, parent))

    def _record(self, record: SaveRecord) -> None:
        self.records.append(record)
        # Committed: the history's save event (for `shardckpt goodput`), at the commit time.
        self._append_event(
            SAVE, record.step, stall_ms=round(max(0.0, record.stall_seconds) * 1000), every=self.every_steps
        )
        if self.on_save is not None:
            self.on_save(record)

    def _on_signal(self, number: int, frame: object) -> None:
        # Only a flag: the checkpoint itself needs collectives, which run at the next maybe_save.
        self._signal_seen = True

    def _preemption_requested(self, step: int) -> bool:
        """True on every rank when any rank received a preemption signal (one tiny all-reduce per call). The same
        all-reduce checks that every rank is at `step`: ranks at different steps would decide differently whether a
        save is due, and one would wait in the save's collectives for a rank that never enters them."""
        if not isinstance(self.group, Group):
            return self._signal_seen
        values = [1 if self._signal_seen else 0, step, -step]  # the max of -step is minus the smallest step
        flags = torch.tensor(values, dtype=torch.int64, device=self.group.device)
        try:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group.handle)
        except RuntimeError as exc:  # a peer died, or the group's timeout passed
            raise DistributedError("the preemption check", {self.group.rank: str(exc)}) from exc
        signal, highest, lowest = (int(value) for value in flags.tolist())
        if highest != -lowest:
            raise ShardckptUsageError(
                f"maybe_save: the ranks of the group are at different steps (from {-lowest} to {highest}): every "
                f"rank must pass the same step"
            )
        return bool(signal)

    # ------------------------------------------------------------------------ failure history and cadence

    def _start_run(
        self, step: int | None, *, resumed: bool, began: float | None = None, load_ms: int | None = None
    ) -> None:
        """Once per run (first restore_latest or save): the coordinator reads the root's failure history and
        appends this run's start, or its restart with what the run before it left."""
        if self._started:
            return
        self._started = True
        if self.group.rank != 0 or not (self.auto or self.record_failures):
            return
        try:
            root = open_storage(self.root, self.storage_options)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", EventWarning)
                log = read_events(root, knobs.CADENCE_MAX_EVENTS)
            for warning in caught:  # re-issued here, so that they point at the caller's line
                warnings.warn(warning.message, warning.category, stacklevel=4)
            if self.record_failures and log.listed > 2 * knobs.CADENCE_MAX_EVENTS:
                prune_events(root, knobs.CADENCE_MAX_EVENTS)
        except ShardckptError as exc:
            # The history only tunes the cadence: without it the run goes on at the default interval.
            warnings.warn(f"failure history under {self._events_source} unreadable: {exc}", EventWarning, stacklevel=3)
            return
        if self.auto:  # a crashed run's last sign of life: the newest checkpoint it committed
            try:
                committed = [entry.marker for entry in list_root(root).committed() if entry.marker is not None]
                self._saved_ms = [int(marker.created * 1000) for marker in committed]
            except ShardckptError as exc:  # a crashed run then counts until the next start, an upper bound
                warnings.warn(f"{self.root}: checkpoints unlisted for the failure history: {exc}", EventWarning, 3)
        self._events = list(log.events)
        after = _after(self._events, resumed, int(self.clock() * 1000))
        self._append_event(START if after is None else RESTART, step, after, at=began, load_ms=load_ms)

    def _append_event(
        self,
        kind: str,
        step: int | None,
        after: str | None = None,
        *,
        at: float | None = None,
        stall_ms: int | None = None,
        every: int | None = None,
        load_ms: int | None = None,
    ) -> None:
        if self.group.rank != 0 or not self.record_failures:
            return
        try:
            # Names sort by time: an event never shares the millisecond of one before it (a restart and a quick
            # close, a coarse clock), so the history's order is the order things happened in. Another run's event
            # stamped after now (a clock ahead, or the year 9999) is not "before": stepping past it would leave
            # every later event of this run beyond the last valid time, unrecorded.
            now_ms = int(self.clock() * 1000)
            when = now_ms if at is None else int(at * 1000)
            known = [e.time_ms for e in self._events or () if e.run == self.run_id or e.time_ms <= now_ms]
            event = Event(
                kind, self.run_id, max(when, max(known, default=-1) + 1), step, after, stall_ms, every, load_ms
            )
            record_event(open_storage(self.root, self.storage_options), event)
        except ShardckptError as exc:
            warnings.warn(f"failure history: cannot record a {kind} event: {exc}", EventWarning, stacklevel=3)
            return
        if self._events is not None:
            self._events.append(event)

    def _record_preemption(self, step: int) -> None:
        if not self._preemption_recorded:
            self._preemption_recorded = True
            self._append_event(PREEMPTION, step)

    def _saved(self, step: int, cost: float) -> None:
        """Auto cadence, after a save (on every rank): measure it, and choose the interval anew."""
        if not self.auto:
            return
        self._anchor = step
        self._measured.saved(step, cost, self.clock(), asynchronous=self.async_save)
        self._adopt(self._decide())

    def _decide(self) -> Cadence:
        """The coordinator's decision, on every rank: all ranks must save at the same steps."""
        decision = None
        if self.group.rank == 0:
            history: History | None = None
            if self._events is not None:
                now_ms = int(self.clock() * 1000)
                history = history_of(self._events, self.run_id, now_ms, self._events_source, self._saved_ms)
            decision = choose(
                self.default_every_steps,
                self.bounds,
                cost=self._measured.cost(),
                step_seconds=self._measured.step_seconds(),
                history=history,
                prior_seconds=self.mtbf_prior_seconds,
            )
            if not isinstance(self.group, Group):
                return decision
        assert isinstance(self.group, Group)  # a one-process run returned above
        payload = None if decision is None else json.dumps(asdict(decision)).encode()
        try:
            reply = broadcast_bytes(self.group, payload, 0)
        except RuntimeError as exc:  # a peer died, or the group's timeout passed
            raise DistributedError("sharing the checkpoint interval", {self.group.rank: str(exc)}) from exc
        return Cadence(**json.loads(reply))

    def _adopt(self, decision: Cadence) -> None:
        changed = self.cadence is None or (decision.steps, decision.reason) != (self.cadence.steps, self.cadence.reason)
        self.cadence, self.every_steps = decision, decision.steps
        if changed and self.on_cadence is not None:
            self.on_cadence(decision)

    def _step_of(self, url: str) -> int | None:
        marker = read_commit_marker(open_storage(url, self.storage_options))
        return None if marker is None else marker.step


def _check_step(step: object) -> None:
    """A step names the checkpoint (step-XXXXXXXX) and orders it: an int, refused otherwise before anything runs."""
    if isinstance(step, bool) or not isinstance(step, int):
        raise ShardckptUsageError(f"step must be an integer, got {type(step).__name__} {step!r}")


def _record_of(
    step: int,
    url: str,
    stall: float,
    seconds: float,
    manifest: GlobalManifest,
    warning: str | None,
    parent: str | None,
) -> SaveRecord:
    logical = sum(entry.nbytes for entry in manifest.tensors)
    return SaveRecord(step, url, stall, seconds, manifest.total_bytes, warning, logical, parent)


def _name_of(url: str) -> str:
    """The last path segment of a checkpoint URL: its name under the root."""
    return url.rstrip("/").rsplit("/", 1)[-1]


def _after(events: Sequence[Event], resumed: bool, now_ms: int) -> str | None:
    """What the newest earlier run left: clean (an end event), preemption, crash (neither); "unknown" when this run
    resumes a checkpoint no recorded run wrote; None for a first run. A run stamped after now (a clock ahead) is not
    one before this one (cadence.history_of leaves it out too)."""
    runs = runs_of(events)
    starts = [
        (group[0].time_ms, run)
        for run, group in runs.items()
        if group[0].kind in (START, RESTART) and group[0].time_ms <= now_ms
    ]
    if not starts:
        return "unknown" if resumed else None
    kinds = {event.kind for event in runs[max(starts)[1]]}
    return "clean" if END in kinds else "preemption" if PREEMPTION in kinds else "crash"


def _failing(error: BaseException) -> Callable[[], Mapping[str, Any]]:
    """A state that raises `error` when the save builds it: this rank's part in a save it cannot make."""

    def build() -> Mapping[str, Any]:
        raise error

    return build
