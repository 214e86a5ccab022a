"""Torch tensors as raw bytes: the dtype table between torch and the format, and zero-copy byte views.

The writer reads a tensor's bytes through these views and the restorer writes straight into them.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from shardckpt.errors import ShardckptUsageError

TORCH_TO_FORMAT: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.uint16: "U16",
    torch.int32: "I32",
    torch.uint32: "U32",
    torch.int64: "I64",
    torch.uint64: "U64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.float8_e8m0fnu: "F8_E8M0",
    torch.complex64: "C64",
}
FORMAT_TO_TORCH: dict[str, torch.dtype] = {name: dtype for dtype, name in TORCH_TO_FORMAT.items()}


def format_dtype(dtype: torch.dtype) -> str:
    try:
        return TORCH_TO_FORMAT[dtype]
    except KeyError:
        raise ShardckptUsageError(f"dtype {dtype} cannot be stored (supported: {sorted(FORMAT_TO_TORCH)})") from None


def torch_dtype(name: str) -> torch.dtype:
    return FORMAT_TO_TORCH[name]


def host_staging(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host buffer for copies to or from `device`: pinned for CUDA (DMA without a bounce), plain otherwise."""
    pinned = device.type == "cuda" and torch.cuda.is_available()
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pinned)


def host_bytes(tensor: torch.Tensor) -> npt.NDArray[np.uint8]:
    """The tensor's elements, row-major, as a uint8 array (a view when already contiguous on the CPU).

    A GPU tensor is copied once into pinned host memory.
    """
    flat = tensor.detach()
    if flat.device.type != "cpu":
        staging = host_staging(tuple(flat.shape), flat.dtype, flat.device)
        staging.copy_(flat)
        flat = staging
    flat = flat.contiguous().reshape(-1)
    if flat.numel() == 0:
        return np.zeros(0, dtype=np.uint8)
    return flat.view(torch.uint8).numpy()


def writable_bytes(tensor: torch.Tensor) -> npt.NDArray[np.uint8] | None:
    """A writable uint8 view of a contiguous CPU tensor's memory, or None if it has none."""
    if not tensor.is_cpu or not tensor.is_contiguous() or tensor.numel() == 0:
        return None
    try:  # numpy's reshape and view cost less than torch's (a load makes one view per tensor); detach only if needed
        return (tensor.detach() if tensor.requires_grad else tensor).numpy().reshape(-1).view(np.uint8)
    except (TypeError, RuntimeError):  # a dtype numpy lacks (bfloat16, float8), or a conjugate view
        return tensor.detach().reshape(-1).view(torch.uint8).numpy()
