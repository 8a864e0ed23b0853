"""`zoa-train run`: check a recipe against this machine, start its ranks (here, or as one rank of
torchrun/srun), and say how the run ended. Bad input is a UserError of one sentence (exit 2); the
other endings are exit codes the CLI passes on."""

import os
import signal
from dataclasses import dataclass
from pathlib import Path

import torch

from zoa_train import console
from zoa_train.config import check_batch_layout, live_shrink_warning, load_recipe
from zoa_train.distributed import STOP_SIGNALS, LauncherSignalled, RankFailed, cluster_environment, first_slurm_node, launch_local, shares_agent_store
from zoa_train.errors import UserError
from zoa_train.files import check_directory, dumps_json
from zoa_train.train.live import launch_live
from zoa_train.train.rundir import RunDirectory
from zoa_train.train.trainer import EXIT_PREEMPTED, CollectiveTimeout, run_rank


def check_elastic_launch(overwrite: bool) -> None:
    """What train.elastic reshard needs of torchrun: its agents start the ranks again with the same command line
    whenever a node leaves or joins (the restart count rises only after a failure), so the command must
    resume rather than empty the run directory, and each attempt needs a store of its own (an agent that
    joins later counts its attempts from 0)."""
    if overwrite:
        raise UserError(
            "train.elastic reshard under torchrun: the agents start the ranks again with the same command line whenever a node joins, "
            "and --overwrite would empty the run directory each time; pass --resume auto instead (it starts at step 0 where there is no checkpoint)."
        )
    if shares_agent_store():
        raise UserError(
            "train.elastic reshard under torchrun needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the agents' environment, so that each "
            "attempt's ranks meet in a store of their own; with the agents' shared store a node that joins later would not find the others."
        )


@dataclass(frozen=True)
class LiveMachines:
    """A train.elastic live run on several machines: `nnodes` of them, this one `node_rank`, meeting in the store
    machine 0 keeps at `store` (HOST:PORT)."""

    nnodes: int = 1
    node_rank: int = 0
    store: str | None = None

    def check(self, elastic: str) -> None:
        if (self.nnodes, self.node_rank, self.store) == (1, 0, None):
            return
        if elastic != "live":
            raise UserError(
                "--nnodes, --node-rank and --store start a train.elastic live run on several machines; other runs span machines under torchrun or srun."
            )
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise UserError(f"--node-rank must be from 0 to --nnodes - 1 ({self.nnodes - 1}), not {self.node_rank}.")
        host, _, port = (self.store or "").rpartition(":")
        if self.nnodes > 1 and not (host and port.isdigit() and 0 < int(port) < 65536):
            raise UserError(f"--store must be HOST:PORT, where machine 0 keeps the run's store, not {self.store!r}.")


def machines_from_slurm(given: LiveMachines) -> LiveMachines:
    """A train.elastic live run under srun: each task is its node's launcher (`zoa-train slurm --launcher live`), its
    machine SLURM_NODEID of the step's nodes, the store on the allocation's first node (MASTER_ADDR and MASTER_PORT
    where the job exports them). A UserError for more than one task per node."""
    tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS", os.environ["SLURM_NTASKS"]))
    nodes = int(os.environ.get("SLURM_STEP_NUM_NODES", os.environ.get("SLURM_NNODES", "1")))
    if tasks != nodes:
        raise UserError(
            f"train.elastic live under srun needs one task per node, whose zoa-train run starts the node's ranks (--nproc), "
            f"and this step has {tasks} tasks on {nodes} node(s); submit it with zoa-train slurm --launcher live."
        )
    if given != LiveMachines():
        return given
    host = os.environ.get("MASTER_ADDR") or first_slurm_node(os.environ.get("SLURM_JOB_NODELIST", "127.0.0.1"))
    return LiveMachines(nodes, int(os.environ.get("SLURM_NODEID", "0")), f"{host}:{os.environ.get('MASTER_PORT', '29500')}")


