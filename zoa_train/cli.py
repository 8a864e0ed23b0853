"""zoa-train command line.

zoa-train run recipes/gpt2_tiny.yaml                     2 local CPU ranks (train.nproc), started here
zoa-train run recipes/gpt2.yaml --set optimizer.name=adam --nproc 8
torchrun --nproc-per-node 8 -m zoa_train.cli run recipes/gpt2.yaml      one process per rank
srun --ntasks-per-node 8 zoa-train run recipes/bert_large.yaml           rank and master from Slurm
zoa-train report runs/adam runs/zero_one_adam --out report   plots and a comparison table
zoa-train eval imagenet --checkpoint runs/resnet18_imagenet --data /data/imagenet/val      top-1 / top-5
zoa-train bench comm --sizes 1M,16M,64M --nproc 2        fp32 allreduce vs 1-bit allreduce
sudo zoa-train bench netsim --ranks 2 --bandwidth 100mbit  each optimizer over emulated network links
"""

import math
import os
import shutil
import sys
from pathlib import Path
from typing import Annotated

import click
import typer
from rich.table import Table

from zoa_train import __version__
from zoa_train import console as zoa_console
from zoa_train.errors import UserError
from zoa_train.files import dumps_json

app = typer.Typer(help="Communication-efficient distributed training with 0/1 Adam.", no_args_is_help=True, rich_markup_mode=None)
bench_app = typer.Typer(help="Benchmarks that print ratios measured in one run.", no_args_is_help=True, rich_markup_mode=None)
app.add_typer(bench_app, name="bench")
eval_app = typer.Typer(help="Evaluate a trained checkpoint.", no_args_is_help=True, rich_markup_mode=None)
app.add_typer(eval_app, name="eval")
console = zoa_console.out


def fail(message: str) -> None:
    """Report bad input in one sentence and exit with code 2."""
    zoa_console.error(message)
    raise typer.Exit(2)


def _version(value: bool) -> None:
    if value:
        console.print(f"zoa-train {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")] = False,
) -> None:
    """Communication-efficient distributed training with 0/1 Adam."""


