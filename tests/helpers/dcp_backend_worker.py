"""One rank of the DCP backend tests: `python tests/helpers/dcp_backend_worker.py SCENARIO ARGS_JSON` (torchrun env).

FSDP2 + AdamW saved with dcp.save / dcp.async_save through shardckpt.dcp.StorageWriter and DCP's FileSystemWriter,
loaded back with dcp.load on this job's world size; each rank writes its verdict as JSON (see tests/helpers/launch.py).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # run as a script

import shardckpt
import shardckpt.dcp
from shardckpt.format import layout
from shardckpt.storage.local import LocalStorage
from tests.helpers.launch import serve_rank

BLOCK_SIZE = 4096  # the smallest legal block: verified reads then need few bytes beyond a box's own
EXTRA = {"epoch": 3, "tag": "dcp", "blob": b"\x00\x01state", "history": [1.5, 2.5]}


def build(seed: int, lr: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model of every DCP backend test; FSDP2-sharded when a process group runs (one process: plain)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(1536, 96), nn.Linear(96, 7), nn.ReLU(), nn.Linear(7, 5), nn.LayerNorm(5))
    if dist.is_initialized():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in (model[0], model[1], model[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)


def trained_state() -> tuple[dict[str, Any], nn.Module, torch.optim.Optimizer]:
    model, optimizer = build(0, 0.01)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    tokens = torch.randint(0, 1536, (12, 3), generator=torch.Generator().manual_seed(100))
    model(tokens.chunk(world)[rank]).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    msd, osd = get_state_dict(model, optimizer)
    # Each rank's data-loader position under its own key, as torchtitan keeps it: one container, parts per rank.
    loader = {f"dp_rank_{rank}": bytes([rank]) * 3}
    return {"model": msd, "optim": osd, "extra": dict(EXTRA), "dataloader": loader}, model, optimizer


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    msd, osd = get_state_dict(model, optimizer)
    flat = {f"model.{name}": value for name, value in msd.items()}
    flat.update({f"optim.{fqn}.{key}": value for fqn, state in osd["state"].items() for key, value in state.items()})
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in flat.items()}
    return {k: v.detach().clone().contiguous() for k, v in full.items()}


def loaded(reader: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A fresh model and optimizer (other values everywhere) filled by dcp.load through `reader`."""
    model, optimizer = build(1, 0.5)
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd, "extra": {"epoch": 0, "tag": "", "blob": b"", "history": [0.0, 0.0]}}
    state["dataloader"] = {"dp_rank_0": b"", "dp_rank_1": b""}
    dcp.load(state, storage_reader=reader)
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
    groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    return full_state(model, optimizer), {
        "extra": state["extra"],
        "param_groups": groups,
        "loader": state["dataloader"],
    }


