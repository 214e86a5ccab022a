"""The failure history of a root (SPEC 14.1): one small immutable JSON object per run start, preemption or clean end
under ROOT/events/, written by the run's coordinator and read back as hostile input, newest first and bounded.

A bad event file is skipped with an EventWarning, never raised: the history only tunes the checkpoint cadence.
"""

from __future__ import annotations

import json
import re
import secrets
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from shardckpt.errors import FormatError, ShardckptError
from shardckpt.format.limits import MAX_CREATED_SECONDS
from shardckpt.format.values import strict_json
from shardckpt.storage import Storage

EVENTS_DIR = "events"
EVENT_FORMAT = "shardckpt-event"
EVENT_VERSION = (1, 1)  # 1.1: save events, stall_ms / every / load_ms
MAX_EVENT_BYTES = 4096  # an event is ~200 bytes; a reader refuses a larger file before reading it
MAX_TIME_MS = int(MAX_CREATED_SECONDS * 1000)
START, RESTART, PREEMPTION, END, SAVE = "start", "restart", "preemption", "end", "save"
KINDS = (START, RESTART, PREEMPTION, END, SAVE)
MAX_MS = 1 << 53  # a duration in milliseconds (about 285,000 years): anything larger is not one
# What a restart found of the run before it: a clean end, a preemption, nothing (a crash), or no earlier record.
AFTER = ("clean", "preemption", "crash", "unknown")
_RUN = re.compile(r"[0-9a-z]{1,32}")
# The time in the name (milliseconds, 15 digits) orders events without reading them; the nonce keeps two writers
# of the same millisecond from ever naming one object.
_NAME = re.compile(r"([0-9]{15})-([0-9a-f]{16})\.json")


class EventWarning(UserWarning):
    """An object under ROOT/events/ was skipped (malformed, too large, unreadable) or the history not written."""


