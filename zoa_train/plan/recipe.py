"""`zoa-train plan` on a recipe: what the cost and memory model (zoa_train/plan/model.py) needs of it
(its model's parameter shapes and activations, its optimizer knobs, schedule and batch layout), and
the plan printed. Also the parameter count that `bench netsim` and the tests read."""

import math
from pathlib import Path

from zoa_train import console
from zoa_train.errors import UserError


def plan_recipe(
    recipe: Path,
    overrides: list[str],
    *,
    nodes: int | None,
    gpus_per_node: int,
    world_size: int | None,
    bandwidth: str,
    intra_bandwidth: str,
    latency: str,
    backend: str,
    step_time: str,
    backward_fraction: float,
    compress_rate: float,
    reduce_rate: float,
    fsdp_rate: float,
    params: int,
    gpu_memory: str,
    as_json: bool,
) -> None:
    """Print every optimizer's plan over `recipe` (the `plan` command's options; 0 or "" where unset)."""
    from zoa_train.config import load_recipe, rounds_kept_in_step
    from zoa_train.files import dumps_json
    from zoa_train.optim import registry
    from zoa_train.plan.model import plan
    from zoa_train.plan.table import format_plan
    from zoa_train.plan.units import parse_bandwidth, parse_latency, parse_memory

    config = load_recipe(recipe, overrides)
    check_plan_options(nodes, gpus_per_node, world_size, backward_fraction, compress_rate, reduce_rate, fsdp_rate, params)
    ranks = world_size or (nodes or 64) * gpus_per_node
    if config.comm.shard == "node" and gpus_per_node == 1:
        console.err.print(
            f"warning: {recipe} shards the model over each node's GPUs (comm.shard node) and --gpus-per-node 1 gives a node one, so the plan "
            "has no sharded columns; pass --gpus-per-node (e.g. 8) to see them."
        )
    kept = rounds_kept_in_step(config)
    if config.comm.overlap and kept and step_time:
        console.err.print(
            f"warning: {kept} changes the gradients after backward, so the 1-bit rounds are planned in step(), as the trainer runs them; comm.overlap needs it off."
        )
    costs = step_costs(config, ranks, step_time, backward_fraction, compress_rate, reduce_rate, fsdp_rate) if step_time else None
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
    console.out.print(format_plan(result))
    for name, record in result.items():
        if "warning" in record:
            console.err.print(f"warning ({name}): {record['warning']}")


def check_plan_options(nodes, gpus_per_node, world_size, backward_fraction, compress_rate, reduce_rate, fsdp_rate, params) -> None:
    """The plan command's counts and rates; UserError of one sentence."""
    for option, count in (("--nodes", nodes), ("--world-size", world_size), ("--gpus-per-node", gpus_per_node)):
        if count is not None and count < 1:
            raise UserError(f"{option} must be at least 1, not {count}.")
    if not (0 <= backward_fraction <= 1 and compress_rate >= 0 and reduce_rate >= 0 and fsdp_rate >= 0 and params >= 0):
        raise UserError("--backward-fraction must be in [0, 1], and --compress-rate, --reduce-rate, --fsdp-rate and --params not negative.")
    if nodes is not None and world_size is not None:
        raise UserError("give --nodes or --world-size, not both.")
    if world_size is not None and world_size % gpus_per_node:
        raise UserError(f"--gpus-per-node {gpus_per_node} does not divide --world-size {world_size}.")


def step_costs(config, ranks: int, step_time: str, backward_fraction: float, compress_rate: float, reduce_rate: float, fsdp_rate: float):
    """What a step costs besides its transfers (StepCosts), for predicted step times; a rate of 0 is not limiting."""
    from zoa_train.comm.buckets import BUCKET_CAP_MB
    from zoa_train.config import rounds_kept_in_step
    from zoa_train.plan.model import StepCosts
    from zoa_train.plan.units import parse_latency

    c = config.comm
    overlap_bucket = int((c.bucket_cap_mb or BUCKET_CAP_MB) * 2**20)
    return StepCosts(
        parse_latency(step_time),
        backward_fraction,
        compress_rate or math.inf,
        reduce_rate or math.inf,
        overlap=c.overlap and rounds_kept_in_step(config) is None,  # as the trainer: clipping keeps the rounds in step()
        overlap_bucket_bytes=overlap_bucket,
        micro_batches=max(1, -(-config.train.global_batch_size // (config.train.micro_batch_size * ranks))),
        fsdp_rate=fsdp_rate or math.inf,
    )


def planned_activations(config) -> dict[str, int] | None:
    """The activations one micro-batch of the recipe keeps for backward, by train.activation_checkpointing
    mode (zoa_train/tasks/activations.py), or None with a warning where its model cannot run on fake tensors."""
    from zoa_train.tasks.activations import activation_memory

    try:
        return activation_memory(config).as_dict()
    except Exception as e:  # noqa: BLE001 -- a model's own code on fake tensors: counted where it runs, said where not
        console.err.print(
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
    return sum(math.prod(shape) for shape in parameter_shapes(config))
