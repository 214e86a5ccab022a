"""`shardckpt import-dcp` in one process: every dtype and layout DCP writes, plain values, and hostile pickles.

Malicious payloads would create a file if anything ran them; each test asserts the refusal and that the file
does not exist.
"""

from __future__ import annotations

import collections
import datetime
import os
import pickle
import uuid
from pathlib import Path

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    Metadata,
)

import shardckpt
from shardckpt.cli import main as cli_main
from shardckpt.errors import FormatError
from shardckpt.interop.import_dcp import import_dcp
from tests.helpers.dcp_files import dcp_dir, torch_save_zip


def test_every_dtype_and_layout_dcp_writes_imports_bit_for_bit(tmp_path) -> None:
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=generator)
    tensors = {
        "f32": torch.randn(3, 4, generator=generator),
        "bf16": torch.randn(7, generator=generator).to(torch.bfloat16),
        "f16": torch.randn(2, 3, generator=generator).half(),
        "f64": torch.randn(3, generator=generator).double(),
        "i64": torch.tensor([-(2**62), 0, 2**62]),
        "u16": torch.tensor([1, 2, 65535], dtype=torch.int32).to(torch.uint16),  # torch.save's v3 storages
        "u64": torch.tensor([1, 2, 3]).to(torch.uint64),
        "f8": torch.randn(4, generator=generator).to(torch.float8_e4m3fn),
        "c64": torch.randn(3, dtype=torch.complex64, generator=generator),
        "bool": torch.tensor([True, False, True]),
        "transposed": base.t(),  # saved with strides (1, 5): gathered, not copied as bytes
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
    }
    state = {**tensors, "nested": {"x": torch.ones(2), "n": 4, "t": (1, 2.0)}, "when": datetime.date(2025, 1, 2)}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
    with pytest.raises(FormatError, match=r"1 value\(s\) cannot be imported, nothing was written: 'when': .*datetime"):
        import_dcp(str(tmp_path / "dcp"), str(tmp_path / "ck"))
    assert not (tmp_path / "ck").exists()
    report = import_dcp(str(tmp_path / "dcp"), str(tmp_path / "ck"), allow_skip=True)
    assert report.skipped == [("when", report.skipped[0][1])] and "datetime" in report.skipped[0][1]
    checkpoint = shardckpt.open(str(tmp_path / "ck"))
    for name, tensor in {**tensors, "nested.x": torch.ones(2)}.items():
        got = checkpoint.read(name)
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        bits = got.reshape(-1).view(torch.uint8), tensor.contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(*bits), name  # compared as bits: float8 and complex have no exact == of their own
    assert checkpoint.objects == {"nested.n": 4, "nested.t": (1, 2.0)}  # beside a tensor: one object each


def test_a_view_with_a_storage_offset_imports_its_own_elements(tmp_path) -> None:
    base = torch.arange(30, dtype=torch.float32).reshape(6, 5)
    view = base[2:5, 1:4]  # torch.save keeps the whole storage: offset 11, strides (5, 1)
    dcp_dir(Path(tmp_path / "dcp"), {"v": view, "w": base})
    import_dcp(str(tmp_path / "dcp"), str(tmp_path / "ck"))
    checkpoint = shardckpt.open(str(tmp_path / "ck"))
    assert torch.equal(checkpoint.read("v"), view) and torch.equal(checkpoint.read("w"), base)
    # The same files behind another fsspec filesystem: read record by record instead of memory-mapped.
    memory = fsspec.filesystem("memory")
    prefix = f"/dcp-{uuid.uuid4().hex}"
    for name in os.listdir(tmp_path / "dcp"):
        memory.pipe_file(f"{prefix}/{name}", (tmp_path / "dcp" / name).read_bytes())
    try:
        import_dcp(f"memory://{prefix}", str(tmp_path / "from-memory"))
    finally:
        memory.rm(prefix, recursive=True)
    assert torch.equal(shardckpt.open(str(tmp_path / "from-memory")).read("v"), view)


