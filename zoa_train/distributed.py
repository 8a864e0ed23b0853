"""Process-group set-up: run in-process under torchrun, or start local ranks through torch's elastic launcher."""

import os
import uuid

import torch
import torch.distributed as dist


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def launched_externally() -> bool:
    """True when a launcher (torchrun) already set this process's rank and world size."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_process_group(backend: str | None = None) -> torch.device:
    """Join the process group described by the environment; returns this rank's device."""
    backend = backend or default_backend()
    device = torch.device("cpu")
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend)
    return device


def launch_local(entrypoint, nproc: int, *args):
    """Run entrypoint(*args) on `nproc` local ranks (elastic launcher, c10d rendezvous on a free port).

    Returns the list of the ranks' return values, ordered by rank. The entrypoint must be a
    module-level function: ranks are started with the spawn method.
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"zoa-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    results = elastic_launch(config, entrypoint)(*args)
    return [results[rank] for rank in range(nproc)]


def threads_per_rank(nproc: int) -> int:
    """CPU threads each local rank should use so that ranks do not oversubscribe the cores."""
    return max(1, (os.cpu_count() or 1) // nproc)
