"""Run a function on N Gloo ranks in fresh processes and collect each rank's return value."""

import gc
import os
import pickle
import socket
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zoa_train.distributed import init_process_group


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gloo_threads() -> list[str]:
    """Names of this process's Gloo threads (Linux; empty elsewhere)."""
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return []
    names = []
    for task in os.listdir(tasks):
        try:
            with open(os.path.join(tasks, task, "comm")) as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return [n for n in names if "gloo" in n]


def leftover_gloo_threads(grace_s: float = 10.0) -> list[str]:
    """Gloo threads still alive `grace_s` after the group was destroyed: a thread that is only finishing
    (its device freed a moment later, or by a garbage collection) ends within it; one whose group leaked
    never does."""
    deadline = time.monotonic() + grace_s
    while (names := gloo_threads()) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    return names


def _child(rank: int, world_size: int, port: int, outdir: str, call: bytes, sharded: bool, env: dict, cwd: str) -> None:
    # A fork server's child has the server's environment and directory, not the test's: a test that set a
    # variable (TRITON_INTERPRET, CXX) or changed directory expects its ranks to see it, as spawned ones did.
    # The function and its arguments are unpickled only then, since unpickling imports their modules, and
    # some read the environment when imported (Triton's kernels decide there whether they are interpreted).
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    fn, args = pickle.loads(call)
    torch.set_num_threads(1)
    try:
        init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        dist.barrier()
        dist.destroy_process_group()
        # A group that outlives destroy_process_group keeps Gloo's threads, which can abort the
        # process at exit when they release tensors after the interpreter has started shutting down.
        # FSDP2 (torch 2.14) keeps Gloo groups of its mesh alive after destroy_process_group (DTensor's
        # caches, and one held in C++): allowed for sharded runs.
        assert sharded or not leftover_gloo_threads(), f"Gloo threads still running after destroy_process_group: {gloo_threads()}"
        torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(outdir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def _context():
    """Ranks forked from a server that has imported torch (and torch._dynamo, which init_process_group
    imports) once: a tenth of a second each instead of a spawned interpreter's four seconds. Importing
    torch._dynamo imports Triton, whose library functions are compiled or interpreted as TRITON_INTERPRET
    says at that moment: ranks that need the interpreter are spawned (and the server never sees it)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo"])
    return ctx


def run_ranks(fn, world_size: int, *args, timeout: float = 300.0, sharded: bool = False) -> list:
    """fn(rank, world_size, *args) on each rank; returns the list of results ordered by rank.
    `sharded`: fn shards a model with FSDP2 (see _child)."""
    ctx = _context()
    port = free_port()
    env, cwd, call = dict(os.environ), os.getcwd(), pickle.dumps((fn, args))
    with tempfile.TemporaryDirectory() as outdir:
        procs = [ctx.Process(target=_child, args=(r, world_size, port, outdir, call, sharded, env, cwd)) for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
        errors = [open(os.path.join(outdir, f)).read() for f in sorted(os.listdir(outdir)) if f.endswith(".err")]
        if errors or any(p.exitcode != 0 for p in procs):
            raise RuntimeError("a rank failed:\n" + "\n".join(errors or [f"exit codes {[p.exitcode for p in procs]}"]))
        return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