class Payload:
    """Unpickling this runs os.system, as a hostile checkpoint would."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def payloads(marker: str) -> dict[str, bytes]:
    """Pickles that create `marker` when plain pickle loads them (the control in the test checks that they do)."""
    command = f"touch {marker}".encode()
    return {
        "GLOBAL os.system + REDUCE": b"cos\nsystem\n(S'" + command + b"'\ntR.",
        "INST os.system": b"(S'" + command + b"'\nios\nsystem\n.",
        "a __reduce__ object": pickle.dumps(Payload(marker)),
        "builtins.exec": b"cbuiltins\nexec\n(S'import os; os.system(\"" + command + b"\")'\ntR.",
        # DCP's metadata module imports os: a protocol-4 dotted name would reach os.system through it.
        "dotted name in an admitted module": b"\x80\x04ctorch.distributed.checkpoint.metadata\nos.system\n(S'"
        + command
        + b"'\ntR.",
        "exploit inside valid metadata": pickle.dumps(Metadata({}, planner_data={"x": Payload(marker)})),
    }


def test_a_malicious_metadata_pickle_is_refused_without_running_it(tmp_path, capsys) -> None:
    for number, (label, payload) in enumerate(payloads(str(tmp_path / "pwned")).items()):
        marker = tmp_path / f"pwned-{number}"
        payload = payloads(str(marker))[label]
        directory = tmp_path / f"dcp-{number}"
        directory.mkdir()
        (directory / ".metadata").write_bytes(payload)
        with pytest.raises(FormatError, match="refuses the pickled global"):
            import_dcp(str(directory), str(tmp_path / "ck"))
        assert cli_main(["import-dcp", str(directory), str(tmp_path / "ck")]) == 3  # an error, not a check
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "refuses the pickled global" in err and "Traceback" not in err
        assert not marker.exists(), label
        pickle.loads(payload)  # the control: plain pickle does run it
        assert marker.exists(), label
    assert not (tmp_path / "ck" / "COMMITTED").exists()


def test_a_far_memo_index_is_refused_before_the_unpickler_allocates_for_it(tmp_path) -> None:
    """10 bytes naming memo slot 2^32 - 1 would make the C unpickler grow its memo to tens of GB."""
    directory = tmp_path / "dcp"
    directory.mkdir()
    (directory / ".metadata").write_bytes(b"\x80\x02N" + b"r\xff\xff\xff\xff" + b".")  # PROTO 2, NONE, LONG_BINPUT
    with pytest.raises(FormatError, match="memo index 4294967295 out of order"):  # from the opcodes: nothing ran
        import_dcp(str(directory), str(tmp_path / "ck"))


def test_a_malicious_record_pickle_is_refused_without_running_it(tmp_path) -> None:
    marker = tmp_path / "pwned"
    for label, payload in payloads(str(marker)).items():
        directory = tmp_path / label.replace(" ", "_")
        dcp_dir(Path(directory), {"w": torch.ones(3)}, records={"w": torch_save_zip(torch.ones(3), payload)})
        with pytest.raises(FormatError, match="refuses the pickled global|not one tensor"):
            import_dcp(str(directory), str(tmp_path / label.replace(" ", "_") / "ck"))
        assert not marker.exists(), label


def test_records_that_cannot_be_read_exactly_are_refused(tmp_path) -> None:
    tensor = torch.arange(12.0)
    good = torch_save_zip(tensor)
    cases = {
        "truncated": good[: len(good) // 2],
        "not a zip": b"\x00" * len(good),
        "another tensor": torch_save_zip(torch.arange(5.0)),
        "a dict, not a tensor": torch_save_zip({"w": tensor}),
    }
    for label, record in cases.items():
        directory = tmp_path / label.replace(" ", "_")
        dcp_dir(Path(directory), {"w": tensor}, records={"w": record})
        with pytest.raises(FormatError):
            import_dcp(str(directory), str(directory / "ck"))
        assert not (directory / "ck" / "COMMITTED").exists(), label
    dcp_dir(Path(tmp_path / "escape"), {"w": tensor})
    metadata = pickle.loads((tmp_path / "escape" / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../../etc/passwd"
    (tmp_path / "escape" / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(FormatError, match="not a plain file name"):
        import_dcp(str(tmp_path / "escape"), str(tmp_path / "escape" / "ck"))


def test_every_plain_value_torch_save_pickles_imports_and_every_other_fails_the_import_by_name(tmp_path) -> None:
    """torch.save writes protocol 2: bytes as _codecs.encode(latin-1 text), b"" as bytes(), bytearray, sets, ...
    A real torchtitan data loader's state is bytes: it was dropped with exit 0 (issue 24)."""
    plain = {
        "position": b"\x00\x07\xff",
        "empty": b"",
        "buffer": bytearray(b"\x80\x00"),
        "every_byte": bytes(range(256)),
        "nested": {"rng": (b"\x01", [b"", 2.5]), "none": None, "flag": True, "inf": float("inf")},
        "ordered": collections.OrderedDict(b=1, a=2),
    }
    not_plain = {
        "seen": {1, 2},
        "frozen": frozenset({3}),
        "z": 1 + 2j,
        "window": slice(1, 5, 2),
        "span": range(3),
        "queue": collections.deque([1]),
    }  # a defaultdict is a mapping: DCP flattens it into plain entries itself
    dcp.save({"w": torch.ones(2), **plain}, checkpoint_id=str(tmp_path / "plain"))
    report = import_dcp(str(tmp_path / "plain"), str(tmp_path / "ck"))
    assert report.skipped == []
    objects = shardckpt.open(str(tmp_path / "ck")).objects
    assert objects == {**plain, "buffer": b"\x80\x00", "ordered": {"b": 1, "a": 2}}  # one binary type, one map
    target = {"w": torch.zeros(2), **{name: None for name in plain}}
    target["nested"] = {"rng": None, "none": 0, "flag": None, "inf": None}
    shardckpt.load(target, str(tmp_path / "ck"))
    assert target["position"] == b"\x00\x07\xff" and target["nested"]["rng"] == (b"\x01", [b"", 2.5])

    dcp.save({"w": torch.ones(2), **not_plain, "kept": b"x"}, checkpoint_id=str(tmp_path / "other"))
    with pytest.raises(FormatError) as refused:
        import_dcp(str(tmp_path / "other"), str(tmp_path / "ck2"))
    message = str(refused.value)
    assert "6 value(s) cannot be imported, nothing was written" in message and "--allow-skip" in message
    for name, kind in [("seen", "set"), ("z", "complex"), ("window", "slice"), ("queue", "deque")]:
        assert f"'{name}': a Python " in message and kind in message, name
    assert not (tmp_path / "ck2").exists()
    report = import_dcp(str(tmp_path / "other"), str(tmp_path / "ck2"), allow_skip=True)
    assert sorted(name for name, _ in report.skipped) == sorted(not_plain)
    assert shardckpt.open(str(tmp_path / "ck2")).objects == {"kept": b"x"}
    # The command line: exit 1 and nothing written, or exit 0 with --allow-skip, the skipped values listed.
    assert cli_main(["import-dcp", str(tmp_path / "other"), str(tmp_path / "ck3")]) == 3  # an error (SPEC of the CLI)
    assert not (tmp_path / "ck3").exists()
    assert cli_main(["import-dcp", "--allow-skip", str(tmp_path / "other"), str(tmp_path / "ck3")]) == 0
    assert shardckpt.open(str(tmp_path / "ck3")).objects == {"kept": b"x"}
