"""Collective loads read each stored byte once per job (shardckpt.load's share_reads; by default when the ranks span
several nodes, simulated here with SHARDCKPT_NODE):
HSDP (a 2-D replicate x shard mesh) on the same and resharded meshes, and DDP-style replicated tensors, bit-exact,
with the data-file bytes every rank read counted; a rank whose reads fail makes every rank raise."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest

import shardckpt
from shardckpt.distributed import host_memory
from shardckpt.distributed.shared_reads import Offer, _Assembly, read_offers
from shardckpt.errors import DistributedError
from shardckpt.planner import ReadRequest
from shardckpt.planner.share import plan_shared_reads
from tests.helpers.launch import run_ranks

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "share_worker.py"
pytestmark = pytest.mark.dist


def data_bytes(url: str) -> int:
    folder = Path(url) / "data"
    return sum(os.path.getsize(folder / name) for name in os.listdir(folder))


def ok(results: list) -> list[dict]:
    assert all(r and r["ok"] for r in results), results
    return [r["value"] for r in results]


def test_hsdp_loads_read_each_byte_once_on_the_same_and_resharded_meshes(tmp_path) -> None:
    url = str(tmp_path / "hsdp")
    saved = ok(run_ranks("hsdp_save", 4, {"url": url, "mesh": [2, 2]}, worker=WORKER))[0]["digests"]
    stored = data_bytes(url)
    for world, mesh in ((4, [2, 2]), (3, [1, 3]), (4, [4, 1])):
        loaded = ok(run_ranks("hsdp_load", world, {"url": url, "mesh": mesh, "per_node": 2}, worker=WORKER))
        assert all(result["digests"] == saved for result in loaded), mesh
        read = sum(result["read"] for result in loaded)
        assert read <= 1.05 * stored, (mesh, read, stored)  # every rank on its own: 2x on [2, 2], 4x on [4, 1]
        assert sum(result["links"] for result in loaded) > 0  # one host: handed over in memory
    alone = ok(run_ranks("hsdp_load", 4, {"url": url, "mesh": [2, 2], "share": False}, worker=WORKER))
    assert all(result["digests"] == saved for result in alone)
    assert sum(result["read"] for result in alone) > 1.5 * stored  # what the switch is compared against


def test_replicated_plain_tensors_are_read_once_and_a_failing_or_dying_reader_fails_every_rank(tmp_path) -> None:
    url = str(tmp_path / "ddp")
    ok(run_ranks("ddp_save", 1, {"url": url}, worker=WORKER))
    # A budget of 64 KiB: several rounds, each reader filling one part of its region while the others are read.
    loaded = ok(run_ranks("ddp_load", 4, {"url": url, "share": True, "budget": 64 << 10}, worker=WORKER))
    assert all(result["equal"] for result in loaded)
    assert sum(result["read"] for result in loaded) <= 1.05 * data_bytes(url)
    assert sum(result["links"] for result in loaded) == 4 * 3  # all on this host: every hand-over in memory
    # Before its rounds, one gather carries what the ranks agree on (needs, nodes, hosts, knobs, regions' names) and
    # one the links they made (before: five gathers and two agreements, ~4 ms each on gloo here).
    assert all(result["setup"] == 2 for result in loaded), [result["setup"] for result in loaded]
    # Rank 1 declines shared memory (SHARDCKPT_SHARE_MEMORY=0) and rank 2's /dev/shm is full: what they fetch goes
    # through gloo (rank 2 still maps the others' regions), the rest in memory, in the same rounds.
    # Their max_in_flight differ too (the smallest cuts the rounds for all).
    mixed_args = {"url": url, "share": True, "no_shm_rank": 1, "full_shm_rank": 2}
    mixed_args["budget_by_rank"] = [64 << 10, 256 << 20, 1 << 20, 256 << 20]
    mixed = ok(run_ranks("ddp_load", 4, mixed_args, worker=WORKER))
    assert all(result["equal"] for result in mixed)
    assert sum(result["read"] for result in mixed) <= 1.05 * data_bytes(url)
    assert 0 < sum(result["links"] for result in mixed) < 4 * 3
    one_node = ok(run_ranks("ddp_load", 4, {"url": url}, worker=WORKER))  # the default on one node: each its own
    assert all(result["equal"] for result in one_node)
    assert sum(result["read"] for result in one_node) == 4 * sum(result["read"] for result in loaded)
    # Rank 0 fetches the bytes (one segment, the least loaded of its consumers, ties to the lower rank).
    failed = run_ranks("ddp_load", 4, {"url": url, "fail_rank": 0, "per_node": 1}, worker=WORKER)
    assert all(r is not None and not r["ok"] for r in failed), failed
    for result in failed:
        assert "DistributedError" in result["error"] and "injected I/O error" in result["error"], result["error"]
    # Rank 2 dies once it has fetched its share, before the round's vote: the others, waiting in that vote, raise.
    results = run_ranks("ddp_load", 4, {"url": url, "share": True, "die_rank": 2}, worker=WORKER, timeout=90)
    assert results[2] is None  # dead: no verdict
    for result in results[:2] + results[3:]:
        assert result is not None and not result["ok"], result
        assert result["error"].startswith("DistributedError: a collective failed"), result["error"]
    # Rank 1 runs out of memory assembling its second round (16 KiB segments: several rounds), after that round's
    # vote: it still joins the rounds the others run, and every rank raises its error at the end (before: rank 1
    # left the exchange, the others waited for the group's timeout and raised a timeout without its error).
    env = {str(rank): {"SHARDCKPT_MAX_REQUEST": "16384"} for rank in range(3)}
    oom_args = {"url": url, "share": True, "budget": 64 << 10, "oom_rank": 1, "env_by_rank": env, "timeout": 30}
    results = run_ranks("ddp_load", 3, oom_args, worker=WORKER, timeout=90)
    for result in results:
        assert result is not None and not result["ok"], result
        assert "rank 1: MemoryError: injected" in result["error"], result["error"]


@pytest.mark.parametrize("where", ["handover", "region"])
def test_a_rank_without_memory_to_set_up_a_shared_round_fails_every_rank(tmp_path, where: str) -> None:
    # Rank 1 cannot allocate what it needs before a collective of the exchange: the second round's buffers for the
    # group's all_to_all (every hand-over goes through the group here), or its /dev/shm region before the ranks
    # gather the regions' names. Before, it left the exchange and rank 0 waited in that collective until the
    # group's timeout (a short one here: the test then fails in seconds, not minutes).
    url = str(tmp_path / "ddp")
    ok(run_ranks("ddp_save", 1, {"url": url}, worker=WORKER))
    env = {str(rank): {"SHARDCKPT_MAX_REQUEST": "16384"} for rank in range(2)}
    oom_args = {"url": url, "share": True, "budget": 64 << 10, "oom_rank": 1, "oom_at": where, "timeout": 20}
    oom_args.update(env_by_rank=env, no_shm_rank="all" if where == "handover" else None)
    results = run_ranks("ddp_load", 2, oom_args, worker=WORKER, timeout=60)
    for result in results:
        assert result is not None and not result["ok"], result
        assert result["error"].startswith("DistributedError: load failed on 1 rank(s): rank 1: MemoryError: injected")


def test_a_reader_reads_on_while_a_slow_peer_still_uses_an_earlier_round(tmp_path) -> None:
    url = str(tmp_path / "ddp")
    ok(run_ranks("ddp_save", 1, {"url": url}, worker=WORKER))
    # 8 KiB segments in 16 KiB rounds (64 KiB / SHARE_DEPTH 4): each of 2 ranks fetches one segment a round, ~12
    # rounds. Rank 1 takes 1 s over its first round's hand-over; rank 0 fetches its next three rounds meanwhile, into
    # the other parts of its region (before: one round ahead only, so its third round's read waited for the second
    # round's vote, which waited for rank 1: a reader stalled at every vote for its slowest peer).
    env = {str(rank): {"SHARDCKPT_MAX_REQUEST": "8192"} for rank in range(2)}
    slow = {"url": url, "share": True, "budget": 64 << 10, "slow_rank": 1, "slow_seconds": 1.0, "env_by_rank": env}
    loaded = ok(run_ranks("ddp_load", 2, slow, worker=WORKER))
    assert all(result["equal"] for result in loaded)  # bit-exact: no part of a region reused while still read
    reads = loaded[0]["reads"]  # when rank 0 finished fetching each round, from its first
    assert len(reads) >= 6, reads
    assert reads[3] < 0.5, reads  # rounds 1-3 fetched while rank 1 still used round 0
    assert reads[4] >= 1.0, reads  # no further: round 4 reuses round 0's part, only once every rank is done with it
    # Every byte a rank fetched was announced to the kernel rounds before (its segments are every other chunk of the
    # file, which the kernel's read-ahead does not follow; before, each rank waited on one read at a time).
    assert all(result["hinted"] == result["read"] > 0 for result in loaded), loaded


def test_overlapping_flat_partitions_and_an_incremental_checkpoint_are_read_once(tmp_path) -> None:
    # DeepSpeed-style flat partitions saved on 2 ranks, loaded on 3 whose ranges overlap by 3,000 elements each side
    # (the shared bytes span pieces of several parameters); nothing is handed over in memory here (gloo only).
    url = str(tmp_path / "flat")
    ok(run_ranks("flat_save", 2, {"url": url}, worker=WORKER))
    loaded = ok(run_ranks("flat_load", 3, {"url": url, "overlap": 3000, "no_shm_rank": "all"}, worker=WORKER))
    assert all(result["equal"] for result in loaded)
    assert sum(result["read"] for result in loaded) <= 1.05 * data_bytes(url)
    assert sum(result["links"] for result in loaded) == 0
    # An incremental checkpoint: six of its twelve tensors are stored by reference in its parent's data file.
    parent, child = str(tmp_path / "root" / "step-1"), str(tmp_path / "root" / "step-2")
    ok(run_ranks("incremental_save", 1, {"url": child, "parent": parent}, worker=WORKER))
    assert data_bytes(child) < 0.6 * data_bytes(parent)  # the child's own file holds only the changed tensors
    # verify_first keeps every request until all are verified, and a 48 KiB budget makes one round per segment:
    # rank 1 reads six rounds in a row, refilling each part of its region that kept requests were handed over in.
    loaded = ok(run_ranks("incremental_load", 2, {"url": child, "budget": 48 << 10}, worker=WORKER))
    assert all(result["equal"] for result in loaded)
    needed = 12 * 128 * 96 * 4
    assert sum(result["read"] for result in loaded) <= 1.05 * needed  # alone: 2x
    assert sum(result["links"] for result in loaded) > 0


def test_a_flipped_bit_in_a_shared_range_is_caught_by_every_rank_that_uses_it(tmp_path) -> None:
    url = str(tmp_path / "ddp")
    ok(run_ranks("ddp_save", 1, {"url": url}, worker=WORKER))
    data = next((Path(url) / "data").iterdir())
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one bit of one replicated tensor, fetched by one rank for all four
    data.chmod(0o644)
    data.write_bytes(bytes(raw))
    failed = run_ranks("ddp_load", 4, {"url": url, "per_node": 1}, worker=WORKER)
    assert all(r is not None and not r["ok"] for r in failed), failed
    for result in failed:  # every rank verified the bytes it was handed, and every rank names all four failures
        # (one error of several ranks is named once: "ranks 0-3: IntegrityError ...")
        assert "DistributedError" in result["error"] and "ranks 0-3: IntegrityError" in result["error"], result


def test_ranks_that_disagree_on_share_reads_all_fail_at_once_instead_of_hanging(tmp_path) -> None:
    url = str(tmp_path / "ddp")
    ok(run_ranks("ddp_save", 1, {"url": url}, worker=WORKER))
    failed = run_ranks("ddp_load", 3, {"url": url, "share_by_rank": [True, False, None]}, worker=WORKER, timeout=90)
    assert all(r is not None and not r["ok"] for r in failed), failed
    for result in failed:
        assert "DistributedError" in result["error"] and "share_reads differs" in result["error"], result["error"]
    # A rank whose SHARDCKPT_SHARE_MIN_SAVING finds sharing not worth it: no rank shares, none waits for the others.
    loaded = ok(run_ranks("ddp_load", 3, {"url": url, "share": True, "stingy_rank": 1}, worker=WORKER, timeout=90))
    assert all(result["equal"] for result in loaded)
    assert sum(result["links"] for result in loaded) == 0
    assert sum(result["read"] for result in loaded) >= 3 * 6 * 96 * 80 * 4  # each rank all six tensors itself
    # Ranks whose environments differ (SHARDCKPT_MAX_REQUEST cuts the shared segments, SHARDCKPT_SHARE_ROUND the
    # rounds, SHARDCKPT_SHARE_DEPTH the parts of a region) still plan one exchange (before: rank 0 cut 4 KiB
    # segments, the others 8 MiB ones, and gloo aborted it).
    env = {"0": {"SHARDCKPT_MAX_REQUEST": "4096"}, "1": {"SHARDCKPT_SHARE_DEPTH": "2"}}
    env["2"] = {"SHARDCKPT_SHARE_ROUND": "65536"}
    loaded = ok(run_ranks("ddp_load", 3, {"url": url, "share": True, "env_by_rank": env}, worker=WORKER, timeout=90))
    assert all(result["equal"] for result in loaded)
    assert sum(result["read"] for result in loaded) <= 1.05 * data_bytes(url)
    # One rank's SHARDCKPT_SHARE_DEPTH is refused (at least 2): every rank raises it at once (before: that rank
    # raised alone and the others waited in the exchange's first gather for the group's timeout, 20 s here); a load
    # that does not share (the default, on one node) does not read it.
    env = {"1": {"SHARDCKPT_SHARE_DEPTH": "1"}}
    refused_args = {"url": url, "share": True, "env_by_rank": env, "timeout": 20}
    for result in run_ranks("ddp_load", 2, refused_args, worker=WORKER, timeout=60):
        assert result is not None and not result["ok"], result
        assert "rank 1: ShardckptUsageError: SHARDCKPT_SHARE_DEPTH='1'" in result["error"], result["error"]
    loaded = ok(run_ranks("ddp_load", 2, {"url": url, "env_by_rank": env}, worker=WORKER, timeout=60))
    assert all(result["equal"] for result in loaded)


def test_a_compressed_checkpoint_saved_by_2_ranks_loads_bit_exact_on_3_even_when_sharing_is_asked(tmp_path) -> None:
    """Compressed files (SPEC 4.1) are read unshared: a shared read would hand ranks stored blocks to use as raw."""
    url = str(tmp_path / "ddp")
    ok(run_ranks("ddp_save", 2, {"url": url, "compression": "zstd"}, worker=WORKER))
    assert shardckpt.open(url).manifest.files[1].logical_size is not None
    loaded = ok(run_ranks("ddp_load", 3, {"url": url, "share": True}, worker=WORKER))
    assert all(result["equal"] for result in loaded), loaded


def test_a_raw_child_referencing_a_compressed_parent_loads_bit_exact_on_3_ranks_unshared(tmp_path) -> None:
    """A raw 2-rank child stores every piece by reference to its compressed parent (SPEC 6.2, format 1.2); a 3-rank
    load asked to share reads it unshared, as a compressed file (before: pieces written anew, nothing referenced)."""
    parent, child = str(tmp_path / "run" / "step-1"), str(tmp_path / "run" / "step-2")
    ok(run_ranks("ddp_save", 2, {"url": parent, "compression": "zstd", "piece_hashes": True}, worker=WORKER))
    ok(run_ranks("ddp_save", 2, {"url": child, "parent": parent, "step": 2}, worker=WORKER))
    manifest = shardckpt.open(child).manifest
    assert manifest.references and all(entry.file.logical_size is not None for entry in manifest.references)
    assert manifest.version == (1, 2) and manifest.total_bytes < 2048  # headers only: every piece is referenced
    loaded = ok(run_ranks("ddp_load", 3, {"url": child, "share": True}, worker=WORKER))
    assert all(result["equal"] for result in loaded), loaded


def test_overlapping_requests_of_one_rank_each_get_every_byte_of_a_shared_segment() -> None:
    """A rank's requests may overlap (a column slice's strided rows read in requests cut at max_request share their
    edge blocks). A segment that starts inside the first request where the second one starts, fetched by another
    reader than the segment before it, fills both (before: only the second; the first stayed incomplete and the
    load failed with "shared read left 1 requests incomplete")."""
    requests = [ReadRequest(0, 0, 100, (), ()), ReadRequest(0, 60, 200, (), ())]
    share = plan_shared_reads([[(0, 0, 100), (0, 60, 200)], [(0, 0, 200)]], chunk=1000)
    assert [(s.start, s.reader) for s in share.segments] == [(0, 0), (60, 1)]  # a new reader where request 1 starts
    stored = np.arange(200, dtype=np.uint8)
    assembly = _Assembly(requests)
    for segment in share.segments:
        assembly.place(segment, stored, segment.start, False)
    done = dict(assembly.settle(keep=True))
    assert sorted(done) == [0, 1]
    assert np.array_equal(done[0], stored[0:100]) and np.array_equal(done[1], stored[60:200])


def test_an_offer_of_another_shape_is_a_typed_error_naming_its_rank() -> None:
    # A rank running another shardckpt sends an offer with other fields: every rank decodes the same gather and
    # raises the same typed error (before the Offer fields were checked: a TypeError from the tuple's arity).
    good = Offer("node-0", None, 4096, [(0, 0, 10)], 2, 4096, 0.05, ("", 0), None, None).encode()
    assert read_offers([good])[0].needs == ((0, 0, 10),)
    with pytest.raises(DistributedError, match="rank 1: its shared-read offer has another shape"):
        read_offers([good, msgpack.packb(["node-1", None, 4096])])


def test_replicated_tensors_on_s3_are_fetched_once_over_the_job_and_load_bit_exact(s3_url) -> None:
    # The object-store path of the exchange (range GETs into the readers' regions, every rank on this host linked):
    # SeaweedFS started by the fixtures, the AWS variables reaching the ranks through the environment.
    url = f"{s3_url}/ddp"
    ok(run_ranks("ddp_save", 1, {"url": url}, worker=WORKER))
    shared = ok(run_ranks("ddp_load", 4, {"url": url, "share": True, "budget": 64 << 10}, worker=WORKER))
    alone = ok(run_ranks("ddp_load", 4, {"url": url, "share": False}, worker=WORKER))
    assert all(result["equal"] for result in shared + alone)
    assert sum(result["links"] for result in shared) == 4 * 3
    one_copy = alone[0]["fetched"]  # every rank loads every tensor: what each fetched on its own
    assert all(result["fetched"] == one_copy for result in alone) and one_copy > 0
    assert sum(result["fetched"] for result in shared) <= 1.05 * one_copy  # before sharing: 4x


def test_a_region_a_killed_rank_left_in_dev_shm_is_removed_by_the_next_shared_read() -> None:
    # kill -9 between making its region and the setup's last gather (outside attack ashare) left the file for good.
    names = [f"{host_memory.PREFIX}999999999-{token}" for token in ("orphan", "young")]
    for name in names:
        with open(os.path.join(host_memory.SHM_DIR, name), "wb") as file:
            file.write(b"x")
    old = time.time() - host_memory.ORPHAN_AGE - 60
    os.utime(os.path.join(host_memory.SHM_DIR, names[0]), (old, old))
    try:
        region = host_memory.Region.create(4096)
        assert region is not None
        region.release()
        left = set(os.listdir(host_memory.SHM_DIR))
        assert names[0] not in left and names[1] in left  # one made within ORPHAN_AGE may be a setup running now
    finally:
        for name in names:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(host_memory.SHM_DIR, name))
