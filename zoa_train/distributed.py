"""Process groups: join one started by torchrun or srun, or start local ranks through torch's elastic launcher.

Cluster environments are recognised from their variables:
  torchrun  RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
  srun      SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; the master is the job's first node
            (SLURM_JOB_NODELIST, expanded by `scontrol show hostnames`) and MASTER_PORT or 29500.
"""

import contextlib
import inspect
import multiprocessing
import os
import re
import signal
import subprocess
import threading
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from zoa_train.errors import UserError

# What schedulers send before they kill (Slurm: --signal=USR1@120; zoa-train's Slurm scripts use USR2):
# every rank checkpoints at one agreed step and exits (train/trainer.py).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def cluster_environment() -> str | None:
    """'torchrun', 'slurm' or None (not started by a launcher)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return "torchrun"
    if "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ and "SLURM_STEP_ID" in os.environ:
        return "slurm"
    return None


def first_slurm_node(nodelist: str) -> str:
    """The first host of a Slurm node list such as 'gpu[003-010,012],cpu1'."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
        return out.stdout.split()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        match = re.match(r"([^,\[]+)(?:\[(\d+))?", nodelist)
        if not match:
            raise ValueError(f"cannot read the Slurm node list {nodelist!r}") from None
        return match.group(1) + (match.group(2) or "")


def export_slurm_environment() -> None:
    """Translate srun's variables into the ones torch.distributed reads."""
    os.environ.setdefault("RANK", os.environ["SLURM_PROCID"])
    os.environ.setdefault("WORLD_SIZE", os.environ["SLURM_NTASKS"])
    os.environ.setdefault("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
    per_node = re.match(r"\d+", os.environ.get("SLURM_STEP_TASKS_PER_NODE") or os.environ.get("SLURM_NTASKS_PER_NODE") or "")
    if per_node:  # "4" or "4(x2)": tasks on each node
        os.environ.setdefault("LOCAL_WORLD_SIZE", per_node.group())
    os.environ.setdefault("MASTER_ADDR", first_slurm_node(os.environ.get("SLURM_JOB_NODELIST", "127.0.0.1")))
    os.environ.setdefault("MASTER_PORT", "29500")


def cuda_device_index(local_rank: int, local_world_size: int, visible: int) -> int:
    """The GPU this rank uses among the `visible` ones: its local rank when every local rank has
    a GPU of its own; 0 when each process sees exactly one (srun --gpus-per-task 1, or
    CUDA_VISIBLE_DEVICES set per rank); otherwise a UserError."""
    if visible == 0:
        raise UserError("the nccl backend needs a GPU and this process sees none; use train.backend gloo to train on CPUs.")
    if local_world_size <= visible:
        return local_rank
    if visible == 1:
        return 0
    raise UserError(
        f"{local_world_size} ranks on this machine but {visible} GPUs visible to each; start at most {visible} "
        "ranks per machine (or give each rank its own GPU)."
    )


def init_process_group(backend: str | None = None, timeout_s: float | None = None, **kwargs) -> torch.device:
    """Join the process group described by the environment (or by torch's `init_process_group`
    keyword arguments); returns this rank's device. `timeout_s` bounds how long a collective may
    wait for the other ranks (NCCL's watchdog then fails the run); it must exceed the longest
    pause of any rank, such as writing a large checkpoint."""
    # torch._dynamo (which torch.optim imports on first use) keeps references to the world group
    # when it is first imported after the group exists; destroy_process_group then cannot free the
    # group, Gloo's worker threads outlive the interpreter, and a rank aborts at exit ("terminate
    # called without an active exception") about one run in twenty. Importing it first avoids that.
    import torch._dynamo  # noqa: F401

    if cluster_environment() == "slurm":
        export_slurm_environment()
    backend = backend or default_backend()
    device = torch.device("cpu")
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        device = torch.device("cuda", cuda_device_index(local_rank, local_world, torch.cuda.device_count()))
        torch.cuda.set_device(device)
        kwargs.setdefault("device_id", device)  # binds the group to this GPU (eager NCCL init)
    if timeout_s is not None:
        kwargs["timeout"] = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        if restart_count() and shares_agent_store() and not {"init_method", "store"} & kwargs.keys():
            # torch elastic's c10d rendezvous keeps one TCP store for every attempt, and the group's
            # keys are the same in each: a restarted rank could read a dead rank's address from the
            # attempt before and fail to connect. Each attempt gets keys of its own. (Without the shared
            # store, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, every attempt's rank 0 starts a store of its own.)
            from torch.distributed.rendezvous import rendezvous

            store, rank, world = next(rendezvous("env://", timeout=kwargs.get("timeout", timedelta(minutes=30))))
            kwargs.update(store=dist.PrefixStore(f"zoa_train/attempt_{restart_count()}", store), rank=rank, world_size=world)
        dist.init_process_group(backend, **kwargs)
    return device


def restart_count() -> int:
    """How many times torch elastic (torchrun --max-restarts, zoa-train run --max-restarts) has
    restarted this rank's worker group: 0 on the first attempt and outside torch elastic."""
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(count) if count.isdigit() else 0


def shares_agent_store() -> bool:
    """Whether this rank's process group meets in the TCP store that torch elastic's agents keep for every
    attempt (their default), rather than in a store of this attempt's own."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def launch_local(entrypoint, nproc: int, *args, max_restarts: int = 0):
    """Run entrypoint(*args) on `nproc` local ranks (elastic launcher, c10d rendezvous on a free port).

    Returns the list of the ranks' return values, ordered by rank. The entrypoint must be a
    module-level function: ranks are started with the spawn method. When a rank fails (an exception,
    a signal such as SIGKILL) torch elastic stops the others (SIGTERM, then SIGKILL after 30 s) and
    starts all `nproc` again, up to `max_restarts` times; the entrypoint sees restart_count() > 0.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # A stop signal sent to this launcher (a scheduler's warning, kill PID) is passed on to the ranks,
    # which agree on a step, checkpoint and return; the launcher keeps collecting their results. (Left
    # to torch elastic, it would shut the ranks down instead, and a rank that has returned waits for a
    # parent that no longer reads its result until the shutdown timeout kills it: two minutes.)
    stopped: list[int] = []

    def pass_on(signum, frame):
        stopped.append(signum)
        for rank in multiprocessing.active_children():  # the ranks torch elastic started from this process
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank.pid, signum)

    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, pass_on) for sig in STOP_SIGNALS} if in_main_thread else {}

    options = dict(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"zoa-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        # Hard stops: torch elastic passes them on and shuts the ranks down (STOP_GRACE_S at most).
        signals_to_handle="SIGINT,SIGHUP,SIGQUIT",
        shutdown_timeout=STOP_GRACE_S,
    )
    # Releases before torch 2.12 lack the last two (torch elastic then handles its default signals and
    # waits its own shutdown time): the launch works without them.
    known = set(inspect.signature(LaunchConfig).parameters)
    config = LaunchConfig(**{key: value for key, value in options.items() if key in known})
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        with rank_threads(nproc):
            results = elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as e:
        if stopped:  # a rank that did not stop cleanly after the signal
            raise LauncherSignalled(stopped[0]) from None
        raise RankFailed(_root_cause(e)) from None
    except SignalException as e:
        raise LauncherSignalled(e.sigval) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if stopped:
        raise LauncherSignalled(stopped[0])
    return [results[rank] for rank in range(nproc)]


