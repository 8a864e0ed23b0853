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

import sys
from pathlib import Path
from typing import Annotated

import click
import typer
from rich.table import Table

from zoa_train import __version__
from zoa_train import console as zoa_console
from zoa_train.errors import UserError

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
    nnodes: Annotated[
        int,
        typer.Option(help="train.elastic live on several machines: how many, each running this command with its --node-rank. [default: 1]", show_default=False),
    ] = 1,
    node_rank: Annotated[
        int, typer.Option(help="train.elastic live: this machine's place among --nnodes (0 keeps the store). [default: 0]", show_default=False)
    ] = 0,
    store: Annotated[str, typer.Option(help="train.elastic live on several machines: HOST:PORT of the store machine 0 keeps.")] = "",
) -> None:
    """Train a recipe: builds the model, data and optimizer, logs metrics and writes checkpoints."""
    from zoa_train.train.launch import LiveMachines, train_recipe

    machines = LiveMachines(nnodes, node_rank, store or None)
    code = train_recipe(recipe, set_, nproc, out or Path("runs") / recipe.stem, resume or None, overwrite, reshard, max_restarts, as_json, machines)
    if code:
        raise typer.Exit(code)


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
    launcher: Annotated[
        str, typer.Option(help="torchrun (one task per node), srun (one task per rank) or live (train.elastic live: one task per node).")
    ] = "torchrun",
    signal_spec: Annotated[str, typer.Option("--signal", help="Warning signal and its lead time before the time limit.")] = "USR2@120",
    max_requeues: Annotated[int, typer.Option(help="Times the job requeues itself after a warning signal.")] = 3,
    max_restarts: Annotated[
        int | None,
        typer.Option(
            help="torchrun: times the ranks start again after a failure; live: times each node starts a failed rank again. [default: 3 with train.elastic reshard or live, else 0]",
            show_default=False,
        ),
    ] = None,
    master_port: Annotated[int, typer.Option(help="Rendezvous port. [default: 20000 + job id % 20000]", show_default=False)] = 0,
    sbatch_option: Annotated[list[str], typer.Option("--sbatch-option", help="Any other sbatch option, e.g. --mem=200G (repeatable).")] = [],
    resume: Annotated[str, typer.Option(help="auto: continue the run directory's latest checkpoint.")] = "",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Empty a non-empty run directory first.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the script; write and submit nothing.")] = False,
    set_: Annotated[list[str], typer.Option("--set", help="Override a recipe value: section.key=value (repeatable).")] = [],
) -> None:
    """Write an sbatch script for a recipe into the run directory and submit it (requeues itself on a time-limit warning)."""
    from zoa_train.slurm import SlurmJob, parse_env, submit_recipe

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
        max_restarts=max_restarts,
        master_port=master_port,
        sbatch_options=sbatch_option,
    )
    submit_recipe(job, recipe, set_, out or Path("runs") / recipe.stem, resume, overwrite, dry_run)


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
    from zoa_train.plan.recipe import plan_recipe

    plan_recipe(
        recipe,
        set_,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        world_size=world_size,
        bandwidth=bandwidth,
        intra_bandwidth=intra_bandwidth,
        latency=latency,
        backend=backend,
        step_time=step_time,
        backward_fraction=backward_fraction,
        compress_rate=compress_rate,
        reduce_rate=reduce_rate,
        fsdp_rate=fsdp_rate,
        params=params,
        gpu_memory=gpu_memory,
        as_json=as_json,
    )


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
    from zoa_train.bench.commands import bench_ops as run_bench

    run_bench(nproc, calls, block_size, per_group, scale)


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
    imports: Annotated[
        list[str],
        typer.Option(
            "--imports", help="A module to import first, as a recipe's imports: the collectives it registers are timed too (repeatable).", show_default=False
        ),
    ] = [],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")] = False,
) -> None:
    """Time torch.distributed.all_reduce (fp32) against OneBitAllReduce on the same tensors.

    Started by torchrun or srun, it runs as one of their ranks (--nproc is then theirs) and rank 0 prints; bench netsim uses this to put the ranks on emulated network links."""
    from zoa_train.bench.commands import bench_comm as run_bench

    run_bench(sizes, nproc, backend, repeats, ranks_per_node, as_json, tuple(imports))


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
    variant: Annotated[
        list[str],
        typer.Option(
            "--variant",
            help="Also train an optimizer with recipe values of its own, NAME:section.key=value[,...], labelled NAME+key=value "
            "(repeatable), e.g. zero_one_adam:optimizer.sync_delay=1.",
        ),
    ] = [],
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as one JSON object instead of tables.")] = False,
) -> None:
    """Train each optimizer on ranks in network namespaces (emulated nodes) joined by a bridge over rate-limited, delayed veth links, same recipe and seed.

    Reports step time, throughput, bits/param, rounds, bytes sent, time to Adam's final val_loss and speed-ups against Adam, then bench comm over the same links. Needs root and iproute2; removes everything it creates, also on failure or Ctrl-C."""
    from zoa_train.bench.commands import bench_netsim as run_bench

    code = run_bench(
        recipe,
        set_,
        ranks=ranks,
        nodes=nodes,
        ranks_per_node=ranks_per_node,
        shard=shard,
        bandwidth=bandwidth,
        intra_bandwidth=intra_bandwidth,
        latency=latency,
        optimizers=optimizers,
        steps=steps,
        comm_sizes=comm_sizes,
        out=out,
        margin=margin,
        target_loss=target_loss,
        as_json=as_json,
        variants=variant,
    )
    if code:
        raise typer.Exit(code)


@bench_app.command("optim")
def bench_optim(
    params_millions: Annotated[float, typer.Option(help="Model size in millions of parameters. [default: 25]", show_default=False)] = 25.0,
    repeats: Annotated[int, typer.Option(help="Timed steps after warm-up; the median is reported. [default: 10]", show_default=False)] = 10,
    threads: Annotated[int, typer.Option(help="torch threads. [default: all cores]", show_default=False)] = 0,
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N. [default: cpu]", show_default=False)] = "cpu",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Optimizer step cost against torch.optim.AdamW(fused), the fastest AdamW, and optimizer state bytes per parameter."""
    from zoa_train.bench.commands import bench_optim as run_bench

    run_bench(params_millions, repeats, threads, device, as_json)


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
    from zoa_train.bench.commands import bench_loader as run_bench

    run_bench(recipe, set_, batches, step_time, as_json)


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
