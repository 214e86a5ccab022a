"""shardckpt.dcp under real ranks: FSDP2 + AdamW through dcp.save / dcp.async_save (thread and process executors)
and dcp.load on 1, 2 and 3 ranks, against DCP's own FileSystemWriter round trip of the same state.

One launched job per world size (2: every save, a failed save, a refused save, the 2-rank loads; 3: the loads).
Besides local disk, the plain dcp.save also goes to S3 (SeaweedFS) and every load reads it back from there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import shardckpt
from tests.helpers import dcp_backend_worker
from tests.helpers.checkpoints import S3_BUCKET
from tests.helpers.launch import run_ranks

WORKER = Path(dcp_backend_worker.__file__)
ENTRY_POINT = str(Path(sys.executable).with_name("shardckpt"))
SAVED_BY_US = ("ours", "thread", "process", "s3")
ON_LOCAL_DISK = ("ours", "thread", "process")  # the loads whose data reads are counted (at LocalStorage)


def _verdicts(results: list[dict | None]) -> list[dict]:
    for rank, result in enumerate(results):
        if result is None or not result["ok"]:
            pytest.fail(f"rank {rank} failed: {result}", pytrace=False)
    return [result["value"] for result in results if result is not None]


@pytest.fixture(scope="module", autouse=True)
def s3_environment(s3_server) -> Iterator[None]:
    """The AWS variables point at the session's SeaweedFS for every test here and the ranks they launch."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in s3_server.environment().items():
            patch.setenv(name, value)
        yield


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], list[dict]]:
    root = tmp_path_factory.mktemp("dcp-backend")
    args = {label: str(root / label) for label in ("ours", "fs", "thread", "process", "failed", "differs")}
    args["s3"] = f"s3://{S3_BUCKET}/dcp-backend-{uuid.uuid4().hex}"
    args["reference"] = str(root / "reference.safetensors")
    return args, _verdicts(run_ranks("save", 2, args, timeout=280, worker=WORKER))


def _check_loads(loads: dict, where: str) -> None:
    """Every checkpoint restored the saved tensors bit for bit, with the values DCP's own round trip gives."""
    if loads["dcp"]["wrong"]:
        pytest.fail(f"{where}: DCP's own round trip differs from the reference in {loads['dcp']['wrong']}")
    values = loads["dcp"]["values"]
    blob = {"bytes": b"\x00\x01state".hex()}
    assert values["extra"] == {"epoch": 3, "tag": "dcp", "blob": blob, "history": [1.5, 2.5]}
    assert [group["lr"] for group in values["param_groups"]] == [0.01]
    assert values["loader"] == {"dp_rank_0": {"bytes": "000000"}, "dp_rank_1": {"bytes": "010101"}}
    for label in SAVED_BY_US:
        assert loads[label]["wrong"] == [], f"{where}: {label}"
        assert loads[label]["values"] == values, f"{where}: {label}"


def test_dcp_save_and_async_save_load_on_2_ranks_as_dcps_own_round_trip(saved) -> None:
    _, verdicts = saved
    for rank, verdict in enumerate(verdicts):
        _check_loads(verdict["loads"], f"rank {rank} of 2")


def test_load_on_3_ranks_matches_and_reads_at_most_5_percent_beyond_the_bytes_needed(saved) -> None:
    args, _ = saved
    verdicts = _verdicts(run_ranks("load", 3, args, timeout=200, worker=WORKER))
    for rank, verdict in enumerate(verdicts):
        _check_loads(verdict, f"rank {rank} of 3")
        for label in ON_LOCAL_DISK:
            read, needed = verdict[label]["read"], verdict[label]["needed"]
            assert needed > 300_000  # the embedding's third and its AdamW moments: data, not manifests, dominate
            assert read <= 1.05 * needed, (rank, label, read, needed)


def test_load_in_one_process(saved) -> None:
    args, _ = saved
    _check_loads(dcp_backend_worker.load_all(args), "one process")


def test_what_dcp_wrote_is_an_ordinary_checkpoint_that_shardckpt_verify_passes(saved) -> None:
    args, _ = saved
    for label in SAVED_BY_US:
        checkpoint = shardckpt.open(args[label])
        assert (checkpoint.manifest.world_size, checkpoint.step) == (2, 7)
        assert checkpoint.objects["extra"]["blob"] == b"\x00\x01state"  # one object, as shardckpt.save stores it
        # Ranks held different parts of "dataloader": each part is its own object (SPEC 7 "Names").
        assert {k: v for k, v in checkpoint.objects.items() if k.startswith("dataloader")} == {
            "dataloader.dp_rank_0": b"\x00\x00\x00",
            "dataloader.dp_rank_1": b"\x01\x01\x01",
        }
        verify = subprocess.run(
            [ENTRY_POINT, "verify", args[label]], capture_output=True, text=True, timeout=120, env=dict(os.environ)
        )
        assert verify.returncode == 0, verify.stdout + verify.stderr


def test_a_rank_failing_in_write_data_fails_the_save_everywhere_and_commits_nothing(saved) -> None:
    args, verdicts = saved
    for verdict in verdicts:
        assert verdict["failed"] == {"raised": "CheckpointException", "causes": {"1": "RuntimeError"}}
    assert not os.path.exists(os.path.join(args["failed"], "COMMITTED"))
    with pytest.raises(shardckpt.NotCommittedError):
        shardckpt.open(args["failed"])


def test_a_save_into_a_committed_url_is_refused_on_every_rank_without_supersede(saved) -> None:
    _, verdicts = saved
    for verdict in verdicts:
        assert verdict["refused"] == {"raised": "CheckpointException", "causes": {"0": "AlreadyExistsError"}}


def test_storage_writers_with_different_steps_are_refused_on_every_rank_before_writing(saved) -> None:
    args, verdicts = saved
    for verdict in verdicts:
        assert verdict["differs"]["raised"] == "CheckpointException", verdict["differs"]
        assert list(verdict["differs"]["causes"]) == ["0"], verdict["differs"]  # the coordinator's plan refused
        cause = verdict["differs"]["causes"]["0"]
        assert "ShardckptUsageError" in cause and "step= differs" in cause and "7 on rank 0; 8 on rank 1" in cause
    assert not os.path.exists(args["differs"])


def test_a_second_save_to_one_url_supersedes_the_first_on_2_ranks(saved) -> None:
    args, _ = saved
    assert sorted(name for name in os.listdir(args["ours"]) if name.startswith("COMMITTED")) == [
        "COMMITTED",
        "COMMITTED-2",
    ]
    assert shardckpt.open(args["ours"]).step == 7  # the loads above read the successor, bit-equal


def test_shardckpt_load_of_the_state_as_dcp_saved_it_fills_each_ranks_own_key(saved) -> None:
    _, verdicts = saved
    for rank, verdict in enumerate(verdicts):
        loader = {f"dp_rank_{rank}": {"bytes": bytes([rank] * 3).hex()}}
        blob = {"bytes": b"\x00\x01state".hex()}
        assert verdict["same"] == {
            "dataloader": loader,
            "extra": {"epoch": 3, "tag": "dcp", "blob": blob, "history": [1.5, 2.5]},
        }
