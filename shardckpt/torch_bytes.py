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


def check_dense(name: str, tensor: torch.Tensor, kind: str = "") -> None:
    """ShardckptUsageError naming tensor `name` unless it has dense elements in memory (not sparse, nested or meta).

    Checked before a byte is written: torch's own errors for these come late, untyped, after a data file began.
    """
    if tensor.is_nested:
        raise ShardckptUsageError(f"tensor {name!r}: a {kind}nested tensor cannot be saved (store its components)")
    if tensor.layout != torch.strided:
        raise ShardckptUsageError(
            f"tensor {name!r}: a {kind}{tensor.layout} tensor cannot be saved (dense tensors only: .to_dense())"
        )
    if tensor.device.type == "meta":
        raise ShardckptUsageError(
            f"tensor {name!r}: a {kind}tensor on the meta device has no data to save (materialise it first, e.g. "
            "model.to_empty(device=...) and initialise, or load into it)"
        )


def check_destination(name: str, tensor: torch.Tensor) -> None:
    """ShardckptUsageError naming tensor `name` unless a load can fill `tensor`: dense, with memory of its own
    for every element (torch refuses to copy into an expand()ed view, and a meta tensor would stay empty)."""
    if tensor.is_nested or tensor.layout != torch.strided:
        layout = "nested" if tensor.is_nested else str(tensor.layout)
        raise ShardckptUsageError(f"tensor {name!r}: the destination is a {layout} tensor; load into dense tensors")
    if tensor.device.type == "meta":
        raise ShardckptUsageError(
            f"tensor {name!r}: the destination is on the meta device, which holds no data; materialise it first "
            "(e.g. model.to_empty(device=...)), then load"
        )
    if tensor.numel() > 1 and torch._debug_has_internal_overlap(tensor) == 1:  # 1: surely overlaps
        raise ShardckptUsageError(
            f"tensor {name!r}: elements of the destination share memory (an expand()ed or as_strided view); "
            "load into a tensor with memory of its own (e.g. its .clone()) and copy from there"
        )


def host_staging(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host buffer for copies to or from `device`: pinned for CUDA (DMA without a bounce), plain otherwise."""
    pinned = device.type == "cuda" and torch.cuda.is_available()
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pinned)


def host_bytes(tensor: torch.Tensor) -> npt.NDArray[np.uint8]:
    """The tensor's elements, row-major, as a uint8 array (a view when already contiguous on the CPU).

    A GPU tensor is copied once into pinned host memory. A conjugate or negative view (z.conj(), z.conj().imag) is
    stored by value, as torch.save does: its memory holds the values before the lazy conjugation or negation.
    """
    flat = by_value(tensor.detach())
    if flat.device.type != "cpu":
        staging = host_staging(tuple(flat.shape), flat.dtype, flat.device)
        staging.copy_(flat)
        flat = staging
    flat = flat.contiguous().reshape(-1)
    if flat.numel() == 0:
        return np.zeros(0, dtype=np.uint8)
    return flat.view(torch.uint8).numpy()


def by_value(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, or a copy with its values when it is a lazy conjugate or negative view (its bytes are not them)."""
    return tensor.resolve_conj().resolve_neg() if tensor.is_conj() or tensor.is_neg() else tensor


def writable_bytes(tensor: torch.Tensor) -> npt.NDArray[np.uint8] | None:
    """A writable uint8 view of a contiguous CPU tensor's memory, or None if it has none (or its memory does not
    hold its values: a conjugate or negative view is filled through torch's copy_, which applies the bit)."""
    if not tensor.is_cpu or not tensor.is_contiguous() or tensor.numel() == 0 or tensor.is_conj() or tensor.is_neg():
        return None
    try:  # numpy's reshape and view cost less than torch's (a load makes one view per tensor); detach only if needed
        return (tensor.detach() if tensor.requires_grad else tensor).numpy().reshape(-1).view(np.uint8)
    except (TypeError, RuntimeError):  # a dtype numpy lacks (bfloat16, float8)
        return tensor.detach().reshape(-1).view(torch.uint8).numpy()
