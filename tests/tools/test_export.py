"""`shardckpt export`: HF safetensors shards + index, dtype conversion, name filters, and the memory bound."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from shardckpt.cli import main as cli_main
from shardckpt.tools.export import export_hf_safetensors
from tests.helpers.checkpoints import save_sharded

MiB = 1 << 20


def exported(out) -> dict[str, torch.Tensor]:
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        for key, value in load_file(str(out / name)).items():
            assert index["weight_map"][key] == name
            tensors[key] = value
    assert set(tensors) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    return tensors


def small_state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return {
        "model.embed.weight": torch.randn(41, 9, generator=generator),
        "model.norm.weight": torch.randn(9, generator=generator).to(torch.bfloat16),
        "model.pos": torch.arange(41, dtype=torch.int64),
        "model.flat": torch.randn(7, 5, 3, generator=generator),
        "model.scale": torch.tensor(0.5, dtype=torch.float64),
        "model.empty": torch.zeros(0, 4),
        "optim.state.model.embed.weight.exp_avg": torch.randn(41, 9, generator=generator),
    }


def test_dtype_conversion_sharding_and_filters(tmp_path, capsys) -> None:
    state = small_state()
    url = str(tmp_path / "ck")
    save_sharded(state, url, 3, block_size=4096, flat=("model.flat",))
    out = tmp_path / "bf16"
    # A tiny memory limit cuts every tensor into many chunks (and across the rank boundaries of the pieces).
    args = ["export", url, str(out), "--dtype", "bf16", "--max-shard-size", "1000B", "--memory-limit", "1MiB"]
    assert cli_main([*args, "--exclude", "empty", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    tensors = exported(out)
    assert len(summary["files"]) == len(set(os.listdir(out))) - 1 > 1
    assert set(tensors) == {n for n in state if n.startswith("model.") and n != "model.empty"}
    for name, tensor in tensors.items():
        original = state[name]
        expected = original.to(torch.bfloat16) if original.is_floating_point() else original  # ints keep theirs
        assert tensor.dtype == expected.dtype and torch.equal(tensor, expected), name

    out = tmp_path / "plain"
    export_hf_safetensors(url, str(out), include=r"^(model|optim)\.", strip_prefix="model.", memory_limit=MiB)
    tensors = exported(out)
    assert set(tensors) == {n.removeprefix("model.") for n in state}
    for name, original in state.items():
        assert torch.equal(tensors[name.removeprefix("model.")], original), name


def test_export_refuses_what_it_cannot_do(tmp_path, capsys) -> None:
    url = str(tmp_path / "ck")
    save_sharded({"model.w": torch.ones(4, 2), "w": torch.zeros(3)}, url, 2)
    out = str(tmp_path / "out")
    assert cli_main(["export", url, out]) == 0
    assert cli_main(["export", url, out]) == 3  # never overwrites an export (an error: exit 3)
    assert "already holds an export" in capsys.readouterr().err
    assert cli_main(["export", url, str(tmp_path / "b"), "--include", "^nothing"]) == 2
    assert cli_main(["export", url, str(tmp_path / "c"), "--include", ".", "--strip-prefix", "model."]) == 2
    assert "would both be exported as 'w'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["export", url, str(tmp_path / "d"), "--max-shard-size", "5 parsecs"])
    assert exit_info.value.code == 2
    assert cli_main(["export", str(tmp_path / "missing"), str(tmp_path / "e")]) == 3  # an error, not a check
    assert "does not exist" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "b") and not os.path.exists(tmp_path / "e")


# A model of 256 MiB exported under a 32 MiB bound: peak RSS of the exporting process, against the same process
# without the export (Python, torch and shardckpt imported). Tensors of 64 MiB and 96 MiB are each far above the
# bound, one of them 1-D (chunks within a row), one stored as bf16 and converted (two buffers per chunk).
PEAK_RSS = textwrap.dedent(
    """
    import json, sys
    import torch
    from shardckpt.tools.export import export_hf_safetensors
    url, out, limit, dtype = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] or None
    torch.ones(8).to(torch.bfloat16)  # first use of torch's kernels counts in the baseline too
    if url != "-":
        export_hf_safetensors(url, out, memory_limit=limit, dtype=dtype)
    # VmHWM, the peak of this process image: ru_maxrss would carry over the peak of the forking pytest process,
    # which Linux keeps across exec.
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    print(json.dumps(int(status["VmHWM"].split()[0]) * 1024))
    """
)


def peak_rss(*args: str) -> int:
    result = subprocess.run(
        [sys.executable, "-c", PEAK_RSS, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr
    return int(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_export_of_a_model_larger_than_the_memory_limit_stays_under_it(tmp_path) -> None:
    generator = torch.Generator().manual_seed(0)
    state = {
        "model.a": torch.randn(4096, 4096, generator=generator),  # 64 MiB
        "model.b": torch.randn(24 << 20, generator=generator),  # 96 MiB, 1-D
        "model.c": torch.randn(8192, 4096, generator=generator).to(torch.bfloat16),  # 64 MiB
        "model.d": torch.randn(2048, 4096, generator=generator),  # 32 MiB
        "optim.x": torch.randn(1024),
    }
    assert sum(t.numel() * t.element_size() for n, t in state.items() if n.startswith("model.")) == 256 * MiB
    url = str(tmp_path / "ck")
    save_sharded(state, url, 2)
    limit = 32 * MiB
    baseline = peak_rss("-", "", str(limit), "")
    plain = peak_rss(url, str(tmp_path / "plain"), str(limit), "")
    converted = peak_rss(url, str(tmp_path / "fp32"), str(limit), "fp32")  # model.c: bf16 -> fp32
    # Control: with a loose limit the same export holds whole tensors, and the measurement must see it.
    loose = peak_rss(url, str(tmp_path / "loose"), str(16 * limit), "")
    print(
        f"peak RSS above baseline ({baseline / MiB:.0f} MiB): export {(plain - baseline) / MiB:.1f} MiB, "
        f"--dtype fp32 {(converted - baseline) / MiB:.1f} MiB (limit {limit / MiB:.0f} MiB); "
        f"limit {16 * limit / MiB:.0f} MiB: {(loose - baseline) / MiB:.1f} MiB"
    )
    assert plain - baseline < limit and converted - baseline < limit
    assert loose - baseline > 2 * limit
    for out, dtype in ((tmp_path / "plain", None), (tmp_path / "fp32", torch.float32)):
        tensors = exported(out)
        assert sorted(tensors) == ["model.a", "model.b", "model.c", "model.d"]
        for name, tensor in tensors.items():
            assert torch.equal(tensor, state[name] if dtype is None else state[name].to(dtype)), name
