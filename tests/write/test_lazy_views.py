"""Tensors whose memory does not hold their values (conjugate and negative views) are saved by value, as torch.save
saves them, and filled correctly when they are load destinations; tensors with no dense memory (sparse, nested,
meta, expand()ed destinations) are refused by name before a byte is written."""

from __future__ import annotations

import os

import pytest
import torch

import shardckpt
from shardckpt.errors import ShardckptUsageError


def _files(url: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), url) for d, _, files in os.walk(url) for f in files)


def _complex() -> torch.Tensor:
    return torch.randn(4, 3, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))


def _views() -> dict[str, torch.Tensor]:
    z = _complex()
    return {
        "conj": z.conj(),
        "conj_imag": z.conj().imag,  # a negative view of z's imaginary parts
        "conj_transposed": z.conj().t(),
        "neg": torch._neg_view(z.real),
        "row": z.conj()[1],  # a small piece: the writer gathers these into one buffer
    }


def test_conjugate_and_negative_views_are_saved_by_value(tmp_path) -> None:
    state = _views()
    url = str(tmp_path / "ck")
    shardckpt.save(state, url)
    loaded = {name: torch.zeros(tensor.shape, dtype=tensor.dtype) for name, tensor in state.items()}
    shardckpt.load(loaded, url)
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor.resolve_conj().resolve_neg()), name
    checkpoint = shardckpt.open(url)
    assert torch.equal(checkpoint.read("conj"), _complex().conj().resolve_conj())


def test_loading_into_conjugate_and_negative_views_fills_their_values(tmp_path) -> None:
    z = _complex()
    url = str(tmp_path / "ck")
    shardckpt.save({"z": z, "r": z.real.clone()}, url)
    base, other = torch.zeros(4, 3, dtype=torch.complex64), torch.zeros(4, 3, dtype=torch.complex64)
    destination = {"z": base.conj(), "r": other.conj().imag}
    shardckpt.load(destination, url)
    assert torch.equal(destination["z"], z) and torch.equal(base, z.conj())
    assert torch.equal(destination["r"], z.real) and torch.equal(other.imag, -z.real)


@pytest.mark.parametrize("kind", ["sparse", "nested", "meta"])
def test_a_tensor_without_dense_memory_is_refused_before_a_byte_is_written(tmp_path, kind: str) -> None:
    tensor = {
        "sparse": lambda: torch.eye(3).to_sparse(),
        "nested": lambda: torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]),
        "meta": lambda: torch.empty(3, device="meta"),
    }[kind]()
    url = str(tmp_path / "ck")
    writer = shardckpt.ShardWriter(url, rank=0, world_size=1)
    with pytest.raises(ShardckptUsageError, match=r"tensor 'bad': a .*(sparse|nested|meta)"):
        writer.add("bad", tensor)
    assert not os.path.exists(url) or _files(url) == []


@pytest.mark.parametrize("kind", ["sparse", "nested", "meta", "expanded"])
def test_a_destination_a_load_cannot_fill_is_refused_by_name_before_any_is_filled(tmp_path, kind: str) -> None:
    url = str(tmp_path / "ck")
    shardckpt.save({"a": torch.ones(4, 3), "b": torch.ones(4, 3)}, url)
    bad = {
        "sparse": lambda: torch.zeros(4, 3).to_sparse(),
        "nested": lambda: torch.nested.nested_tensor([torch.zeros(3), torch.zeros(3)]),
        "meta": lambda: torch.empty(4, 3, device="meta"),  # copy_ into it does nothing: a silent empty load
        "expanded": lambda: torch.zeros(1, 3).expand(4, 3),
    }[kind]()
    first = torch.zeros(4, 3)
    with pytest.raises(ShardckptUsageError, match=r"tensor 'b': .*destination"):
        shardckpt.load({"a": first, "b": bad}, url)
    assert torch.equal(first, torch.zeros(4, 3))