def compare(tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ (dtype, shape or any bit), or that one side lacks."""
    wrong = sorted(set(tensors) ^ set(expected))
    for name in sorted(set(tensors) & set(expected)):
        a, b = tensors[name], expected[name]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            wrong.append(name)
    return wrong


class CountingReader(shardckpt.dcp.StorageReader):
    """Counts the tensor bytes DCP's ReadItems ask for (needed); data-file bytes are counted at the storage."""

    needed = 0

    def read_metadata(self) -> Any:
        metadata = super().read_metadata()
        self.itemsize = {
            name: torch.empty(0, dtype=entry.properties.dtype).element_size()
            for name, entry in metadata.state_dict_metadata.items()
            if hasattr(entry, "properties")
        }
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        for item in plan.items:
            if item.type.name == "TENSOR":
                CountingReader.needed += math.prod(item.lengths) * self.itemsize[item.storage_index.fqn]
        return super().read_data(plan, planner)


@contextlib.contextmanager
def counting_data_reads() -> Iterator[list[int]]:
    """Bytes read from data files (local storage) while inside, in the list's one element."""
    original, count = LocalStorage.pread_into, [0]

    def pread_into(self: LocalStorage, fd: int, path: str, start: int, out: memoryview) -> None:
        if path.startswith(f"{layout.DATA_DIR}/"):
            count[0] += memoryview(out).nbytes
        original(self, fd, path, start, out)

    LocalStorage.pread_into = pread_into  # type: ignore[method-assign]
    try:
        yield count
    finally:
        LocalStorage.pread_into = original  # type: ignore[method-assign]


class FailingWriter(shardckpt.dcp.StorageWriter):
    def write_data(self, plan: Any, planner: Any) -> Any:
        if plan.storage_data["rank"] == 1:
            raise RuntimeError("injected failure in write_data on rank 1")
        return super().write_data(plan, planner)


def _refusal(run: Any) -> dict[str, Any]:
    """What a save that DCP must fail on every rank raised here: the exception and each failed rank's cause."""
    try:
        run()
    except CheckpointException as exc:
        return {"raised": "CheckpointException", "causes": {r: type(e[0]).__name__ for r, e in exc.failures.items()}}
    return {"raised": None}


def scenario_save(args: dict, rank: int, world: int) -> dict:
    """Save once through each path, fail one save on rank 1, refuse a save into a committed URL, then supersede it,
    load on 2 ranks."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    state, model, optimizer = trained_state()
    dcp.save(state, storage_writer=shardckpt.dcp.StorageWriter(args["ours"], step=7, block_size=BLOCK_SIZE))
    dcp.save(state, storage_writer=dcp.FileSystemWriter(args["fs"]))
    dcp.save(state, storage_writer=shardckpt.dcp.StorageWriter(args["s3"], step=7, block_size=BLOCK_SIZE))
    thread = shardckpt.dcp.StorageWriter(args["thread"], step=7, block_size=BLOCK_SIZE)
    dcp.async_save(state, storage_writer=thread).result()
    process = shardckpt.dcp.StorageWriter(args["process"], step=7, block_size=BLOCK_SIZE)
    stager = DefaultStager(StagingOptions(False, True, False, False))  # shared memory for the child, CPU only
    try:
        dcp.async_save(
            state, storage_writer=process, async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=stager
        ).result()
    finally:
        stager.close()
        _stop_checkpoint_process()
    reference = full_state(model, optimizer)  # collective: every rank gathers
    if rank == 0:
        save_file(reference, args["reference"])
    dist.barrier()
    failed = _refusal(lambda: dcp.save(state, storage_writer=FailingWriter(args["failed"], block_size=BLOCK_SIZE)))
    refused = _refusal(
        lambda: dcp.save(state, storage_writer=shardckpt.dcp.StorageWriter(args["ours"], supersede=False))
    )
    # Ranks whose StorageWriters name different steps (before: the coordinator's step was committed silently).
    differs: dict[str, Any] = {"raised": None}
    try:
        writer = shardckpt.dcp.StorageWriter(args["differs"], step=7 + rank, block_size=BLOCK_SIZE)
        dcp.save(state, storage_writer=writer)
    except CheckpointException as exc:
        differs = {"raised": "CheckpointException", "causes": {r: repr(e[0]) for r, e in exc.failures.items()}}
    # As DCP overwrites: the same URL saved again supersedes the committed checkpoint (SPEC 14.2); loads read it.
    dcp.save(state, storage_writer=shardckpt.dcp.StorageWriter(args["ours"], step=7, block_size=BLOCK_SIZE))
    # The state dict exactly as given to dcp.save (this rank's own key of one dict) loads with shardckpt.load.
    same = {"dataloader": {f"dp_rank_{rank}": b""}, "extra": {"epoch": 0, "tag": "", "blob": b"", "history": []}}
    shardckpt.load(same, args["ours"])
    return {"failed": failed, "refused": refused, "differs": differs, "loads": load_all(args), "same": _jsonable(same)}


def _stop_checkpoint_process() -> None:
    """End async_save's checkpoint process now: this rank leaves with os._exit, which skips DCP's own cleanup."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    process = executor._CHECKPOINT_PROCESS
    if process is not None:
        process.__del__()
        executor._CHECKPOINT_PROCESS = None


def load_all(args: dict) -> dict[str, Any]:
    """Each checkpoint loaded through shardckpt's reader, the FileSystemWriter one through DCP's own reader: the
    tensors that differ from the saved reference, the values, and data bytes read per byte needed (ours)."""
    reference = load_file(args["reference"])
    out: dict[str, Any] = {}
    tensors, values = loaded(dcp.FileSystemReader(args["fs"]))
    out["dcp"] = {"wrong": compare(tensors, reference), "values": _jsonable(values)}
    for label in ("ours", "thread", "process", "s3"):
        CountingReader.needed = 0
        with counting_data_reads() as read:
            tensors, values = loaded(CountingReader(args[label]))
        out[label] = {
            "wrong": compare(tensors, reference),
            "values": _jsonable(values),
            "read": read[0],
            "needed": CountingReader.needed,
        }
    return out


def scenario_load(args: dict, rank: int, world: int) -> dict:
    return load_all(args)


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return {"tensor": value.tolist()}
    return value


def main() -> None:
    serve_rank(globals(), default_timeout=90)


if __name__ == "__main__":
    main()
