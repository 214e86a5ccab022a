"""DCP checkpoints written without DCP, for the importer's tests: hand-made records and metadata pickles.

torch_save_zip gives torch.save's bytes (optionally with a hostile data.pkl); dcp_dir lays out a one-file DCP directory.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)


def torch_save_zip(value: object, data_pkl: bytes | None = None) -> bytes:
    """torch.save's bytes for `value`; with data_pkl, the same zip with its data.pkl entry replaced."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    if data_pkl is None:
        return buffer.getvalue()
    original = zipfile.ZipFile(io.BytesIO(buffer.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as rewritten:
        for info in original.infolist():
            rewritten.writestr(info.filename, data_pkl if info.filename.endswith("data.pkl") else original.read(info))
    return out.getvalue()


def dcp_dir(
    directory: Path,
    tensors: dict[str, torch.Tensor],
    values: dict[str, bytes] | None = None,
    paths: dict[str, tuple] | None = None,
    records: dict[str, bytes] | None = None,
) -> Path:
    """A DCP checkpoint written without DCP: tensors and values (data.pkl bytes), optional key paths and records."""
    directory.mkdir(parents=True, exist_ok=True)
    entries, storage, blob = {}, {}, b""
    for name, tensor in tensors.items():
        record = (records or {}).get(name) or torch_save_zip(tensor)
        offsets = torch.Size([0] * tensor.dim())
        chunk = ChunkStorageMetadata(offsets=offsets, sizes=tensor.shape)
        entries[name] = TensorStorageMetadata(TensorProperties(dtype=tensor.dtype), tensor.shape, [chunk])
        storage[MetadataIndex(name, offsets, 0)] = _StorageInfo("__0_0.distcp", len(blob), len(record))
        blob += record
    for name, data_pkl in (values or {}).items():
        record = torch_save_zip(0, data_pkl)
        entries[name] = BytesStorageMetadata()
        storage[MetadataIndex(name)] = _StorageInfo("__0_0.distcp", len(blob), len(record))
        blob += record
    (directory / "__0_0.distcp").write_bytes(blob)
    metadata = Metadata(entries, planner_data=paths or {}, storage_data=storage)
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    return directory
