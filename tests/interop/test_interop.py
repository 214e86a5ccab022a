"""Real FSDP2 checkpoints in and out: DCP checkpoints import bit for bit, HF exports equal the full state.

One launch per world size (2 and 4 gloo ranks) trains an FSDP2 model + AdamW for a step and saves the same state
with torch.distributed.checkpoint and with shardckpt; rank 0 keeps DTensor.full_tensor() of everything.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import shardckpt
from shardckpt.cli import main as cli_main
from shardckpt.interop.import_dcp import import_dcp
from shardckpt.ops.verify import verify
from tests.helpers.launch import run_ranks

WORLDS = (2, 4)  # 4 ranks: Linear(7, 5) has 5 rows, so rank 3 holds an empty shard


@pytest.fixture(scope="module")
def saves(tmp_path_factory) -> dict[int, dict[str, str]]:
    root = tmp_path_factory.mktemp("interop")
    paths = {}
    for world in WORLDS:
        args = {
            "dcp_dir": str(root / f"dcp{world}"),
            "url": str(root / f"ck{world}"),
            "reference": str(root / f"ref{world}.safetensors"),
        }
        for rank, result in enumerate(run_ranks("dcp_save", world, args)):
            assert result is not None, f"rank {rank} of {world} wrote no result"
            assert result["ok"], f"rank {rank}: {result.get('error')}\n{result.get('trace')}\n{result.get('output')}"
        paths[world] = args
    return paths


def reference(path: str) -> dict[str, torch.Tensor]:
    """The full state under the names DCP and shardckpt give it ("optim.state.<fqn>.<key>")."""
    full = load_file(path)
    return {n if n.startswith("model.") else "optim.state." + n[len("optim.") :]: t for n, t in full.items()}


def flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        flat.update(flatten(value, name) if isinstance(value, dict) else {name: value})
    return flat


@pytest.mark.parametrize("world", WORLDS)
def test_export_loads_with_safetensors_and_equals_the_full_state(saves, tmp_path, capsys, world: int) -> None:
    out = tmp_path / "hf"
    args = ["export", saves[world]["url"], str(out), "--to", "hf-safetensors", "--strip-prefix", "model.", "--json"]
    assert cli_main([*args, "--max-shard-size", "300B", "--memory-limit", "1MiB"]) == 0
    summary = json.loads(capsys.readouterr().out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(summary["files"]) == len(files) > 1 and set(os.listdir(out)) == files | {"model.safetensors.index.json"}
    exported: dict[str, torch.Tensor] = {}
    for name in sorted(files):
        exported.update(load_file(str(out / name)))
    full = reference(saves[world]["reference"])
    model = {name[len("model.") :]: t for name, t in full.items() if name.startswith("model.")}
    assert set(exported) == set(model) == set(index["weight_map"])  # model weights only, prefix stripped
    for name, tensor in model.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in model.values())


@pytest.mark.parametrize("world", WORLDS)
def test_dcp_import_equals_dcp_own_load(saves, tmp_path, capsys, world: int) -> None:
    url = str(tmp_path / "imported")
    assert cli_main(["import-dcp", saves[world]["dcp_dir"], url, "--step", "7", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["world_size"] == len([f for f in os.listdir(saves[world]["dcp_dir"]) if f.endswith(".distcp")])
    assert summary["skipped"] == []
    dcp_to_torch_save(saves[world]["dcp_dir"], str(tmp_path / "dcp.pt"))  # DCP's own load, in one process
    loaded = flatten(torch.load(str(tmp_path / "dcp.pt"), weights_only=True))
    checkpoint = shardckpt.open(url)
    assert checkpoint.step == 7
    tensors = {name: value for name, value in loaded.items() if isinstance(value, torch.Tensor)}
    assert set(checkpoint.tensors) == set(tensors)
    for name, value in tensors.items():
        assert torch.equal(checkpoint.read(name), value), name
    full = reference(saves[world]["reference"])
    assert set(full) == set(tensors) and all(torch.equal(full[n], tensors[n]) for n in full)
    groups = checkpoint.objects["optim.param_groups"]  # regrouped as shardckpt.save names it
    assert groups[0]["lr"] == loaded["optim.param_groups"][0]["lr"] == 0.01
    assert checkpoint.objects["extra"] == {"epoch": 3, "tag": "dcp"}
    assert verify(url).ok


def test_imported_dcp_checkpoint_restores_a_model_like_dcp_load(saves, tmp_path) -> None:
    url = str(tmp_path / "imported")
    import_dcp(saves[4]["dcp_dir"], url)

    def fresh() -> tuple[nn.Module, torch.optim.Optimizer, dict, dict]:
        torch.manual_seed(1)  # other values than the saved ones: everything must come from the checkpoint
        model = nn.Sequential(nn.Embedding(13, 6), nn.Linear(6, 7), nn.ReLU(), nn.Linear(7, 5), nn.LayerNorm(5))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
        msd, osd = get_state_dict(model, optimizer)
        return model, optimizer, msd, osd

    model, optimizer, msd, osd = fresh()
    state = {"model": msd, "optim": osd}
    shardckpt.load(state, url)  # strict: every entry of this state is in the imported checkpoint
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=state["optim"])
    full = reference(saves[4]["reference"])
    for name, value in model.state_dict().items():
        assert torch.equal(value, full[f"model.{name}"]), name
    names = [name for name, _ in model.named_parameters()]
    restored = optimizer.state_dict()
    assert restored["param_groups"][0]["lr"] == 0.01
    for index, name in enumerate(names):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(restored["state"][index][key], full[f"optim.state.{name}.{key}"]), (name, key)
