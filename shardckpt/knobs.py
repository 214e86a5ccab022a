"""Every tunable default of shardckpt in one place, each overridable by a SHARDCKPT_<NAME> environment variable.

Format limits (what a reader refuses) live in format/limits.py; these are speeds and sizes a user may tune.
Keyword arguments of the API win over both; an override that does not parse is a ShardckptUsageError naming the
variable, its value and what is valid, raised where the knob is first read (see the end of this module).
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

from shardckpt.errors import ShardckptUsageError

_REFUSED: dict[str, str] = {}  # knob -> why its SHARDCKPT_ override was refused (filled at import, then read only)


def _knob(name: str, default: int | float, *, flag: bool = False, low: int = 0, high: int | None = None) -> int | float:
    """`default`, unless SHARDCKPT_<name> holds a number of the same kind (bytes or counts: int; seconds: float;
    flag: 0 or 1) in low..high. A value that does not parse is recorded in _REFUSED and the default returned for now.

    low and high are the bounds of the parameter the knob is the default of: a value the parameter would refuse is
    refused here, so the message names the variable the user set rather than a parameter they never passed."""
    text = os.environ.get(f"SHARDCKPT_{name}")
    if text is None:
        return default
    try:
        value = type(default)(text)
    except ValueError:
        value = low - 1
    if not low <= value <= (math.inf if high is None else high) or (flag and value not in (0, 1)):
        kind = "a whole number" if isinstance(default, int) else "a number"
        valid = "0 or 1" if flag else f"{kind} >= {low}" if high is None else f"{kind} in {low}..{high}"
        _REFUSED[name] = f"SHARDCKPT_{name}={text!r} is not valid: {valid} (default {default}); fix or unset it"
        return default
    return value


# The smallest range request a reader makes (max_request, SHARDCKPT_MAX_REQUEST): every request costs a call, a
# checksum lookup and, in a compressed file, decoding its whole blocks; at a few bytes each a read crawls (128 KiB
# at max_request=8: 12 s). A page is what a disk reads anyway.
MIN_REQUEST = 4 << 10

# Writing (write/writer.py, storage/local.py)
BLOCK_SIZE = int(_knob("BLOCK_SIZE", 64 << 10))  # bytes per CRC32C block: the granularity of verified reads
WRITE_CHUNK = int(_knob("WRITE_CHUNK", 16 << 20))  # bytes handed to the backend per call
WRITE_THREADS = int(_knob("WRITE_THREADS", 2))  # streams filling one large data file
PARALLEL_MIN_BYTES = int(_knob("PARALLEL_MIN_BYTES", 64 << 20))  # below this one stream is as fast as several
# save(..., compression="zstd"): the zstd level of every group stream (format 1.2, SPEC 4.1; 1 measured best).
MIN_COMPRESSION_LEVEL, MAX_COMPRESSION_LEVEL = -(1 << 17), 22  # zstd's own range, negative levels the fastest
COMPRESSION_LEVEL = int(_knob("COMPRESSION_LEVEL", 1, low=MIN_COMPRESSION_LEVEL, high=MAX_COMPRESSION_LEVEL))
# Threads compressing one rank's blocks; 0: the cores this process may run on, at most 8 (at compression_pace="storage"
# on local files one fewer, at least 1: the writer keeps a core). zstd is CPU-bound (about 0.1-0.3 GB/s per core on
# grouped exponent bytes), so a save keeps pace with a disk only with enough of them.
COMPRESSION_THREADS = int(_knob("COMPRESSION_THREADS", 0))
# 1: compressed saves default to compression_pace="storage" (a block no encoder has started when the writer reaches it
# is written raw: the save never waits for the codec, the ratio depends on the spare cores); 0 (default): "codec".
COMPRESSION_STORAGE_PACE = int(_knob("COMPRESSION_STORAGE_PACE", 0, flag=True))
HOT_CHUNK = int(_knob("HOT_CHUNK", 2 << 20))  # checksummed then written while still in the CPU cache
# 1: every save records a BLAKE3-128 hash of every piece written (format 1.1, SPEC 6.3), what incremental saves
# compare. 0 (default): only saves that may be parents hash (parent= given, piece_hashes=True, Checkpointer(
# incremental=True)); the others write 1.0 local manifests and skip the hashing pass.
PIECE_HASHES = int(_knob("PIECE_HASHES", 0, flag=True))
# 1 (default): an incremental save reads the holder bytes of every piece it would store by reference and checks their
# block CRC32Cs; a damaged piece is written anew (its bytes are in memory) instead of referenced, with a warning, so
# one flipped bit never spreads to every later child. Costs one read of the referenced bytes per save; 0: trust them.
VERIFY_REFERENCED = int(_knob("VERIFY_REFERENCED", 1, flag=True))
# Seconds a holder range this process found intact is trusted without reading it again (0: check at every save):
# a run whose saves all reference one frozen base reads it once an hour, not once per save.
VERIFY_REFERENCED_EVERY = float(_knob("VERIFY_REFERENCED_EVERY", 3600.0))
# One BLAKE3 stream runs at ~3.5 GB/s per core (BLAKE2b, the previous release's, at ~0.6); these threads hash pieces
# while the writer writes them (0: hash in the writer's own thread, one after the other).
HASH_THREADS = int(_knob("HASH_THREADS", 4))
# A piece this large is hashed by BLAKE3's own threads (one per core) rather than by one of ours: a single tensor of
# 1 GiB otherwise hashes on one core while the others wait. Smaller pieces gain little and pay the thread handoff.
HASH_SPLIT_MIN = int(_knob("HASH_SPLIT_MIN", 16 << 20))
HASH_IN_FLIGHT = int(_knob("HASH_IN_FLIGHT", 64 << 20))  # bytes of staged or gathered copies waiting for their hash
FULL_EVERY = int(_knob("FULL_EVERY", 10, low=1))  # Checkpointer(incremental=True): every n-th save is a full one
WRITE_BEHIND_MIN = int(_knob("WRITE_BEHIND_MIN", 1 << 20))  # smaller writes are left to the kernel's writeback

# Importing (interop/pickle_window.py)
PICKLE_PROOF_WINDOW = int(_knob("PICKLE_PROOF_WINDOW", 256 << 10))  # pickle bytes proven at a time (~100x in arrays)

# Reading (read/checkpoint.py, planner/plan.py defaults)
MAX_IN_FLIGHT = int(_knob("MAX_IN_FLIGHT", 256 << 20, low=1))  # bytes of one load's read buffer
MAX_GAP = int(_knob("MAX_GAP", 32 << 10))  # bytes between two needed ranges read through rather than split
# Bytes per range request from disk or an object store: large enough that a disk streams at full speed and
# per-request costs vanish.
MAX_REQUEST = int(_knob("MAX_REQUEST", 8 << 20, low=MIN_REQUEST))
# For bytes already in memory (page cache): small enough that a slot stays in a core's cache between its read, its
# checksums and its copy (warm loads on 4 ranks: +16-35% over 8 MiB; cold reads lose ~15% at this size).
RESIDENT_MAX_REQUEST = int(_knob("RESIDENT_MAX_REQUEST", 2 << 20, low=MIN_REQUEST))
PREFETCH_AHEAD = int(_knob("PREFETCH_AHEAD", 16 << 20))  # how far ahead a jumping reader announces its ranges
VERIFY_CHUNK = int(_knob("VERIFY_CHUNK", 64 << 20))  # bytes `verify` reads per request
# 1 (default): in a shared read, ranks proved to share a host hand bytes over through the reader's /dev/shm region
# (one memcpy, or none) rather than the process group's sockets, and a local tier's replica of a file that the
# receiving rank opens on its own host is copied by the kernel; 0: always through the group.
SHARE_MEMORY = int(_knob("SHARE_MEMORY", 1, flag=True))
# Bytes a rank fetches plus receives per round of a shared read (and max_in_flight / SHARE_DEPTH): smaller rounds
# overlap one round's reads with the previous one's checks sooner and leave less to check after the last read, each
# costs one collective (HSDP 2x2, 512 MiB, cold, with 4 rounds in flight: 16 MiB rounds 0.59 s, 32 MiB 0.74 s, the
# median of 7 loads taking turns); the /dev/shm a reader holds is SHARE_DEPTH rounds. At least MIN_REQUEST: 0 made
# rounds of one byte (a collective per segment), and a round smaller than a request crawls as such requests do.
SHARE_ROUND = int(_knob("SHARE_ROUND", 16 << 20, low=MIN_REQUEST))
# Rounds of a shared read in flight per rank: a reader reads the next depth - 1 rounds while the ranks hand over and
# check this one; its /dev/shm region holds `depth` rounds. At least 2 (one round read ahead), which a shared read
# used silently in place of 0 or 1.
SHARE_DEPTH = int(_knob("SHARE_DEPTH", 4, low=2))
# A collective load shares its reads only when ranks reading on their own would read more than (1 + this) times the
# bytes they need together (a reshard whose ranges touch at their edges reads on its own: it is faster, and reads few
# bytes twice; replicas read 2x and more).
SHARE_MIN_SAVING = float(_knob("SHARE_MIN_SAVING", 0.05))
SHARE_CHECKERS = int(_knob("SHARE_CHECKERS", 8, low=1))  # threads per rank verifying and copying out shared reads

# Object stores (storage/s3.py)
S3_PART_SIZE = int(_knob("S3_PART_SIZE", 16 << 20))  # multipart upload part (S3's minimum is 5 MiB)
S3_READ_PART_SIZE = int(_knob("S3_READ_PART_SIZE", 16 << 20))  # ranged GET size
S3_MAX_IN_FLIGHT = int(_knob("S3_MAX_IN_FLIGHT", 128 << 20))  # bytes of uploads and downloads in flight
S3_MAX_REQUESTS = int(_knob("S3_MAX_REQUESTS", 16))  # concurrent requests
# Seconds one socket read may wait (botocore's read_timeout; config_kwargs win). Until an endpoint has answered once,
# the first such timeout fails the request (a wrong port that accepts and never replies); after, it is retried.
S3_READ_TIMEOUT = float(_knob("S3_READ_TIMEOUT", 60.0))

# Commit and retention
MANIFEST_SETTLE = float(_knob("MANIFEST_SETTLE", 0.25))  # seconds a half-written global manifest must not change
MANIFEST_WAIT = float(_knob("MANIFEST_WAIT", 5.0))  # seconds to wait for a concurrent committer's manifest
DU_MAX_ENTRIES = int(_knob("DU_MAX_ENTRIES", 1_000_000))  # entries `du` looks at in one checkpoint (then says so)
GC_GRACE = float(_knob("GC_GRACE", 3600.0))  # seconds: gc leaves anything younger (a save may be writing it)
# Seconds: a local tier's save leaves another job's local checkpoints, and local saves that never committed, alone
# while younger than this (another job may share the local root and be writing them); older ones it deletes.
LOCAL_TIER_GRACE = float(_knob("LOCAL_TIER_GRACE", 600.0))
# Bytes of each replica a rank receives per round of a local save's replication through the group: a window of the
# replica file, mapped while the group fills it (its pages are the tier's own, resident while mapped; no buffer
# holds them). Sends come from the staging copy. Smaller windows cost more rounds.
LOCAL_TIER_IN_FLIGHT = int(_knob("LOCAL_TIER_IN_FLIGHT", 8 << 20))
# Format 1.2's piece index (SPEC 11.1): a commit of this many tensors or more writes its manifest's tensor entries in
# name-sorted blocks a loading rank range-reads in part (readers older than 1.2 cannot open it); fewer: one document.
PIECE_INDEX_MIN_TENSORS = int(_knob("PIECE_INDEX_MIN_TENSORS", 1024))
# Bytes per piece index block: a rank reads whole blocks, so small ones waste little on the tensors around its own
# (a per-expert DeepSeek-V3 rank on 4,096 ranks needs ~1,000 scattered runs of names); each costs a fence entry.
PIECE_INDEX_BLOCK = int(_knob("PIECE_INDEX_BLOCK", 2 << 10))

# Streaming tools (tools/export.py, tools/diff.py)
MEMORY_LIMIT = int(_knob("MEMORY_LIMIT", 1 << 30))  # bytes of tensor data export and diff hold at once
EXPORT_SHARD_SIZE = int(_knob("EXPORT_SHARD_SIZE", 5 * 10**9))  # what transformers' save_pretrained uses
# `shardckpt inspect`: objects named alike (a.b.*.z: torchtitan's per-parameter hyperparameters) shown as one row
# when at least this many share the pattern
INSPECT_GROUP_MIN = int(_knob("INSPECT_GROUP_MIN", 4))

# Automatic checkpoint cadence (Checkpointer(every_steps="auto"), catalog/cadence.py)
CADENCE_MTBF_PRIOR = float(_knob("CADENCE_MTBF_PRIOR", 3600.0))  # seconds: one prior failure per this long
CADENCE_WINDOW = int(_knob("CADENCE_WINDOW", 16))  # recent saves and steps whose median cost and step time count
CADENCE_MAX_EVENTS = int(_knob("CADENCE_MAX_EVENTS", 256))  # newest failure-history events read (and kept x2)

# A refused override is withheld, not raised at import: importing shardckpt, the CLI (`shardckpt --help`) or a
# read-only command must not fail over a knob it never reads (SHARDCKPT_BLOCK_SIZE=abc and `shardckpt ls`). Reading
# the knob raises instead, naming it; a module that reads one at its own import (a default argument) fails there.
for _name in _REFUSED:
    del globals()[_name]

if not TYPE_CHECKING:  # hidden from mypy, so that a misspelt knob stays a type error

    def __getattr__(name: str) -> int | float:
        if name in _REFUSED:
            raise ShardckptUsageError(_REFUSED[name])
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
