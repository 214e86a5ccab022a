"""`shardckpt import-deepspeed` against a real DeepSpeed ZeRO-3 checkpoint (2 ranks, one torchrun launch).

Bit-exact against DeepSpeed's own reconstruction, then hostile variants of the same files: each refused, nothing run.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import uuid
import zipfile
from pathlib import Path

import fsspec
import pytest
import torch
from safetensors.torch import load_file

import shardckpt
from shardckpt.cli import main as cli_main
from shardckpt.errors import FormatError, NotFoundError, ShardckptError
from shardckpt.interop.deepspeed_pickle import (
    DynamicLossScalerState,
    NamespaceState,
    plain_attributes,
    read_checkpoint_pickle,
)
from shardckpt.interop.import_deepspeed import import_deepspeed, model_file, optim_file
from tests.helpers.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parents[1] / "helpers" / "ds_native_worker.py"
TAG = "global_step3"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")


@pytest.fixture(scope="module")
def native(tmp_path_factory) -> Path:
    """Train with DeepSpeed ZeRO-3 on 2 ranks, save_checkpoint, and write DeepSpeed's own reconstruction."""
    out = tmp_path_factory.mktemp("ds-native")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "DS_ACCELERATOR": "cpu",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "TORCH_EXTENSIONS_DIR": str(out / "torch-extensions"),  # nothing is built: the worker turns shm off
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1"]
    command += [f"--master_port={free_port()}", str(WORKER), str(out)]
    result = subprocess.run(command, env=env, capture_output=True, timeout=300, check=False)
    # DeepSpeed on CPU occasionally aborts at exit after everything is written: judge by the files.
    if not all((out / f"done-{rank}").exists() for rank in range(2)):
        pytest.fail(
            f"DeepSpeed worker failed ({result.returncode}):\n{result.stdout[-3000:]!r}\n{result.stderr[-3000:]!r}"
        )
    return out


def tag_copy(native: Path, directory: Path) -> Path:
    """A private copy of the tag directory, to damage."""
    shutil.copytree(native / "ds" / TAG, directory)
    return directory


# ------------------------------------------------------------------------------------------- the real thing


