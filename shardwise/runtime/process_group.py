"""The device and the process group of a run: which device this rank trains on, and joining
the launcher's process group (torchrun, `shardwise train --nproc`, Slurm) when there is one."""

from __future__ import annotations

import atexit
import threading

import torch
import torch.distributed as dist

from shardwise.core.errors import invalid
from shardwise.runtime.launch import RankEnvironment, rank_environment


def resolve_device(name: str) -> torch.device:
    """`train.device`: auto (the accelerator if present, else cpu), or a torch device name."""
    if name == "auto":
        accel = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        return accel if accel is not None else torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise invalid("train.device", name, "use auto, cpu, cuda, cuda:N or another torch device name") from None
    if device.type != "cpu" and not torch.accelerator.is_available():
        raise invalid("train.device", name, "no accelerator is available here; use cpu or auto")
    return device


def backend_for(device: torch.device) -> str:
    """gloo on CPU, nccl on CUDA, and whatever torch registers for other accelerators."""
    return dist.get_default_backend_for_device(device)


def init_distributed(device_name: str, launched: RankEnvironment | None = None) -> tuple[torch.device, int, int]:
    """(device, rank, world size). Under a launcher (`launched.world_size` > 1; by default what
    `rank_environment` reads) this joins the process group, unless the caller already created one
    (the test harness does)."""
    launched = launched if launched is not None else rank_environment()
    device = resolve_device(device_name)
    if launched.world_size > 1 and device.type != "cpu":
        device = torch.device(device.type, launched.local_rank)
        torch.accelerator.set_device_index(launched.local_rank)
    if launched.world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend=backend_for(device))
        atexit.register(release_process_group)
    if dist.is_initialized():
        return device, dist.get_rank(), dist.get_world_size()
    return device, 0, 1


RELEASE_WAIT_S = 10.0
"""How long a process's exit waits for its process group's teardown before going on without it."""


def release_process_group() -> None:
    """The process group this process joined, destroyed before the interpreter is torn down. Left to
    finalization, gloo's worker threads can still hold finished work whose tensors reference Python
    objects; destroying them then aborts the process ("terminate called without an active exception",
    exit status 134; pytorch#190489): seen at the end of `serve` and `generate` under tensor parallelism
    on a loaded host. A teardown that does not end (a peer's op never finishing) is left behind after
    RELEASE_WAIT_S rather than holding the exit."""
    if not (dist.is_available() and dist.is_initialized()):
        return

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except Exception:  # a peer already gone: there is nothing left to release
            pass

    worker = threading.Thread(target=destroy, name="shardwise-release-process-group", daemon=True)
    worker.start()
    worker.join(RELEASE_WAIT_S)


def barrier(world_size: int) -> None:
    if world_size > 1:
        dist.barrier()