@app.command("run")
def run_command(
    recipe: Annotated[Path, typer.Argument(help="A YAML recipe, e.g. recipes/gpt2_tiny.yaml.")],
    set_: Annotated[list[str], typer.Option("--set", help="Override a recipe value: section.key=value (repeatable).")] = [],
    nproc: Annotated[
        int | None, typer.Option(help="Local ranks to start when not under torchrun/srun. [default: the recipe's train.nproc]", show_default=False)
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Run directory. [default: runs/<recipe name>]", show_default=False)] = None,
    resume: Annotated[str, typer.Option(help="auto (latest complete checkpoint in the run directory) or a checkpoint directory.")] = "",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Empty a non-empty run directory first.")] = False,
    reshard: Annotated[
        bool,
        typer.Option(
            "--reshard",
            help="With --resume: allow a checkpoint of another number of ranks (1-bit error buffers reset, the data continue at the same sample; docs/faults.md).",
        ),
    ] = False,
    max_restarts: Annotated[
        int,
        typer.Option(
            help="When a rank dies, restart every rank from the latest complete checkpoint up to this many times (torch elastic; under torchrun pass torchrun's --max-restarts). [default: 0]",
            show_default=False,
        ),
    ] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="At the end print the run's summary as one JSON object instead of text.")] = False,
) -> None:
    """Train a recipe: builds the model, data and optimizer, logs metrics and writes checkpoints."""
    from zoa_train.config import check_batch_layout, load_recipe
    from zoa_train.distributed import LauncherSignalled, RankFailed, cluster_environment, launch_local
    from zoa_train.files import check_directory
    from zoa_train.train.rundir import RunDirectory
    from zoa_train.train.trainer import CollectiveTimeout, run_rank

    config = load_recipe(recipe, set_)
    run_dir = out or Path("runs") / recipe.stem
    if reshard and not resume:
        fail("--reshard continues a checkpoint at another number of ranks; pass --resume auto or --resume CHECKPOINT with it.")
    if max_restarts < 0:
        fail(f"--max-restarts must be 0 or more, not {max_restarts}.")
    if max_restarts and cluster_environment() is not None:
        fail(
            "--max-restarts restarts ranks that zoa-train run starts itself; under torchrun pass --max-restarts to torchrun (a restarted rank resumes by itself), under srun let Slurm requeue the job."
        )
    if nproc is not None and nproc < 1:
        fail(f"--nproc must be at least 1, not {nproc}.")
    if cluster_environment() is None:
        world = nproc or config.train.nproc
        check_batch_layout(config, world, str(recipe))
        check_local_gpus(config.train.backend, world)
        RunDirectory(run_dir).check(resume or None, overwrite, world, reshard)  # before any rank starts; every rank checks again
        check_directory(Path(config.data.cache_dir).expanduser(), "data.cache_dir")
    try:
        if cluster_environment() is None:
            results = launch_local(run_rank, world, config.to_dict(), str(run_dir), resume or None, overwrite, reshard, max_restarts=max_restarts)
        else:
            results = [run_rank(config.to_dict(), str(run_dir), resume or None, overwrite, reshard)]
    except (RankFailed, CollectiveTimeout) as e:  # a fault, not bad input: exit 1, the rank's sentence
        zoa_console.error(str(e))
        raise typer.Exit(1) from None
    except LauncherSignalled as e:  # the ranks got the signal too; a stop signal made them checkpoint first
        import signal

        from zoa_train.distributed import STOP_SIGNALS
        from zoa_train.train.trainer import EXIT_PREEMPTED

        latest = RunDirectory(run_dir).latest(hashes=False)
        where = f"the latest complete checkpoint is {latest}" if latest else "no complete checkpoint was written"
        zoa_console.err.print(
            f"stopped on {signal.Signals(e.signum).name}; {where}; continue with: zoa-train run {recipe} --out {run_dir} --resume auto",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(EXIT_PREEMPTED if e.signum in STOP_SIGNALS else 128 + e.signum) from None
    errors = sorted((r for r in results if r and "user_error" in r), key=lambda r: r.get("another_rank", False))
    if errors:  # the rank that met the problem first, then those it stopped
        fail(errors[0]["user_error"])
    stopped = next((r for r in results if r and r.get("preempted")), None)
    if stopped:
        from zoa_train.train.trainer import EXIT_PREEMPTED

        if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) != "0":  # under a launcher: said once, by rank 0
            raise typer.Exit(EXIT_PREEMPTED)
        zoa_console.err.print(
            f"stopped at step {stopped['step']} on a termination signal after a complete checkpoint; "
            f"continue with: zoa-train run {recipe} --out {run_dir} --resume auto",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(EXIT_PREEMPTED)
    if results[0]:
        say_run_summary(results[0]["run_dir"], config, as_json)


def say_run_summary(run_dir: str, config, as_json: bool) -> None:
    """What a finished run did and where its files are, then the commands a user runs next (`--json`: the
    record alone, one JSON object)."""
    from zoa_train.models import registry as models
    from zoa_train.optim.plan import format_bytes
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
    console.print("\n".join(lines), highlight=False, soft_wrap=True)


def check_local_gpus(backend: str, world: int) -> None:
    """Refuse more local NCCL ranks than GPUs before starting any."""
    import torch

    if backend == "nccl" or (backend == "auto" and torch.cuda.is_available()):
        visible = torch.cuda.device_count()
        if world > visible:
            remedy = f"pass --nproc {visible} or fewer, or set train.backend=gloo" if visible else "set train.backend=gloo to train on CPUs"
            fail(f"{world} ranks need {world} GPUs and this machine has {visible}; {remedy}.")


@app.command("slurm")
def slurm_command(
    recipe: Annotated[Path, typer.Argument(help="A YAML recipe, e.g. recipes/bert_large.yaml.")],
    nodes: Annotated[int, typer.Option(help="Nodes to allocate.")] = 1,
    gpus_per_node: Annotated[int | None, typer.Option(help="GPUs per node, one rank each (NCCL); 0 with --nproc-per-node: a CPU job (Gloo).")] = None,
    nproc_per_node: Annotated[int | None, typer.Option(help="Ranks per node. [default: --gpus-per-node]", show_default=False)] = None,
    cpus_per_task: Annotated[
        int | None, typer.Option(help="CPUs per Slurm task (torchrun: per node; srun: per rank). [default: torchrun: one per rank]", show_default=False)
    ] = None,
    partition: Annotated[str, typer.Option(help="Slurm partition.")] = "",
    account: Annotated[str, typer.Option(help="Slurm account.")] = "",
    qos: Annotated[str, typer.Option(help="Slurm QOS.")] = "",
    time_limit: Annotated[str, typer.Option("--time", help="Time limit, HH:MM:SS or D-HH:MM:SS.")] = "",
    constraint: Annotated[str, typer.Option(help="Slurm node features, e.g. a100.")] = "",
    job_name: Annotated[str, typer.Option(help="Job name. [default: zoa-<run directory name>]", show_default=False)] = "",
    out: Annotated[Path | None, typer.Option(help="Run directory. [default: runs/<recipe name>]", show_default=False)] = None,
    env: Annotated[list[str], typer.Option("--env", help="KEY=VALUE exported in the job, e.g. NCCL_SOCKET_IFNAME=eth0 (repeatable).")] = [],
    launcher: Annotated[str, typer.Option(help="torchrun (one task per node) or srun (one task per rank).")] = "torchrun",
    signal_spec: Annotated[str, typer.Option("--signal", help="Warning signal and its lead time before the time limit.")] = "USR2@120",
    max_requeues: Annotated[int, typer.Option(help="Times the job requeues itself after a warning signal.")] = 3,
    master_port: Annotated[int, typer.Option(help="Rendezvous port. [default: 20000 + job id % 20000]", show_default=False)] = 0,
    sbatch_option: Annotated[list[str], typer.Option("--sbatch-option", help="Any other sbatch option, e.g. --mem=200G (repeatable).")] = [],
    resume: Annotated[str, typer.Option(help="auto: continue the run directory's latest checkpoint.")] = "",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Empty a non-empty run directory first.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the script; write and submit nothing.")] = False,
    set_: Annotated[list[str], typer.Option("--set", help="Override a recipe value: section.key=value (repeatable).")] = [],
) -> None:
    """Write an sbatch script for a recipe into the run directory and submit it (requeues itself on a time-limit warning)."""
    from zoa_train.config import check_batch_layout, load_recipe
    from zoa_train.slurm import SlurmJob, parse_env, queued_jobs, record_submission, render_script, submit, write_job
    from zoa_train.train.rundir import RunDirectory

    job = SlurmJob(
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        nproc_per_node=nproc_per_node,
        cpus_per_task=cpus_per_task,
        partition=partition,
        account=account,
        qos=qos,
        time=time_limit,
        constraint=constraint,
        job_name=job_name,
        env=parse_env(env),
        launcher=launcher,
        signal=signal_spec,
        max_requeues=max_requeues,
        master_port=master_port,
        sbatch_options=sbatch_option,
    )
    config = load_recipe(recipe, set_)
    if not job.gpus:
        if config.train.backend == "nccl":
            fail(f"{recipe} sets train.backend nccl and this is a CPU job; give it GPUs with --gpus-per-node or set train.backend=gloo.")
        config.train.backend = "gloo"
    check_batch_layout(config, job.world_size, str(recipe))
    run_dir = out or Path("runs") / recipe.stem
    if dry_run:
        console.print(render_script(job, run_dir, Path.cwd()), highlight=False, markup=False, soft_wrap=True)
        return
    if resume not in ("", "auto"):
        fail(f"--resume {resume}: a Slurm job continues its run directory's latest checkpoint; pass --resume auto.")
    queued = queued_jobs(run_dir)
    if queued:
        fail(f"job {queued[0][0]} ({queued[0][1].lower()}) already uses run directory {run_dir}; wait for it or scancel it first.")
    rundir = RunDirectory(run_dir)
    rundir.check(resume or None, overwrite, job.world_size)
    if overwrite:  # empty it now, under its lock: the job itself always starts with --resume auto
        rundir.prepare(None, True, job.world_size, 0)
        rundir.close()
    fresh = [p for p in (run_dir, run_dir / "slurm") if not p.exists()]
    script = write_job(job, config.to_dict(), run_dir, Path.cwd())
    try:
        job_id = submit(script)
    except UserError:
        if fresh:  # a refused job leaves no trace, so the same command can be run again
            shutil.rmtree(fresh[0])
        raise
    record_submission(run_dir, job_id, script, job)
    log = script.parent / f"job-{job_id}.out"
    console.print(f"submitted job {job_id}: {job.world_size} ranks on {job.nodes} node(s), launcher {job.launcher}", highlight=False)
    console.print(f"  script   {script}\n  log      {log}\n  history  {script.parent / 'jobs.jsonl'}", highlight=False)
    console.print(f"  follow   squeue -j {job_id}; sacct -j {job_id} --format=JobID,State,Elapsed,ExitCode; tail -f {log}", highlight=False, soft_wrap=True)


@app.command("plan")
def plan_command(
    recipe: Annotated[Path, typer.Argument(help="A YAML recipe: its optimizer knobs, lr schedule, steps and model size are read.")],
    set_: Annotated[list[str], typer.Option("--set", help="Override a recipe value: section.key=value (repeatable).")] = [],
    nodes: Annotated[int | None, typer.Option(help="Nodes to plan for. [default: 64, or --world-size / --gpus-per-node]", show_default=False)] = None,
    gpus_per_node: Annotated[
        int, typer.Option(help="Ranks in each node; above 1 the 1-bit optimizers are planned flat and node-aware. [default: 1]", show_default=False)
    ] = 1,
    world_size: Annotated[int | None, typer.Option(help="All ranks, instead of --nodes: --world-size / --gpus-per-node nodes.", show_default=False)] = None,
    bandwidth: Annotated[
        str, typer.Option(help="Each node's link to the others, each way, e.g. 10Gbit, 100Gbit, 25GB. [default: 10Gbit]", show_default=False)
    ] = "10Gbit",
    intra_bandwidth: Annotated[
        str, typer.Option(help="Inside a node, shared by its ranks, e.g. 300GB (NVLink). [default: not limiting]", show_default=False)
    ] = "",
    latency: Annotated[str, typer.Option(help="Per message between nodes, e.g. 20us, 1ms. [default: 20us]", show_default=False)] = "20us",
    backend: Annotated[str, typer.Option(help="nccl (GPUs; ring all-gather) or gloo (CPUs; direct all-gather). [default: nccl]", show_default=False)] = "nccl",
    step_time: Annotated[
        str, typer.Option(help="Compute time of one step on one rank, nothing sent, e.g. 250ms: adds predicted step times and speed-ups.", show_default=False)
    ] = "",
    backward_fraction: Annotated[
        float, typer.Option(help="Share of --step-time that DDP's allreduce overlaps (backward). [default: 0.67]", show_default=False)
    ] = 2 / 3,
    compress_rate: Annotated[
        float,
        typer.Option(
            help="Elements per second one rank encodes and decodes in a 1-bit call: a size over its 1-bit time in bench comm on one machine. [default: not limiting]",
            show_default=False,
        ),
    ] = 0.0,
    reduce_rate: Annotated[
        float,
        typer.Option(
            help="Elements per second one rank sends and sums in a full-precision collective, besides the transfer (CPUs with Gloo; GPUs hardly limit it). [default: not limiting]",
            show_default=False,
        ),
    ] = 0.0,
    fsdp_rate: Annotated[
        float,
        typer.Option(
            help="Elements per second one rank moves through FSDP2's all-gathers and reduce-scatter, besides the transfer (the sharded columns; CPUs with Gloo, from bench netsim --shard). [default: not limiting]",
            show_default=False,
        ),
    ] = 0.0,
    params: Annotated[int, typer.Option(help="Parameter count. [default: counted from the recipe's model]", show_default=False)] = 0,
    gpu_memory: Annotated[
        str, typer.Option(help="Memory of one GPU, e.g. 80GB or 80GiB: marks what fits, with the room left for activations.", show_default=False)
    ] = "",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object keyed by optimizer name.")] = False,
) -> None:
    """Communication and memory per rank of every optimizer (Adam, 1-bit Adam, 0/1 Adam, ...) over a whole recipe on N nodes of G ranks, without training; with --step-time, predicted step time, time to train and speed-ups."""
    import math

    from zoa_train.comm.buckets import BUCKET_CAP_MB
    from zoa_train.config import load_recipe
    from zoa_train.optim import registry
    from zoa_train.optim.plan import StepCosts, format_plan, parse_bandwidth, parse_latency, parse_memory, plan

    config = load_recipe(recipe, set_)
    for option, count in (("--nodes", nodes), ("--world-size", world_size), ("--gpus-per-node", gpus_per_node)):
        if count is not None and count < 1:
            fail(f"{option} must be at least 1, not {count}.")
    if not (0 <= backward_fraction <= 1 and compress_rate >= 0 and reduce_rate >= 0 and fsdp_rate >= 0 and params >= 0):
        fail("--backward-fraction must be in [0, 1], and --compress-rate, --reduce-rate, --fsdp-rate and --params not negative.")
    if nodes is not None and world_size is not None:
        fail("give --nodes or --world-size, not both.")
    if world_size is not None and world_size % gpus_per_node:
        fail(f"--gpus-per-node {gpus_per_node} does not divide --world-size {world_size}.")
    ranks = world_size or (nodes or 64) * gpus_per_node
    if config.comm.shard == "node" and gpus_per_node == 1:
        zoa_console.err.print(
            f"warning: {recipe} shards the model over each node's GPUs (comm.shard node) and --gpus-per-node 1 gives a node one, so the plan "
            "has no sharded columns; pass --gpus-per-node (e.g. 8) to see them."
        )
    costs = None
    if step_time:
        c = config.comm
        overlap_bucket = int((c.bucket_cap_mb or BUCKET_CAP_MB) * 2**20)
        costs = StepCosts(
            parse_latency(step_time),
            backward_fraction,
            compress_rate or math.inf,
            reduce_rate or math.inf,
            overlap=c.overlap,
            overlap_bucket_bytes=overlap_bucket,
            micro_batches=max(1, -(-config.train.global_batch_size // (config.train.micro_batch_size * ranks))),
            fsdp_rate=fsdp_rate or math.inf,
        )
    o = config.optimizer
    gpu_bytes = parse_memory(gpu_memory) if gpu_memory else None
    named = named_parameter_shapes(config)
    shapes = tuple(shape for _, shape in named)
    activations = planned_activations(config)
    result = plan(
        config.train.steps,
        config.lr_schedule(),
        ranks,
        params or sum(math.prod(shape) for shape in shapes),
        **registry.knob_values(o),
        allreduce_bits=32 if o.allreduce_dtype == "fp32" else 16,
        bandwidth_bytes_per_s=parse_bandwidth(bandwidth),
        latency_s=parse_latency(latency),
        ranks_per_node=gpus_per_node,
        intra_bandwidth_bytes_per_s=parse_bandwidth(intra_bandwidth) if intra_bandwidth else math.inf,
        backend=backend,
        costs=costs,
        betas=o.betas,
        param_shapes=shapes,
        activations=activations,
        checkpointing=config.train.activation_checkpointing,
        param_names=tuple(name for name, _ in named),
        gpu_memory_bytes=gpu_bytes,
    )
    if as_json:
        print(dumps_json(result))
        return
    console.print(format_plan(result))
    for name, record in result.items():
        if "warning" in record:
            zoa_console.err.print(f"warning ({name}): {record['warning']}")


def planned_activations(config) -> dict[str, int] | None:
    """The activations one micro-batch of the recipe keeps for backward, by train.activation_checkpointing
    mode (zoa_train/tasks/activations.py), or None with a warning where its model cannot run on fake tensors."""
    from zoa_train.tasks.activations import activation_memory

    try:
        return activation_memory(config).as_dict()
    except Exception as e:  # noqa: BLE001 -- a model's own code on fake tensors: counted where it runs, said where not
        zoa_console.err.print(
            f"warning: activations are not counted for this model ({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''})."
        )
        return None


def named_parameter_shapes(config) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, shape) of the recipe's model's parameters, built on the meta device (no memory, no
    download); a language model's vocabulary is data.vocab_size, the size of a tokenizer trained for the recipe."""
    import torch

    from zoa_train.tasks import task_class

    with torch.device("meta"):
        model = task_class(config).model_for_counting(config)
    return tuple((name, tuple(p.shape)) for name, p in model.named_parameters())


def parameter_shapes(config) -> tuple[tuple[int, ...], ...]:
    """The shapes of the recipe's model's parameters (named_parameter_shapes)."""
    return tuple(shape for _, shape in named_parameter_shapes(config))


def count_parameters(config) -> int:
    """Parameters of the recipe's model (parameter_shapes)."""
    import math

    return sum(math.prod(shape) for shape in parameter_shapes(config))


@app.command("convert-deepspeed")
def convert_deepspeed_command(
    config: Annotated[Path, typer.Argument(help="A DeepSpeed config (JSON) with optimizer type OneBitAdam, ZeroOneAdam, Adam or AdamW.")],
    model: Annotated[
        str,
        typer.Option(
            help="The model, which a DeepSpeed config does not name: gpt2, gpt2-medium, bert-base, bert-large, llama-1B, resnet50, ... [default: bert-large]",
            show_default=False,
        ),
    ] = "bert-large",
    out: Annotated[Path | None, typer.Option(help="Write the recipe here (atomically) instead of printing it.", show_default=False)] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing --out file.")] = False,
    set_: Annotated[list[str], typer.Option("--set", help="Set a recipe value the config does not hold, e.g. train.steps=N (repeatable).")] = [],
) -> None:
    """Convert a DeepSpeed config into a zoa-train recipe: a comment on every line whose meaning changed; keys that cannot map are refused (docs/from-deepspeed.md)."""
    from zoa_train.convert_deepspeed import convert, write_recipe

    text = convert(config, model, set_)
    if out is None:
        print(text, end="")
        return
    write_recipe(text, out, overwrite)
    zoa_console.err.print(f"wrote {out}", highlight=False, markup=False)


@app.command("report")
def report_command(
    run_dirs: Annotated[list[Path], typer.Argument(help="Run directories (each with metrics.jsonl), e.g. runs/gpt2_tiny.", show_default=False)],
    out: Annotated[
        Path, typer.Option(help="Directory for report.md and the PNG plots; files of the same names are replaced. [default: report]", show_default=False)
    ] = Path("report"),
) -> None:
    """Compare runs: loss, bits/param and step-kind plots (PNG) and a table of final losses, time, traffic and time to a common loss."""
    from zoa_train.report import write_report

    report = write_report(run_dirs, out)
    print(report.markdown, end="")  # the table as in report.md: never truncated to the terminal's width
    if report.target is not None:
        print(f"best common val loss {report.target:.3f}: the highest of the runs' final validation losses")
    for note in report.notes:
        print(note)
    print(f"wrote {', '.join(str(f) for f in report.files)}")


@eval_app.command("imagenet")
def eval_imagenet(
    checkpoint: Annotated[
        Path, typer.Option(help="A run directory (its latest complete checkpoint), a checkpoint directory or a model file.", show_default=False)
    ],
    data: Annotated[Path, typer.Option(help="An ImageFolder validation set: <class name>/<image> (e.g. ImageNet's val/).", show_default=False)],
    batch_size: Annotated[int, typer.Option(help="Images per forward pass. [default: 64]", show_default=False)] = 64,
    workers: Annotated[int, typer.Option(help="Decoding processes (per rank). [default: 4]", show_default=False)] = 4,
    model: Annotated[
        str, typer.Option(help="resnet18, resnet34 or resnet50 for a bare model file. [default: the run's, else resnet18]", show_default=False)
    ] = "",
    resize_size: Annotated[int, typer.Option(help="Shorter side before the centre crop. [default: the run's recipe, else 256]", show_default=False)] = 0,
    crop_size: Annotated[int, typer.Option(help="Centre crop. [default: the run's recipe, else 224]", show_default=False)] = 0,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the results to this JSON file.")] = None,
) -> None:
    """Top-1 and top-5 accuracy and the loss of a ResNet over every image of a validation set; split over the ranks under torchrun or srun."""
    from zoa_train.evaluation.imagenet import evaluate_imagenet
    from zoa_train.files import check_output_file, write_json_file
    from zoa_train.models import registry as models

    if batch_size < 1 or workers < 0 or resize_size < 0 or crop_size < 0:
        fail("--batch-size must be at least 1, and --workers, --resize-size and --crop-size not negative.")
    kinds = [spec.kind for spec in models.accepting("imagenet")]
    if model and model not in kinds:
        fail(f"--model must be one of {', '.join(kinds)}, not {model!r}.")
    if json_out is not None:
        check_output_file(json_out, "--json")  # before the evaluation: its result must have somewhere to go
    result = evaluate_imagenet(checkpoint, data, batch_size, workers, model or None, resize_size or None, crop_size or None)
    if result is None:  # not rank 0
        return
    if json_out is not None:
        write_json_file(json_out, result, "--json")
    table = Table(title=f"{result['model']} on {result['data']}")
    for name in ("images", "top-1", "top-5", "loss"):
        table.add_column(name, justify="right")
    table.add_row(f"{result['images']:,}", f"{100 * result['top1']:.2f}%", f"{100 * result['top5']:.2f}%", f"{result['loss']:.4f}")
    console.print(table)


# Commands defined beside their code in zoa_train/evaluation/ (each module imports its heavy
# dependencies inside the command, so `zoa-train --help` stays fast).
from zoa_train.evaluation.export import export_command  # noqa: E402

app.command("export")(export_command)
from zoa_train.evaluation.language import lambada_command, wikitext_command  # noqa: E402

eval_app.command("wikitext")(wikitext_command)
eval_app.command("lambada")(lambada_command)
from zoa_train.evaluation.glue import glue_command  # noqa: E402

eval_app.command("glue")(glue_command)


@bench_app.command("ops")
def bench_ops(
    nproc: Annotated[int, typer.Option(help="Local ranks to start. [default: 2]", show_default=False)] = 2,
    calls: Annotated[int, typer.Option(help="Timed 1-bit steps; the median is reported. [default: 5]", show_default=False)] = 5,
    block_size: Annotated[int, typer.Option(help="Elements per block of a pass. [default: the device's]", show_default=False)] = 0,
    per_group: Annotated[bool, typer.Option("--per-group", help="One 1-bit call per parameter group (the layout before one call per step).")] = False,
    scale: Annotated[int, typer.Option(help="Divide every tensor size by this: smaller runs, the same tensor count. [default: 1]", show_default=False)] = 1,
) -> None:
    """Ops (kernel launches on an accelerator) and CPU time per 1-bit step of BERT-Large's 398 tensors, counted with torch.profiler."""
    from zoa_train.bench.comm import BENCH_OPS_BYTES_PER_ELEMENT, bert_large_groups, profile_rank
    from zoa_train.bench.limits import RANK_PROCESS_BYTES, check_count, check_fits, check_local_ranks
    from zoa_train.distributed import launch_local

    check_local_ranks(nproc)
    check_count("--calls", calls)
    largest = max(map(max, bert_large_groups()))
    check_count("--scale", scale, 1, largest)  # at the largest, every tensor has one element
    groups = [[max(1, size // scale) for size in sizes] for sizes in bert_large_groups()]
    elements = sum(map(sum, groups))
    check_count("--block-size", block_size, 0, elements)  # a block holds at most the call's elements
    need = nproc * (RANK_PROCESS_BYTES + BENCH_OPS_BYTES_PER_ELEMENT * elements)
    check_fits(f"{nproc:,} ranks of {elements:,} elements (--scale {scale:,})", need, "pass a larger --scale or a smaller --nproc")
    print(dumps_json(launch_local(profile_rank, nproc, groups, calls, block_size or None, per_group, None)[0], indent=2))


@bench_app.command("comm")
def bench_comm(
    sizes: Annotated[str, typer.Option(help="Comma-separated element counts (k, M, G suffixes). [default: 1M,16M,64M]", show_default=False)] = "1M,16M,64M",
    nproc: Annotated[int, typer.Option(help="Local ranks to start. [default: 2]", show_default=False)] = 2,
    backend: Annotated[str, typer.Option(help="gloo or nccl. [default: nccl with CUDA, else gloo]", show_default=False)] = "",
    repeats: Annotated[int, typer.Option(help="Timed repeats after warm-up; the median is reported. [default: 9]", show_default=False)] = 9,
    ranks_per_node: Annotated[
        int,
        typer.Option(
            help="Treat ranks r*G..r*G+G-1 as node r and time the node-aware 1-bit allreduce too, with each call's bytes by link. [default: 0, flat only]",
            show_default=False,
        ),
    ] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")] = False,
) -> None:
    """Time torch.distributed.all_reduce (fp32) against OneBitAllReduce on the same tensors.

    Started by torchrun or srun, it runs as one of their ranks (--nproc is then theirs) and rank 0 prints; bench netsim uses this to put the ranks on emulated network links."""
    from zoa_train.bench.comm import FEEDBACK_CALLS, parse_size, rank_main
    from zoa_train.bench.limits import check_count, check_local_ranks
    from zoa_train.distributed import cluster_environment, launch_local

    try:
        numels = [parse_size(s) for s in sizes.split(",") if s.strip()]
    except ValueError as e:
        fail(f"--sizes: {e}.")
    check_local_ranks(nproc)
    check_count("--repeats", repeats)
    if backend not in ("", "gloo", "nccl"):
        fail(f"--backend must be gloo or nccl, not {backend!r}.")
    world = int(os.environ["WORLD_SIZE"]) if cluster_environment() is not None else nproc
    if ranks_per_node < 0 or (ranks_per_node and (world % ranks_per_node or world == ranks_per_node)):
        fail(f"--ranks-per-node must divide the {world} ranks into two or more nodes, not {ranks_per_node}.")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if cluster_environment() is not None else nproc
    check_bench_comm_machine(backend, local, max(numels, default=0))
    if cluster_environment() is None:
        rows = launch_local(rank_main, nproc, numels, repeats, backend or None, ranks_per_node)[0]
    else:
        rows = rank_main(numels, repeats, backend or None, ranks_per_node)
        if rows is None:  # not rank 0
            return
        nproc = world
    result = {"nproc": nproc, "backend": backend or "default", "repeats": repeats, "ranks_per_node": ranks_per_node, "results": rows}
    if as_json:
        print(dumps_json(result))
        return
    table = Table(title=f"fp32 allreduce vs 1-bit allreduce, {nproc} ranks")
    kernels = rows[0]["kernels"] if rows else "?"
    for name in ("elements", "fp32 s", "bf16 s", f"1-bit ({kernels}) s", "1-bit/fp32", "torch path s", "torch path/fp32", "err 1 call",
                 f"err mean {FEEDBACK_CALLS}", "pack+unpack GB/s", "add GB/s", "ratio"):  # fmt: skip
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(
            f"{r['numel']:,}",
            f"{r['allreduce_fp32_s']:.4f}",
            f"{r['allreduce_bf16_s']:.4f}",
            f"{r['onebit_s']:.4f}",
            f"{r['onebit_vs_fp32']:.2f}x",
            f"{r['onebit_torch_path_s']:.4f}",
            f"{r['onebit_torch_path_vs_fp32']:.2f}x",
            f"{r['rel_error_one_call']:.3f}",
            f"{r[f'rel_error_mean_of_{FEEDBACK_CALLS}']:.4f}",
            f"{r['pack_unpack_gbps']:.1f}",
            f"{r['add_gbps']:.1f}",
            f"{r['pack_unpack_vs_add']:.2f}",
        )
    console.print(table)
    if ranks_per_node:
        from zoa_train.optim.plan import format_bytes

        nodes = Table(title=f"flat vs node-aware 1-bit allreduce, {nproc // ranks_per_node} nodes x {ranks_per_node} ranks: time and bytes per rank per call")
        for name in ("elements", "flat 1-bit s", "node-aware s", "node-aware vs fp32", "flat between nodes", "node-aware between nodes", "node-aware inside"):
            nodes.add_column(name, justify="right")
        for r in rows:
            nodes.add_row(f"{r['numel']:,}", f"{r['onebit_s']:.4f}", f"{r['node_aware_s']:.4f}", f"{r['node_aware_speedup']:.2f}x",
                          format_bytes(r["onebit_inter_bytes_per_rank"]), format_bytes(r["node_aware_inter_bytes_per_rank"]),
                          format_bytes(r["node_aware_intra_bytes_per_rank"]))  # fmt: skip
        console.print(nodes)


# What bench comm holds per rank and element of its largest size (zoa_train/bench/comm.py): the input,
# its exact average, fp32 and bf16 work copies, the running sum and a clone per call, two 1-bit
# collectives' buffers and errors, and on rank 0 the codec's buffers: about 44 bytes, rounded up.
BENCH_COMM_BYTES_PER_ELEMENT = 48


def check_bench_comm_machine(backend: str, local_ranks: int, numel: int) -> None:
    """Refuse a backend or a size this machine cannot give `local_ranks` ranks, before starting any."""
    import torch

    from zoa_train.bench.limits import available_memory
    from zoa_train.optim.plan import format_bytes

    gpus = torch.cuda.device_count()
    nccl = (backend or ("nccl" if gpus else "gloo")) == "nccl"
    if nccl and gpus < local_ranks:
        fail(f"--backend nccl needs a GPU for each of the {local_ranks} local ranks and this machine has {gpus}; pass --backend gloo.")
    if nccl:  # each rank its own GPU, judged by its size (asking for its free memory would give this process a context on each)
        room, where, whom = min(torch.cuda.get_device_properties(i).total_memory for i in range(local_ranks)), "on its GPU", "each rank"
    else:
        room, where, whom = available_memory(), "of memory available on this machine", f"{local_ranks} ranks"
    need = BENCH_COMM_BYTES_PER_ELEMENT * numel * (1 if nccl else local_ranks)
    if need > room:
        fail(f"--sizes {numel:,} elements need about {format_bytes(need)} for {whom} and there are {format_bytes(room)} {where}; pass smaller sizes.")


@bench_app.command("netsim")
def bench_netsim(
    recipe: Annotated[Path, typer.Option(help="The recipe every optimizer trains. [default: recipes/gpt2_tiny.yaml]", show_default=False)] = Path(
        "recipes/gpt2_tiny.yaml"
    ),
    ranks: Annotated[int, typer.Option(help="Ranks, one network namespace (node) each; see --nodes. [default: 2]", show_default=False)] = 2,
    nodes: Annotated[
        int | None,
        typer.Option(
            help="Emulated nodes, one network namespace each, of --ranks-per-node ranks that talk over its loopback (replaces --ranks). [default: --ranks nodes of 1]",
            show_default=False,
        ),
    ] = None,
    ranks_per_node: Annotated[
        int, typer.Option(help="Ranks in each of --nodes; above 1 the 1-bit optimizers train flat and node-aware. [default: 1]", show_default=False)
    ] = 1,
    shard: Annotated[
        bool,
        typer.Option(
            "--shard", help="Also train each optimizer that can be sharded with comm.shard node (FSDP2 inside each node; needs --ranks-per-node 2 or more)."
        ),
    ] = False,
    bandwidth: Annotated[
        str, typer.Option(help="Rate of each node's link to the others, both directions, e.g. 100mbit, 1Gbit, 12.5MB/s. [default: 100mbit]", show_default=False)
    ] = "100mbit",
    intra_bandwidth: Annotated[
        str, typer.Option(help="Rate of each node's loopback, shared by its ranks, e.g. 10Gbit. [default: unshaped]", show_default=False)
    ] = "",
    latency: Annotated[
        str, typer.Option(help="One-way delay between two ranks (netem), e.g. 1ms; 0 shapes the rate only. [default: 1ms]", show_default=False)
    ] = "1ms",
    optimizers: Annotated[
        str,
        typer.Option(
            help="Comma-separated optimizers to train, Adam first; all: every registered one (those of the recipe's imports too); none: bench comm only. [default: all]",
            show_default=False,
        ),
    ] = "all",
    steps: Annotated[int, typer.Option(help="Sets train.steps for every run. [default: the recipe's]", show_default=False)] = 0,
    set_: Annotated[list[str], typer.Option("--set", help="Override a recipe value in every run: section.key=value (repeatable).")] = [],
    comm_sizes: Annotated[
        str,
        typer.Option(
            help="Element counts for bench comm over the same links (k, M, G suffixes), or none. [default: the model's parameter count]", show_default=False
        ),
    ] = "",
    out: Annotated[
        Path,
        typer.Option(
            help="Run directories OUT/<optimizer> (replaced), rank logs OUT/logs, results OUT/netsim.json. [default: runs/netsim]", show_default=False
        ),
    ] = Path("runs/netsim"),
    margin: Annotated[
        float,
        typer.Option(
            help="Time to target counts until Adam's final val_loss times 1 + MARGIN is reached, e.g. 0.02 for within 2%. [default: 0]", show_default=False
        ),
    ] = 0.0,
    target_loss: Annotated[
        float | None,
        typer.Option(
            help="The val_loss to reach in place of Adam's final one, from an earlier Adam run of the same recipe and seed (the loss does not depend on the link): for links too slow to train Adam on. [default: Adam's, trained here]",
            show_default=False,
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as one JSON object instead of tables.")] = False,
) -> None:
    """Train each optimizer on ranks in network namespaces (emulated nodes) joined by a bridge over rate-limited, delayed veth links, same recipe and seed.

    Reports step time, throughput, bits/param, rounds, bytes sent, time to Adam's final val_loss and speed-ups against Adam, then bench comm over the same links. Needs root and iproute2; removes everything it creates, also on failure or Ctrl-C."""
    from zoa_train.bench.comm import parse_size
    from zoa_train.bench.limits import check_fits
    from zoa_train.bench.netsim import RankFailed, parse_optimizers, run_netsim
    from zoa_train.config import load_recipe

    if steps < 0:
        fail("--steps must be positive (0 keeps the recipe's train.steps).")
    for option, count in (("--nodes", nodes), ("--ranks-per-node", ranks_per_node)):
        if count is not None and count < 1:
            fail(f"{option} must be at least 1, not {count}.")
    if ranks_per_node > 1 and nodes is None:
        fail("--ranks-per-node needs --nodes: pass --nodes N --ranks-per-node G for N namespaces of G ranks.")
    if shard and ranks_per_node < 2:
        fail("--shard shards inside each node, so it needs --nodes N --ranks-per-node G with G of 2 or more.")
    world = nodes * ranks_per_node if nodes else ranks
    if not 0 <= margin < 1:
        fail(f"--margin must be a fraction in [0, 1), not {margin}.")
    if target_loss is not None and not (math.isfinite(target_loss) and target_loss > 0):
        fail(f"--target-loss must be a positive loss, not {target_loss}.")
    overrides = [*set_, *([f"train.steps={steps}"] if steps else [])]
    config = load_recipe(recipe, overrides)  # also imports the modules that register its optimizers
    names = parse_optimizers(optimizers)
    num_params = count_parameters(config)
    numels = [num_params]
    if comm_sizes.strip() == "none":
        numels = []
    elif comm_sizes.strip():
        try:
            numels = [parse_size(s) for s in comm_sizes.split(",") if s.strip()]
        except ValueError as e:
            fail(f"--comm-sizes: {e}.")
    if not names and not numels:
        fail("--optimizers none and --comm-sizes none leave nothing to run.")
    # bench comm over the links holds what it holds on one machine (--sizes), on every rank of this one
    check_fits(f"--comm-sizes {max(numels, default=0):,} elements", BENCH_COMM_BYTES_PER_ELEMENT * max(numels, default=0) * world, "pass smaller --comm-sizes")
    say = zoa_console.err.print
    try:
        result = run_netsim(
            recipe,
            overrides,
            names,
            world,
            bandwidth,
            latency,
            out,
            numels,
            progress=lambda m: say(m, highlight=False),
            margin=margin,
            ranks_per_node=ranks_per_node,
            intra_bandwidth=intra_bandwidth,
            num_params=num_params,
            target_loss=target_loss,
            shard=shard,
        )
    except RankFailed as e:
        zoa_console.error(str(e))
        raise typer.Exit(1) from None
    if as_json:
        print(dumps_json(result))
    else:
        from zoa_train.bench.netsim import format_netsim

        console.print(format_netsim(result))


@bench_app.command("optim")
def bench_optim(
    params_millions: Annotated[float, typer.Option(help="Model size in millions of parameters. [default: 25]", show_default=False)] = 25.0,
    repeats: Annotated[int, typer.Option(help="Timed steps after warm-up; the median is reported. [default: 10]", show_default=False)] = 10,
    threads: Annotated[int, typer.Option(help="torch threads. [default: all cores]", show_default=False)] = 0,
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N. [default: cpu]", show_default=False)] = "cpu",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Optimizer step cost against torch.optim.AdamW(fused), the fastest AdamW, and optimizer state bytes per parameter."""
    import torch

    from zoa_train.bench.limits import check_count, check_positive_finite
    from zoa_train.bench.optim import check_optimizer_bench_memory, format_optimizer_bench, run_optimizer_bench

    check_positive_finite("--params-millions", params_millions)
    check_count("--repeats", repeats)
    check_count("--threads", threads, 0, os.cpu_count() or 1)  # 0: all cores
    try:
        where = torch.device(device)
    except RuntimeError:
        fail(f"--device must be cpu, cuda or cuda:N, not {device!r}.")
    if where.type not in ("cpu", "cuda") or (where.type == "cuda" and not torch.cuda.is_available()):
        fail(f"--device {device}: this machine has no such device (CUDA available: {torch.cuda.is_available()}).")
    check_optimizer_bench_memory(params_millions, where)
    result = run_optimizer_bench(params_millions, repeats, threads or None, device)
    if as_json:
        print(dumps_json(result, default=str))
    else:
        console.print(format_optimizer_bench(result))


@bench_app.command("loader")
def bench_loader(
    recipe: Annotated[Path, typer.Argument(help="A YAML recipe whose data and model are measured.")],
    set_: Annotated[list[str], typer.Option("--set", help="Override a recipe value: section.key=value (repeatable).")] = [],
    batches: Annotated[int, typer.Option(help="Micro-batches timed. [default: 20]", show_default=False)] = 20,
    step_time: Annotated[
        str,
        typer.Option(
            help="A training step's time on one rank, e.g. 93ms (a real run's), instead of measuring one here. [default: measured]", show_default=False
        ),
    ] = "",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """One rank's data loader (tokens/s or images/s) against the trainer's consumption per rank on the recipe, one process."""
    from zoa_train.bench.limits import check_count
    from zoa_train.bench.loader import run_loader_bench
    from zoa_train.config import load_recipe
    from zoa_train.optim.plan import parse_latency

    check_count("--batches", batches)
    step_s = None
    if step_time:
        try:
            step_s = parse_latency(step_time)
        except UserError:
            step_s = 0.0
        if not step_s > 0:
            raise UserError(f"--step-time {step_time!r} is not understood: expected a positive time with a unit ns, us, ms or s, e.g. 250ms.")
    r = run_loader_bench(load_recipe(recipe, set_), batches, step_s)
    if as_json:
        print(dumps_json(r))
        return
    unit = r["unit"]
    how = f"measured here: forward, backward and AdamW on {r['step_threads']} thread(s), a rank's share" if r["step_time"] == "measured" else "given"
    console.print(
        f"rank 0 of {r['world_size']}: the loader gives {r['loader_units_per_s_per_rank']:,.0f} {unit}/s "
        f"({r['loader_s_per_batch'] * 1e3:.2f} ms per micro-batch of {r['micro_batch_size']}); "
        f"the trainer takes {r['trainer_units_per_s_per_rank']:,.0f} {unit}/s per rank "
        f"({r['units_per_step_per_rank']:,} {unit} a step in {r['step_s'] * 1e3:.1f} ms, {how}): "
        f"the loader is {r['loader_over_trainer']:,.1f}x the trainer's need (target: at least 10x)"
    )


# Recent typer releases carry their own copy of click, whose usage errors are not click's.
_USAGE_ERRORS = (click.ClickException, getattr(typer, "TyperException", click.ClickException))


def run() -> None:
    """Console entry point: user errors raised deep inside become one sentence and exit code 2."""
    try:
        code = app(standalone_mode=False)  # click returns the code of a typer.Exit in this mode
        sys.exit(code if isinstance(code, int) else 0)
    except UserError as e:
        zoa_console.error(str(e))
        sys.exit(2)
    except (click.exceptions.Exit, typer.Exit) as e:
        sys.exit(e.exit_code)
    except _USAGE_ERRORS as e:  # a missing argument, an unknown option: click's one message, exit 2
        e.show()
        sys.exit(e.exit_code)
    except (click.exceptions.Abort, typer.Abort):
        sys.exit(130)


if __name__ == "__main__":
    run()