def train_recipe(
    recipe: Path,
    overrides: list[str],
    nproc: int | None,
    run_dir: Path,
    resume: str | None,
    overwrite: bool,
    reshard: bool,
    max_restarts: int,
    as_json: bool,
    machines: LiveMachines = LiveMachines(),
) -> int:
    """Train `recipe` into `run_dir`; the exit code: 0 done, 1 a rank's fault, EXIT_PREEMPTED (or
    128 + signal) stopped on a signal."""
    config = load_recipe(recipe, overrides)
    machines.check(config.train.elastic)
    if config.train.elastic == "live" and cluster_environment() == "slurm":
        machines = machines_from_slurm(machines)  # this task is its node's launcher
    launches = cluster_environment() is None or config.train.elastic == "live"  # the ranks are this process's to start
    if reshard and not resume:
        raise UserError("--reshard continues a checkpoint at another number of ranks; pass --resume auto or --resume CHECKPOINT with it.")
    if max_restarts < 0:
        raise UserError(f"--max-restarts must be 0 or more, not {max_restarts}.")
    if max_restarts and not launches:
        raise UserError(
            "--max-restarts restarts ranks that zoa-train run starts itself; under torchrun pass --max-restarts to torchrun (a restarted rank resumes by itself), under srun let Slurm requeue the job."
        )
    if config.train.elastic == "live" and cluster_environment() == "torchrun":
        raise UserError(
            "train.elastic live runs on the ranks zoa-train run starts itself (--nproc), which meet in a store it keeps; "
            "under torchrun use train.elastic reshard, or start zoa-train run on each machine (--nnodes, --node-rank, --store)."
        )
    if config.train.elastic == "reshard" and "TORCHELASTIC_RUN_ID" in os.environ and cluster_environment() == "torchrun":
        check_elastic_launch(overwrite)
    reshard = reshard or config.train.elastic == "reshard"  # a resume at another world size is the recipe's to allow
    if nproc is not None and nproc < 1:
        raise UserError(f"--nproc must be at least 1, not {nproc}.")
    if launches:
        local = nproc or config.train.nproc
        world = local * machines.nnodes
        check_batch_layout(config, world, str(recipe))
        check_local_gpus(config.train.backend, local)
        if machines.node_rank == 0:  # the others' ranks may join a run under way (its directory locked by rank 0)
            RunDirectory(run_dir).check(resume, overwrite, world, reshard)  # before any rank starts; every rank checks again
            shrink = live_shrink_warning(config, world) if config.train.elastic == "live" else None
            if shrink:
                console.err.print(f"warning: {shrink}", highlight=False, soft_wrap=True)
        check_directory(Path(config.data.cache_dir).expanduser(), "data.cache_dir")
    try:
        if launches:
            run_args = (config.to_dict(), str(run_dir), resume, overwrite, reshard)
            if config.train.elastic == "live":
                m = machines
                results = launch_live(run_rank, local, *run_args, max_restarts=max_restarts, nnodes=m.nnodes, node_rank=m.node_rank, store_at=m.store)
            else:
                results = launch_local(run_rank, world, *run_args, max_restarts=max_restarts)
        else:
            results = [run_rank(config.to_dict(), str(run_dir), resume, overwrite, reshard)]
    except (RankFailed, CollectiveTimeout) as e:  # a fault, not bad input: exit 1, the rank's sentence
        console.error(str(e))
        return 1
    except LauncherSignalled as e:  # the ranks got the signal too; a stop signal made them checkpoint first
        latest = RunDirectory(run_dir).latest(hashes=False)
        where = f"the latest complete checkpoint is {latest}" if latest else "no complete checkpoint was written"
        _say_stopped(f"stopped on {signal.Signals(e.signum).name}; {where}", recipe, run_dir)
        return EXIT_PREEMPTED if e.signum in STOP_SIGNALS else 128 + e.signum
    errors = sorted((r for r in results if r and "user_error" in r), key=lambda r: r.get("another_rank", False))
    if errors:  # the rank that met the problem first, then those it stopped
        raise UserError(errors[0]["user_error"])
    stopped = next((r for r in results if r and r.get("preempted")), None)
    if stopped:
        if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":  # under a launcher: said once, by rank 0
            _say_stopped(f"stopped at step {stopped['step']} on a termination signal after a complete checkpoint", recipe, run_dir)
        return EXIT_PREEMPTED
    if results[0]:
        say_run_summary(results[0]["run_dir"], config, as_json)
    return 0


def _say_stopped(what: str, recipe: Path, run_dir: Path) -> None:
    console.err.print(f"{what}; continue with: zoa-train run {recipe} --out {run_dir} --resume auto", highlight=False, soft_wrap=True)


def check_local_gpus(backend: str, world: int) -> None:
    """Refuse more local NCCL ranks than GPUs before starting any."""
    if backend == "nccl" or (backend == "auto" and torch.cuda.is_available()):
        visible = torch.cuda.device_count()
        if world > visible:
            remedy = f"pass --nproc {visible} or fewer, or set train.backend=gloo" if visible else "set train.backend=gloo to train on CPUs"
            raise UserError(f"{world} ranks need {world} GPUs and this machine has {visible}; {remedy}.")


def say_run_summary(run_dir: str, config, as_json: bool) -> None:
    """What a finished run did and where its files are, then the commands a user runs next (`--json`: the
    record alone, one JSON object)."""
    from zoa_train.models import registry as models
    from zoa_train.plan.units import format_bytes
    from zoa_train.runs import run_summary
    from zoa_train.train.metrics import clock

    done = run_summary(run_dir)
    if as_json:
        print(dumps_json(done))
        return
    lines = [f"done: {done['steps']:,} steps in {clock(done['wall_time_s'] or 0)}"]
    if done["val_loss"] is not None:
        top1 = f", top-1 {done['val_top1']:.2%}" if done["val_top1"] is not None else ""
        lines.append(f"  validation loss {done['val_loss']:.4f}{top1} (best {done['best_val_loss']:.4f} at step {done['best_val_step']:,})")
    if done["bits_per_param"] is not None:
        # bytes_sent is the slow link's: between nodes where the ledger also counted traffic inside them
        links = f"between nodes, {format_bytes(done['intra_bytes_sent'])} inside the node" if done["intra_bytes_sent"] else "between ranks"
        lines.append(
            f"  sent {done['bits_per_param']:.3f} bits per parameter a step in {done['rounds']:,} rounds: {format_bytes(done['bytes_sent'])} per rank {links}"
        )
    if done["mem_peak_bytes"] is not None:
        mfu = f", MFU {done['mfu_percent']:.1f}%" if done["mfu_percent"] is not None else ""
        lines.append(f"  peak memory {format_bytes(done['mem_peak_bytes'])} per rank{mfu}")
    lines.append(f"  run directory {run_dir}: checkpoint {done['checkpoint']}, logs {', '.join(Path(p).name for p in done['logs'])}")
    spec = models.get(config.model.kind)
    data = {"imagenet": "VAL_DIR", "glue": "GLUE_DIR"}
    lines.append("next:")
    lines += [f"  zoa-train eval {name} --checkpoint {run_dir} --data {data.get(name, 'FILE')}" for name in spec.evaluations]
    if spec.hf_model_types:  # a Hugging Face model: export writes its directory
        lines.append(f"  zoa-train export {run_dir} OUT_DIR")
    lines.append(f"  zoa-train report {run_dir}")
    console.out.print("\n".join(lines), highlight=False, soft_wrap=True)