@contextmanager
def rank_threads(nproc: int) -> Iterator[None]:
    """OMP_NUM_THREADS for the `nproc` ranks this process starts meanwhile. Threads that Gloo starts run part of
    a step too (the callbacks of DDP comm hooks: PowerSGD's matrix products); with OMP_NUM_THREADS set before
    the ranks start they take as many threads as a rank's main thread, so a result does not depend on which
    thread ran it (as under torchrun, which sets it)."""
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads_per_rank(nproc))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = before


STOP_GRACE_S = 120  # how long the ranks get to checkpoint after the launcher is signalled


class RankFailed(RuntimeError):
    """A rank started by launch_local failed; the message is its exception's."""


class LauncherSignalled(RuntimeError):
    """launch_local got a signal and passed it on to the ranks: after a stop signal they checkpointed and
    returned; after a hard one torch elastic shut them down (STOP_GRACE_S at most)."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


def _root_cause(error) -> str:
    """The first failed rank's exception message, without the traceback elastic records."""
    _, failure = error.get_first_failure()
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    text = str(message).strip()
    last = text.splitlines()[-1] if text else f"rank {failure.local_rank} exited with code {failure.exitcode}"
    return last.split(": ", 1)[1] if last.startswith(("CollectiveTimeout: ", "RuntimeError: ")) else last


def threads_per_rank(world_size: int) -> int:
    """CPU threads each rank on this machine should use so that the ranks do not oversubscribe
    the cores: an explicit OMP_NUM_THREADS (torchrun sets 1 when it starts several ranks) wins,
    else the cores are shared among LOCAL_WORLD_SIZE ranks (`world_size` when it is not set)."""
    explicit = os.environ.get("OMP_NUM_THREADS", "")
    if explicit.isdigit() and int(explicit) > 0:
        return int(explicit)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return max(1, (os.cpu_count() or 1) // local)


@dataclass(frozen=True)
class EvaluationRanks:
    """This process's place in an evaluation: rank `rank` of `world` on `device`."""

    device: torch.device
    rank: int
    world: int

    def share(self, items: Sequence) -> Sequence:
        """A contiguous slice of `items`: the ranks' slices cover every item once."""
        n = len(items)
        return items[self.rank * n // self.world : (self.rank + 1) * n // self.world]


@contextmanager
def evaluation_ranks() -> Iterator[EvaluationRanks]:
    """Join the process group of torchrun or srun for the length of an evaluation (and leave it after),
    or run alone as rank 0 of 1 on the GPU if there is one. CPU ranks share the cores."""
    if cluster_environment() is None:
        yield EvaluationRanks(torch.device("cuda" if torch.cuda.is_available() else "cpu"), 0, 1)
        return
    device = init_process_group()
    try:
        world = dist.get_world_size()
        if device.type == "cpu":
            torch.set_num_threads(threads_per_rank(world))
        yield EvaluationRanks(device, dist.get_rank(), world)
    finally:
        dist.destroy_process_group()
