"""The shardckpt format v1: manifest types, strict msgpack encoding, layout names and version rules.

Pure data and validation: no torch, no fsspec, no I/O. Everything decoded here is treated as hostile.
"""

from shardckpt.format.dtypes import DTYPE_SIZES, itemsize
from shardckpt.format.layout import (
    COMMITTED,
    data_path,
    global_manifest_path,
    local_manifest_path,
    new_attempt,
    validate_attempt,
)
from shardckpt.format.local_manifest import (
    LocalManifest,
    LocalPieces,
    TensorSpec,
    decode_local_manifest,
    encode_local_manifest,
)
from shardckpt.format.manifest import (
    CommitMarker,
    FileEntry,
    GlobalManifest,
    PieceTable,
    TensorEntry,
    decode_commit_marker,
    decode_global_manifest,
    encode_commit_marker,
    encode_global_manifest,
)
from shardckpt.format.strict import FORMAT_VERSION, ObjectEntry

__all__ = [
    "COMMITTED",
    "DTYPE_SIZES",
    "FORMAT_VERSION",
    "CommitMarker",
    "FileEntry",
    "GlobalManifest",
    "LocalManifest",
    "LocalPieces",
    "ObjectEntry",
    "PieceTable",
    "TensorEntry",
    "TensorSpec",
    "data_path",
    "decode_commit_marker",
    "decode_global_manifest",
    "decode_local_manifest",
    "encode_commit_marker",
    "encode_global_manifest",
    "encode_local_manifest",
    "global_manifest_path",
    "itemsize",
    "local_manifest_path",
    "new_attempt",
    "validate_attempt",
]