def test_import_is_bit_exact_with_deepspeeds_own_reconstruction(native, tmp_path) -> None:
    report = import_deepspeed(str(native / "ds"), str(tmp_path / "ck"))  # the save dir: `latest` names the tag
    checkpoint = shardckpt.open(str(tmp_path / "ck"))
    expected = load_file(str(native / "expected.safetensors"))
    facts = json.loads((native / "expected.json").read_text())
    truth: dict[str, torch.Tensor] = {}
    for name, tensor in expected.items():  # live gathers, and zero_to_fp32's offline merge of the same files
        key = f"model.{name.removeprefix('offline.')}" if name.startswith("offline.") else name
        assert key not in truth or torch.equal(truth[key], tensor), key
        truth[key] = tensor
    for name, tensor in truth.items():
        got = checkpoint.read(name)
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(got.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name
    trainable = [n.removeprefix("optim.state.").removesuffix(".exp_avg") for n in truth if n.endswith(".exp_avg")]
    steps = {f"optim.state.{fqn}.step" for fqn in trainable}
    assert set(checkpoint.tensors) == set(truth) | steps  # nothing missing, nothing extra
    assert {float(checkpoint.read(name)) for name in steps} == set(facts["steps"]) == {3.0}
    assert {"model.odd", "model.tiny", "model.frozen", "model.mirror.weight", "model.counter"} <= set(truth)
    assert report.world_size == 2 and len(checkpoint.manifest.files) == 2 and report.tensors == len(truth) + len(steps)
    assert checkpoint.step == facts["global_steps"] == 3

    objects = checkpoint.objects
    groups = objects["optim.param_groups"]
    assert [{k: v for k, v in g.items() if k != "params"} for g in json.loads(json.dumps(groups))] == facts[
        "param_groups"
    ]
    assert [sorted(g["params"]) for g in groups] == [sorted(names) for names in facts["group_names"]]
    assert objects["scheduler"] == facts["scheduler"]
    assert objects["deepspeed"] == {
        "global_steps": 3,
        "global_samples": 12,
        "skipped_steps": 0,
        "dp_world_size": 2,
        "ds_version": objects["deepspeed"]["ds_version"],
        "loss_scaler": {"cur_scale": facts["loss_scale"], "dynamic": False},
        "dynamic_loss_scale": False,
        "overflow": False,
    }
    assert objects["epoch"] == 1 and objects["data"] == {"position": 24, "files": ["a", "b"]}
    assert dict(report.skipped) == {
        "rng": "holds a tensor, not plain data",
        "args": "holds a pickled argparse.Namespace, not plain data",
    }
    assert cli_main(["verify", str(tmp_path / "ck")]) == 0


def test_the_import_loads_into_a_live_engine_with_the_live_adapter(native) -> None:
    """The worker imported its own save and loaded it into a fresh engine (load_deepspeed): the naming contract."""
    for rank in range(2):
        result = native / f"reload-{rank}.json"
        assert result.exists(), f"rank {rank} of the worker did not finish the reload (see the fixture's output)"
        assert json.loads(result.read_text()) == {"mismatches": [], "global_steps": 3}


def test_cli_imports_a_tag_dir_between_any_storages(native, tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        cli_main(["import-deepspeed", "--help"])
    assert exited.value.code == 0 and "examples:" in capsys.readouterr().out
    source = f"memory://ds-{uuid.uuid4().hex}"  # read file by file instead of memory-mapped
    memory = fsspec.filesystem("memory")
    for path in (native / "ds" / TAG).iterdir():
        memory.pipe_file(f"{source}/{path.name}", path.read_bytes())
    target = f"memory://ck-{uuid.uuid4().hex}"
    assert cli_main(["import-deepspeed", source, target, "--json", "--step", "7"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (
        summary["world_size"] == 2
        and summary["tensors"] > 90
        and {s["name"] for s in summary["skipped"]}
        == {
            "rng",
            "args",
        }
    )
    checkpoint = shardckpt.open(target)
    assert checkpoint.step == 7
    assert torch.equal(checkpoint.read("model.odd"), load_file(str(native / "expected.safetensors"))["model.odd"])
    # Usual exit codes: 3 for an error (a committed target, a missing tag), one line, no traceback.
    assert cli_main(["import-deepspeed", source, target]) == 3
    assert cli_main(["import-deepspeed", str(native / "ds"), str(tmp_path / "ck"), "--tag", "global_step9"]) == 3
    assert cli_main(["import-deepspeed", str(native / "ds"), str(tmp_path / "ck"), "--tag", "../ds"]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 3 and "Traceback" not in err and "global_step9" in err
    assert cli_main(["import-deepspeed", str(native / "ds"), str(tmp_path / "ck"), "--tag", TAG, "-q"]) == 0
    assert "skipped rng" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------- hostile files


def with_entry(path: Path, suffix: str, data: bytes) -> None:
    """Rewrite the torch.save zip at `path` with the entry ending in `suffix` replaced by `data`."""
    original = zipfile.ZipFile(io.BytesIO(path.read_bytes()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as rewritten:
        for info in original.infolist():
            rewritten.writestr(info.filename, data if info.filename.endswith(suffix) else original.read(info))
    path.write_bytes(out.getvalue())


class RunsCommand:
    """Unpickling this calls `function(*arguments)`, as a hostile checkpoint would."""

    def __init__(self, function, *arguments) -> None:
        self.function, self.arguments = function, arguments

    def __reduce__(self):
        return self.function, self.arguments


def stack_global(module: str, name: str) -> bytes:
    """A protocol-4 pickle of the global module.name (STACK_GLOBAL resolves dotted names attribute by attribute)."""
    text = b"".join(b"\x8c" + bytes([len(part)]) + part.encode() for part in (module, name))
    return b"\x80\x04" + text + b"\x93."


def hostile_pickles(marker: Path) -> dict[str, tuple[bytes, str]]:
    """label -> (data.pkl, the global it must be refused at); plain pickle.loads would create `marker`."""
    touch = f"touch {marker}"
    nested = {"optimizer_state_dict": {"zero_stage": 3, "state": {0: [RunsCommand(os.system, touch)]}}}
    return {
        "os.system via GLOBAL + REDUCE": (b"cos\nsystem\n(S'" + touch.encode() + b"'\ntR.", "os.system"),
        "builtins.eval": (pickle.dumps(RunsCommand(eval, f"open({str(marker)!r}, 'w').close()")), "builtins.eval"),
        "a getattr chain": (
            b"cbuiltins\ngetattr\n(cbuiltins\n__import__\n(S'os'\ntRS'system'\ntR(S'" + touch.encode() + b"'\ntR.",
            "builtins.getattr",
        ),
        "a class DeepSpeed never writes": (
            pickle.dumps({"args": RunsCommand(subprocess.Popen, ["touch", str(marker)])}),
            "subprocess.Popen",
        ),
        "STACK_GLOBAL nested in a valid dict": (pickle.dumps(nested, protocol=4), "posix.system"),
        # Admitted modules must not lend their attributes: a protocol-4 dotted name would walk into os.
        "dotted name in an admitted module": (
            stack_global("torch._utils", "_rebuild_tensor_v2.__globals__"),
            "torch._utils._rebuild_tensor_v2.__globals__",
        ),
    }


def test_malicious_pickles_are_refused_naming_the_file_and_nothing_runs(native, tmp_path, capsys) -> None:
    for number, label in enumerate(hostile_pickles(tmp_path / "unused")):
        marker = tmp_path / f"pwned-{number}"
        payload, refused = hostile_pickles(marker)[label]
        victim = optim_file(0) if number % 2 == 0 else model_file(1)  # first read, and read after rank 0 is written
        directory = tag_copy(native, tmp_path / f"case-{number}")
        with_entry(directory / victim, "data.pkl", payload)
        with pytest.raises(FormatError, match="refuses the pickled global") as caught:
            import_deepspeed(str(directory), str(tmp_path / f"ck-{number}"))
        assert victim in str(caught.value) and refused in str(caught.value), label
        assert "a DeepSpeed checkpoint" in str(caught.value)
        assert not marker.exists(), label
        assert not (tmp_path / f"ck-{number}" / "COMMITTED").exists(), label
        if label != "dotted name in an admitted module":
            pickle.loads(payload)  # the control: plain pickle does run it
            for _ in range(100):  # Popen and os.system finish on their own time
                if marker.exists():
                    break
                subprocess.run(["sleep", "0.05"], check=True)
            assert marker.exists(), label
    assert cli_main(["import-deepspeed", str(tmp_path / "case-0"), str(tmp_path / "ck-cli")]) == 3  # an error
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "refuses the pickled global os.system" in err and "Traceback" not in err


def central_directory_size(path: Path, entry_suffix: str, size: int) -> None:
    """Claim `size` bytes for an entry in the zip's central directory (its bytes stay as they are)."""
    data = bytearray(path.read_bytes())
    position = data.find(b"PK\x01\x02")
    while position >= 0:
        name_length = struct.unpack_from("<H", data, position + 28)[0]
        name = bytes(data[position + 46 : position + 46 + name_length]).decode()
        if name.endswith(entry_suffix):
            struct.pack_into("<II", data, position + 20, size, size)
        position = data.find(b"PK\x01\x02", position + 46)
    path.write_bytes(bytes(data))


def resave(path: Path, change) -> None:
    """Load a (trusted, test-made) rank file with torch, change it, save it again."""
    state = torch.load(path, weights_only=False)
    change(state)
    torch.save(state, path)


def flat_groups(state) -> list[torch.Tensor]:
    return state["optimizer_state_dict"]["fp32_flat_groups"]


def test_damaged_checkpoints_are_refused_with_typed_errors_naming_the_file(native, tmp_path) -> None:
    from deepspeed.runtime.zero.config import ZeroStageEnum

    def storage_entry(directory: Path) -> str:  # the largest storage of rank 0's optimizer file
        archive = zipfile.ZipFile(directory / optim_file(0))
        return max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size).filename

    def truncate(directory: Path) -> None:
        data = (directory / optim_file(0)).read_bytes()
        (directory / optim_file(0)).write_bytes(data[: len(data) // 2])

    def short_storage(directory: Path) -> None:
        entry = storage_entry(directory)
        with zipfile.ZipFile(directory / optim_file(0)) as archive:
            data = archive.read(entry)
        with_entry(directory / optim_file(0), entry, data[: len(data) // 2])

    def shrink_rank_1(state) -> None:
        flat_groups(state)[0] = flat_groups(state)[0][:-2].clone()

    def stage_2(state) -> None:
        state["optimizer_state_dict"]["zero_stage"] = ZeroStageEnum(2)

    cases = {
        "truncated zip": (optim_file(0), truncate, FormatError, "not a torch.save zip"),
        "an entry larger than the file": (
            optim_file(0),
            lambda d: central_directory_size(d / optim_file(0), storage_entry(d), 1 << 31),
            FormatError,
            "runs past the end",
        ),
        "a storage shorter than its tensor": (optim_file(0), short_storage, FormatError, "data.pkl says"),
        "partition sizes that differ between ranks": (
            optim_file(1),
            lambda d: resave(d / optim_file(1), shrink_rank_1),
            FormatError,
            "fp32_flat_groups[0] holds",
        ),
        "a missing rank file": (model_file(1), lambda d: (d / model_file(1)).unlink(), NotFoundError, "is missing"),
        "a missing rank 0 file": (optim_file(0), lambda d: (d / optim_file(0)).unlink(), NotFoundError, "is missing"),
        "a ZeRO-2 checkpoint": (optim_file(0), lambda d: resave(d / optim_file(0), stage_2), FormatError, "stage 2"),
        "a model-parallel file": (
            "zero_pp_rank_0_mp_rank_01_optim_states.pt",
            lambda d: shutil.copy(d / optim_file(0), d / "zero_pp_rank_0_mp_rank_01_optim_states.pt"),
            FormatError,
            "model-parallel rank 1",
        ),
        "a stray rank": (
            optim_file(2),
            lambda d: shutil.copy(d / optim_file(1), d / optim_file(2)),
            FormatError,
            "partition_count is 2",
        ),
        "not a zip at all": (
            model_file(0),
            lambda d: (d / model_file(0)).write_bytes(b"\0" * 4096),
            FormatError,
            "zip",
        ),
    }
    for number, (label, (victim, damage, error, text)) in enumerate(cases.items()):
        directory = tag_copy(native, tmp_path / f"case-{number}")
        damage(directory)
        with pytest.raises(error) as caught:
            import_deepspeed(str(directory), str(tmp_path / f"ck-{number}"))
        assert victim in str(caught.value) and text in str(caught.value), (label, str(caught.value))
        assert not (tmp_path / f"ck-{number}" / "COMMITTED").exists(), label
    with pytest.raises(ShardckptError, match="not a DeepSpeed ZeRO checkpoint directory"):
        import_deepspeed(str(tmp_path), str(tmp_path / "ck-empty"))


def test_deepspeed_objects_become_plain_values_and_nothing_else() -> None:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    scaler = DynamicLossScaler(2**16, 1000, 1, 2, False, dtype=torch.float16)
    loaded = read_checkpoint_pickle(pickle.dumps({"s": scaler, "a": argparse.Namespace(x=1)}, protocol=2), "f.pt")
    assert isinstance(loaded["s"], DynamicLossScalerState) and isinstance(loaded["a"], NamespaceState)
    attributes = {k: v for k, v in vars(scaler).items() if k != "dtype"}  # a dtype is no plain value
    assert plain_attributes(loaded["s"]) == attributes and plain_attributes(loaded["a"]) == {"x": 1}
    odd_state = b"\x80\x02cargparse\nNamespace\n)\x81]b."  # BUILD with a list, not an attribute dict
    with pytest.raises(FormatError, match=r"f\.pt: .*argparse\.Namespace has state list"):
        read_checkpoint_pickle(odd_state, "f.pt")
    # Ten bytes asking the C unpickler for a 32 GiB memo: refused by the opcode scan before it runs.
    with pytest.raises(FormatError, match=r"f\.pt: memo index 4294967280 out of order"):
        read_checkpoint_pickle(b"\x80\x02]r" + struct.pack("<I", 0xFFFFFFF0) + b".", "f.pt")
    with pytest.raises(FormatError, match=r"f\.pt: not a readable pickle"):
        read_checkpoint_pickle(b"\x80\x04\x8e" + struct.pack("<Q", 1 << 40) + b".", "f.pt")  # 1 TiB of bytes
