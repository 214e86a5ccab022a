"""Limits a reader enforces on untrusted manifests, in one place so SPEC.md and code agree.

Each bound keeps decoding in bounded time and memory whatever a hostile file claims.
"""

from __future__ import annotations

MAX_GLOBAL_MANIFEST_BYTES = 1 << 30
MAX_LOCAL_MANIFEST_BYTES = 256 << 20
MAX_COMMIT_MARKER_BYTES = 64 << 10
MAX_DEPTH = 64
MAX_VALUE_ITEMS = 1 << 24  # items of one plain value counted as a tree: a writer refuses more before writing
MAX_NAME_CHARS = 1024
MAX_PATH_CHARS = 512
MAX_NDIM = 64
MAX_EXTENT = (1 << 62) - 1  # per dimension, per tensor (elements) and per file (bytes)
MAX_PIECES_PER_TENSOR = 1 << 26
MAX_FILES = 1 << 24
MAX_WORLD_SIZE = 1 << 24
MIN_BLOCK_SIZE = 4 << 10
MAX_BLOCK_SIZE = 64 << 20
MAX_ATTEMPT_CHARS = 32
MAX_MARKER_GENERATION = 10_000  # COMMITTED-<g> successor markers (SPEC 14.2): a reader probes at most this many
MAX_HEADER_JSON_BYTES = 100_000_000  # a data file's safetensors header JSON (SPEC 4): what stock readers accept
MAX_COVER_CORNERS = 1 << 26  # signed corner points an irregular (non-grid) box tiling's cover check may need
MAX_CREATED_SECONDS = 253402300799.0  # 9999-12-31T23:59:59Z, the last second Python's datetime can show
MAX_INDEX_TENSORS = 1 << 26  # tensor entries of one piece index (SPEC 11.1)
MAX_INDEX_BLOCKS = 1 << 24  # blocks of one piece index
MAX_INDEX_BLOCK_BYTES = MAX_GLOBAL_MANIFEST_BYTES  # one block: at least one entry, however many pieces it has