@dataclass(frozen=True)
class Event:
    """One entry of a root's failure history.

    kind: start (a run with no earlier record), restart (a run after an earlier one), preemption (a signal arrived;
    the run saved and stopped), end (the run finished cleanly). run: the writing run's id. time_ms: Unix time in
    milliseconds. step: the step resumed from (start/restart), saved (preemption, save) or reached (end), if known.
    after: restart only, what the run before it left (one of AFTER).
    Version 1.1 (for `shardckpt goodput`): save (a checkpoint committed, at its commit time) with stall_ms (what
    it cost the training loop) and every (the interval in steps then in force); start/restart with load_ms (the
    resume's load; the event's time is when the resume began).
    """

    kind: str
    run: str
    time_ms: int
    step: int | None = None
    after: str | None = None
    stall_ms: int | None = None
    every: int | None = None
    load_ms: int | None = None

    def __post_init__(self) -> None:
        where = "event"
        if self.kind not in KINDS:
            raise FormatError(f"{where}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.run, str) or not _RUN.fullmatch(self.run):
            raise FormatError(f"{where}: run must be 1..32 characters of [0-9a-z], got {self.run!r}")
        if not _is_int(self.time_ms) or not 0 <= self.time_ms <= MAX_TIME_MS:
            raise FormatError(f"{where}: time_ms must be an integer in 0..{MAX_TIME_MS}, got {self.time_ms!r}")
        if self.step is not None and (not _is_int(self.step) or not 0 <= self.step < 1 << 63):
            raise FormatError(f"{where}: step must be null or an integer in 0..2^63-1, got {self.step!r}")
        if (self.after is not None or self.kind == RESTART) and (self.kind != RESTART or self.after not in AFTER):
            raise FormatError(f"{where}: after is for kind restart only, one of {', '.join(AFTER)}, got {self.after!r}")
        for field, value, kinds in (
            ("stall_ms", self.stall_ms, (SAVE,)),
            ("every", self.every, (SAVE,)),
            ("load_ms", self.load_ms, (START, RESTART)),
        ):
            if value is not None and (self.kind not in kinds or not _is_int(value) or not 0 <= value <= MAX_MS):
                raise FormatError(
                    f"{where}: {field} is for kind {' or '.join(kinds)} only, an integer in 0..2^53, got {value!r}"
                )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def new_run_id() -> str:
    """A fresh random id for one run (one process group's lifetime) of a training job."""
    return secrets.token_hex(8)


def encode_event(event: Event) -> bytes:
    document = {
        "format": EVENT_FORMAT,
        "version": list(EVENT_VERSION),
        "kind": event.kind,
        "run": event.run,
        "time_ms": event.time_ms,
        "step": event.step,
    }
    for key in ("after", "stall_ms", "every", "load_ms"):
        if getattr(event, key) is not None:
            document[key] = getattr(event, key)
    return (json.dumps(document, sort_keys=True) + "\n").encode()


def decode_event(data: bytes, where: str) -> Event:
    """The event in `data` (strict JSON, at most MAX_EVENT_BYTES); FormatError naming `where` for anything else."""
    if len(data) > MAX_EVENT_BYTES:
        raise FormatError(f"{where}: {len(data)} bytes, over the {MAX_EVENT_BYTES} byte limit of an event")
    try:
        raw = strict_json(data.decode("utf-8"), where)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as exc:
        raise FormatError(f"{where}: not strict UTF-8 JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise FormatError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    if raw.get("format") != EVENT_FORMAT:
        raise FormatError(f"{where}: format must be {EVENT_FORMAT!r}, got {raw.get('format')!r}")
    version = raw.get("version")
    if not (isinstance(version, list) and len(version) == 2 and all(_is_int(part) for part in version)):
        raise FormatError(f"{where}: version must be [major, minor], got {version!r}")
    if version[0] != EVENT_VERSION[0]:
        raise FormatError(f"{where}: event version {version[0]}.{version[1]} is not supported (this reader reads 1.x)")
    try:
        # Unknown keys are ignored (a later minor version may add some), as in every document of the format.
        return Event(
            raw.get("kind"),  # type: ignore[arg-type]
            raw.get("run"),  # type: ignore[arg-type]
            raw.get("time_ms"),  # type: ignore[arg-type]
            raw.get("step"),
            raw.get("after"),
            raw.get("stall_ms"),
            raw.get("every"),
            raw.get("load_ms"),
        )
    except FormatError as exc:
        raise FormatError(f"{where}: {str(exc).removeprefix('event: ')}") from None


def event_name(event: Event) -> str:
    """A fresh object name for `event` under ROOT/events/: its time first, so that names sort by time."""
    return f"{event.time_ms:015d}-{secrets.token_hex(8)}.json"


def parse_event_name(name: str) -> int | None:
    """The time (ms) an event object's name gives; None for a name that is not an event's."""
    match = _NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def record_event(root: Storage, event: Event) -> str:
    """Create a new event object under ROOT/events/ (create-only: nothing is overwritten); its path."""
    path = f"{EVENTS_DIR}/{event_name(event)}"
    root.write_new(path, encode_event(event))
    return path


@dataclass(frozen=True)
class EventLog:
    """What read_events found: valid events newest first, what was skipped and why, and how many names were listed."""

    events: tuple[Event, ...]
    skipped: tuple[str, ...]
    listed: int


def read_events(root: Storage, max_events: int) -> EventLog:
    """The newest `max_events` event objects under ROOT/events/ (at most that many are read, each at most
    MAX_EVENT_BYTES); each one skipped (malformed, too large, its name's time not its own) warns EventWarning."""
    names = root.list(EVENTS_DIR)
    # Fixed-width times first in every event name: name order is time order.
    ours = sorted((name for name in names if parse_event_name(name) is not None), reverse=True)
    skipped: list[str] = []
    if len(ours) < len(names):
        skipped.append(f"{len(names) - len(ours)} name(s) under {root.describe(EVENTS_DIR)} are not event names")
    events: list[Event] = []
    for name in ours[: max(0, max_events)]:
        path = f"{EVENTS_DIR}/{name}"
        where = root.describe(path)
        try:
            event = decode_event(root.read_small(path, MAX_EVENT_BYTES), where)
            if event.time_ms != parse_event_name(name):
                raise FormatError(f"{where}: time_ms {event.time_ms} is not the time its name gives")
        except ShardckptError as exc:  # FormatError, or a storage error (deleted meanwhile, unreadable)
            skipped.append(str(exc))
            continue
        events.append(event)
    for message in skipped:
        warnings.warn(f"failure history: skipped {message}", EventWarning, stacklevel=2)
    return EventLog(tuple(events), tuple(skipped), len(names))


def prune_events(root: Storage, keep: int) -> list[str]:
    """Delete all but the newest `keep` event objects under ROOT/events/ (only names of events); the names deleted.

    The coordinator that writes events calls it when the directory grew past twice what a reader reads.
    """
    names = sorted((name for name in root.list(EVENTS_DIR) if parse_event_name(name) is not None), reverse=True)
    doomed = names[max(0, keep) :]
    for name in doomed:
        root.delete(f"{EVENTS_DIR}/{name}")
    return doomed


def runs_of(events: Sequence[Event]) -> dict[str, list[Event]]:
    """Events grouped by run, each run's oldest first."""
    runs: dict[str, list[Event]] = {}
    for event in sorted(events, key=lambda event: event.time_ms):
        runs.setdefault(event.run, []).append(event)
    return runs
