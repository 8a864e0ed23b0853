"""Communication plan: what each registered optimizer would send over a whole run, and what its steps
would cost on a cluster of nodes, without running it.

Each optimizer's registry entry (zoa_train/optim/registry.py) counts its full-precision and 1-bit
allreduces, rounds, syncs and variance updates from the recipe's knobs, following docs/algorithm.md
"Counting" and the optimizers' own ledgers, so a plan can be checked against a real run (0/1 Adam's
counts come from the same ZeroOneSchedule the optimizer runs). Every optimizer's parameters are
treated as one flat buffer (the optimizers send one buffer per param group, so a multi-group model
pays a little more padding and latency than planned).

The cluster (`Cluster`) is N nodes of G ranks: a node's link to the others carries `bandwidth` bytes/s
each way and costs `latency` per message; inside a node the ranks share `intra_bandwidth`. Each
collective is a sequence of phases; a phase costs its messages times the latency plus the slower of
(bytes over the node's link) / bandwidth and (bytes inside the node) / intra_bandwidth, the two links
working at once. The bytes are those this implementation sends (docs/algorithm.md):

  full-precision allreduce  a ring over all ranks, a node's ranks next to each other (NCCL and Gloo):
                            each link of the ring, the node's included, carries 2(n-1)/n of the buffer
  flat 1-bit call           an all-to-all of the signs and row scales (each rank sends n-1 segments,
                            onebit_layout's, G(N-1) of them off the node), then an all-gather of the
                            server segments: direct on Gloo (as the all-to-all), a ring on NCCL
                            (n-1 segments cross each node's link)
  node-aware full precision the 1-bit optimizers' full-precision rounds on several nodes: the node-aware
                            call's three steps with a ring allreduce of the shard between nodes
  node-aware 1-bit call     inside the node an all-to-all of the buffer in the allreduce dtype, the
                            flat 1-bit call of 1/G of it among the N ranks of one local rank (the G
                            local ranks at once, all over the node's link), an fp32 all-gather inside
                            the node

Each call also costs time on the ranks themselves, besides its transfer: a 1-bit call encodes and
decodes its buffer (`compress_rate` elements per second), a full-precision collective copies, sends
and sums what it sends (`reduce_rate` elements per second: 2(n-1)/n of the buffer in a ring, 2(G-1)/G
in the node-aware call's part inside the node). Both are measured on the machine to be predicted, by
a calibration run over a fast link (docs/algorithm.md, "Calibrating on a machine"; `bench netsim`
prints them); on GPUs, where NCCL sums in device memory, `reduce_rate` hardly limits. With one rank
nothing is sent: bytes and time are zero, while bits, rounds and syncs stay the schedule's nominal
counts.

Given a compute time per step (`StepCosts.step_time`: forward, backward and optimizer on one rank,
nothing sent), the plan also predicts step and total time. DDP (Adam and every optimizer that does not
sync itself) overlaps its bucketed allreduce with backward: buckets of `bucket_bytes` (DDP's 25 MiB,
the first 1 MiB) become ready as backward (`backward_fraction` of the step) proceeds, each starts
when it is ready and the previous one is done, and only what is left when backward ends adds to the
step. The 1-bit optimizers communicate inside `step()`, after backward, unless their rounds overlap
backward (`StepCosts.overlap`, a recipe's comm.overlap): then each round's transfers are modelled as
DDP's are, in buckets of `overlap_bucket_bytes` (comm.bucket_cap_mb), and only their exposed part adds
to the step; the round's work on the ranks (`CallCost.work_seconds`) adds in full, as it competes with
backward for the ranks (calibrated on CPUs, docs/results/overlap.md). A delayed sync (optimizer.sync_delay
1: 0/1 Adam's rounds that close a local-step period, DiLoCo's outer rounds; PlanCounts.delayed_onebit
and delayed_parts) runs its transfer behind the whole next step: only what outlasts the step's compute
adds, and its work on the ranks in full.
Sharded (comm.shard node), each rank's rounds cover its shard among the N ranks that hold it, the
node's G ranks at once over its link; FSDP2's all-gathers and reduce-scatter inside the node add what
prefetching cannot hide (`fsdp_step_cost`), and Adam's HSDP all-reduce starts unit by unit in backward
as DDP's buckets do. The 1-bit optimizers' overlapped rounds do too: buckets of whole tensors of
`overlap_bucket_bytes`, each round carrying the node's shards of its bucket.

Memory per rank (`memory_per_rank`, docs/algorithm.md "Memory per rank"): fp32 parameters and
gradients, and what each optimizer's registry entry says it holds (OptimizerSpec.memory: its state,
and its collective's scratch, sized by the functions the collectives allocate by: onebit_buffers,
hierarchical_buffers, topk_buffers), laid out in the trainer's two parameter groups (matrices and
kernels, then the rest) where the model's shapes are known. The collectives are planned with the fused
kernels (auto on GPUs and CPUs), which keep no scratch. Sharded (the "sharded" record, comm.shard
node): FSDP2 over the G ranks of each node, every tensor cut on its first dimension (padded to a
multiple of G rows), the optimizer on its shard exchanging with the N ranks holding the same shard,
plus the unsharded fp32 parameters and gradients of FSDP2's largest unit; and, where the caller counted
them (`activations`, zoa_train/tasks/activations.py: the tensors a micro-batch keeps for backward, by
train.activation_checkpointing mode), the activations of the recipe's mode, with the mode that fits
where a GPU's memory is given. The CUDA context and the allocator's slack are not modelled, nor tensors
made and freed inside a step.
"""

import functools
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from zoa_train.comm import registry as collectives
from zoa_train.comm.costs import CallCost, Cluster, allgather_cost, allreduce_cost, node_share  # noqa: F401 -- the cost model, importable from here too
from zoa_train.comm.onebit import flat_onebit_cost, onebit_call_bytes  # noqa: F401 -- the cost model, importable from here too
from zoa_train.errors import UserError
from zoa_train.optim import registry
from zoa_train.optim.lr_schedules import LRSchedule
from zoa_train.optim.registry import OptimizerSpec
from zoa_train.plan.counts import MemoryContext, MemoryCounts, PlanContext, PlanCounts, collective_memory

ALLREDUCE_BITS = (16, 32)
BACKENDS = ("nccl", "gloo")
ONEBIT_BASELINE = "onebit_adam"  # the 1-bit optimizers' speed-ups are also given against it
DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's bucket_cap_mb default
DDP_FIRST_BUCKET_BYTES = 2**20  # its first (last layers') bucket


@dataclass(frozen=True)
class StepCosts:
    """What a step costs besides communication, for predicted step times."""

    step_time: float  # seconds of forward, backward and optimizer step on one rank, nothing sent
    backward_fraction: float = 2 / 3  # share of step_time that DDP's allreduce can overlap
    compress_rate: float = math.inf  # buffer elements per second a rank encodes and decodes in a 1-bit call
    reduce_rate: float = math.inf  # elements per second a rank sends and sums in full precision (a ring: 2(n-1)/n of the buffer)
    bucket_bytes: int = DDP_BUCKET_BYTES
    overlap: bool = False  # the 1-bit optimizers' rounds start during backward (comm.overlap)
    overlap_bucket_bytes: int = DDP_BUCKET_BYTES  # in buckets of this many bytes of fp32 (comm.bucket_cap_mb)
    micro_batches: int = 1  # forward/backward passes per step on a rank: sharded, FSDP2 gathers and reduces at each
    fsdp_rate: float = math.inf  # elements per second a rank moves through FSDP2's gathers and reduce-scatter, besides the transfer


def fsdp_step_cost(shard: int, unit: int, num_params: int, cluster: Cluster, costs: StepCosts | None, reduce_size: int = 4) -> tuple[float, float, float]:
    """(bytes each rank sends inside the node, seconds of it, seconds it adds to a step) for FSDP2 over
    the node's G ranks in one step (comm.shard node): per micro-batch an fp32 all-gather of the
    parameters for forward, another for backward and a reduce-scatter of the gradients in
    `reduce_size`-byte elements (the allreduce dtype), each sending G-1 shards of a rank's `shard`
    elements (the ledger's count). FSDP2 gathers the next unit while one computes, so the
    transfer hides behind the step's compute but for the first unit's all-gather and the last unit's
    reduce-scatter of each micro-batch (`unit` of `num_params`); the work on the ranks (`fsdp_rate`:
    copies, casts and sums, which compete with compute on a CPU) does not hide."""
    g = cluster.ranks_per_node
    micro_batches = costs.micro_batches if costs else 1
    sent = 3 * (g - 1) * shard * micro_batches  # elements each rank sends
    nbytes = sent // 3 * (4 + 4 + reduce_size)
    transfer = cluster.phase(0, g * nbytes, 0)
    work = sent / costs.fsdp_rate if costs else 0.0
    if costs is None:
        return nbytes, transfer + work, transfer + work
    ends = (4 + reduce_size) / (8 + reduce_size) * transfer * unit / num_params  # a unit's all-gather and its reduce-scatter, each micro-batch
    return nbytes, transfer + work, ends + max(0.0, transfer - ends - costs.step_time) + work


def ddp_exposed_time(numel: int, element_size: int, cluster: Cluster, costs: StepCosts) -> float:
    """Seconds DDP's allreduce adds to a step after backward (`exposed_time` of its buckets, the first
    of DDP's 1 MiB)."""
    seconds = lambda elements: allreduce_cost(elements, element_size, cluster, costs.reduce_rate).seconds  # noqa: E731
    return exposed_time(numel, seconds, costs, costs.bucket_bytes, DDP_FIRST_BUCKET_BYTES)


def exposed_time(numel: int, bucket_seconds: Callable[[int], float], costs: StepCosts, bucket_bytes: int, first_bucket_bytes: int | None = None) -> float:
    """Seconds a bucketed round adds to a step after backward: buckets of `bucket_bytes` of fp32 (the
    first of `first_bucket_bytes`) become ready as backward proceeds, each starts when it is ready and
    the previous one is done (`bucket_seconds(elements)` each), and what is left when backward ends
    is exposed."""
    total = numel * 4
    sizes = [min(first_bucket_bytes or bucket_bytes, total)]
    while sum(sizes) < total:
        sizes.append(min(bucket_bytes, total - sum(sizes)))
    backward = costs.backward_fraction * costs.step_time
    done, ready = 0.0, 0
    for size in sizes:
        ready += size
        done = max(done, backward * ready / total) + bucket_seconds(-(-size // 4))
    return max(0.0, done - backward)


def _summary(
    counts: PlanCounts,
    *,
    steps: int,
    num_params: int,
    fp: CallCost,
    onebit: CallCost,
    part_cost: Callable[[int, int], CallCost],
    gather_cost: Callable[[int], CallCost],
    allreduce_bits: int,
    world_size: int,
    compute_s: float | None,
    fp_step_s: float,
    onebit_step_s: float | None = None,
) -> dict:
    """Totals of one optimizer from its counts of full-precision and 1-bit allreduces of the whole
    model, of its allreduces of parts (`part_cost(elements, element_size)` for each) and of its
    all-gathers (`gather_cost(message_bytes)`); none of the last two overlaps backward."""
    f, o = counts.fp_allreduces, counts.onebit_allreduces
    parts = [(a.calls, a.elements, a.bits or allreduce_bits) for a in counts.other_allreduces]
    part_costs = [(calls, part_cost(elements, bits // 8)) for calls, elements, bits in parts]
    part_costs += [(a.calls, gather_cost(a.message_bytes)) for a in counts.allgathers]
    part_seconds = sum(calls * cost.seconds for calls, cost in part_costs)
    part_bits = sum(c * e * b for c, e, b in parts) + sum(a.calls * a.bits for a in counts.allgathers)
    summary = {
        "steps": steps,
        "bits_per_param": (f * allreduce_bits + o + part_bits / num_params) / steps if steps else 0.0,
        "rounds": counts.rounds,
        "syncs": counts.syncs,
        "variance_updates": counts.variance_updates,
        "fp_allreduces": f,
        "onebit_allreduces": o,
        "collective_calls": f + 2 * o + sum(c for c, _ in part_costs) if world_size > 1 else 0,
        "bytes_per_rank": f * fp.bytes_per_rank + o * onebit.bytes_per_rank + sum(c * cost.bytes_per_rank for c, cost in part_costs),
        "intra_bytes_per_rank": f * fp.intra_bytes_per_rank + o * onebit.intra_bytes_per_rank,
        "inter_bytes_per_node": f * fp.inter_bytes_per_node + o * onebit.inter_bytes_per_node + sum(c * cost.inter_bytes_per_node for c, cost in part_costs),
        "comm_time_s": f * fp.seconds + o * onebit.seconds + part_seconds,
        **counts.extra,
        **({"warning": counts.warning} if counts.warning else {}),
    }
    if compute_s is not None:
        d = counts.delayed_onebit
        onebit_s = (o - d) * (onebit.seconds if onebit_step_s is None else onebit_step_s) + d * _behind_a_step(onebit, compute_s)
        if counts.delayed_parts:
            part_seconds = sum(calls * _behind_a_step(cost, compute_s) for calls, cost in part_costs)
        total = steps * compute_s + f * fp_step_s + onebit_s + part_seconds
        summary |= {"step_time_s": total / steps if steps else 0.0, "total_time_s": total}
    return summary


def _behind_a_step(call: CallCost, compute_s: float) -> float:
    """What a delayed round (sync_delay 1) adds to a step: its transfer runs behind the whole next step,
    so only what outlasts that step's compute adds; its work on the ranks adds in full, as an
    overlapped round's does."""
    return call.work_seconds + max(0.0, call.transfer_seconds - compute_s)


def _overlapped_step(cost: Callable[[int], CallCost], num_params: int, costs: StepCosts | None) -> float | None:
    """What an overlapped round adds to a step (None: the run does not overlap): its transfers as backward
    leaves them exposed, and all of its work on the ranks, which competes with backward for them
    (measured on CPUs, docs/results/overlap.md)."""
    if costs is None or not costs.overlap:
        return None
    transfer = exposed_time(num_params, lambda elements: cost(elements).transfer_seconds, costs, costs.overlap_bucket_bytes)
    return transfer + cost(num_params).work_seconds


def _check_arguments(
    steps, world_size, ranks_per_node, num_params, allreduce_bits, bandwidth_bytes_per_s, intra_bandwidth_bytes_per_s, latency_s, backend, costs,
    gpu_memory_bytes, activations, checkpointing, knobs,
) -> None:  # fmt: skip
    """plan()'s arguments, each refused in one sentence before anything is computed."""
    _check(steps >= 0, f"steps must be >= 0, got {steps}.")
    _check(world_size >= 1, f"world size must be at least 1, got {world_size}.")
    _check(ranks_per_node >= 1 and world_size % ranks_per_node == 0, f"ranks per node ({ranks_per_node}) must divide the world size ({world_size}).")
    _check(num_params >= 1, f"the number of parameters must be at least 1, got {num_params}.")
    _check(allreduce_bits in ALLREDUCE_BITS, f"allreduce bits must be 16 or 32, got {allreduce_bits}.")
    _check(bandwidth_bytes_per_s > 0 and math.isfinite(bandwidth_bytes_per_s), f"bandwidth must be a positive number of bytes/s, got {bandwidth_bytes_per_s}.")
    _check(intra_bandwidth_bytes_per_s > 0, f"intra-node bandwidth must be a positive number of bytes/s, got {intra_bandwidth_bytes_per_s}.")
    _check(latency_s >= 0 and math.isfinite(latency_s), f"latency must be a non-negative number of seconds, got {latency_s}.")
    _check(backend in BACKENDS, f"backend must be nccl or gloo, got {backend!r}.")
    _check(gpu_memory_bytes is None or 0 < gpu_memory_bytes < math.inf, f"GPU memory must be a positive number of bytes, got {gpu_memory_bytes}.")
    _check(activations is None or checkpointing in activations, f"checkpointing must be one of {', '.join(activations or ())}, got {checkpointing!r}.")
    if costs is not None:
        _check(costs.step_time > 0 and math.isfinite(costs.step_time), f"step time must be a positive number of seconds, got {costs.step_time}.")
        _check(0 <= costs.backward_fraction <= 1, f"the backward fraction must be between 0 and 1, got {costs.backward_fraction}.")
        _check(costs.compress_rate > 0, f"the compression rate must be a positive number of elements/s, got {costs.compress_rate}.")
        _check(costs.reduce_rate > 0, f"the reduction rate must be a positive number of elements/s, got {costs.reduce_rate}.")
        _check(costs.fsdp_rate > 0, f"the FSDP rate must be a positive number of elements/s, got {costs.fsdp_rate}.")
    unknown = set(knobs) - {f.name for f in registry.knob_fields()}
    _check(not unknown, f"no optimizer has the knob {', '.join(sorted(unknown))}.")
    registry.check_section(knobs, "plan")  # each knob; each optimizer's rule is its plan's to apply


def plan(
    steps: int,
    lr_schedule: LRSchedule,
    world_size: int,
    num_params: int,
    *,
    allreduce_bits: int = 32,
    bandwidth_bytes_per_s: float,
    latency_s: float,
    ranks_per_node: int = 1,
    intra_bandwidth_bytes_per_s: float = math.inf,
    backend: str = "nccl",
    costs: StepCosts | None = None,
    betas: tuple[float, float] = (0.9, 0.999),
    param_shapes: tuple[tuple[int, ...], ...] = (),
    param_names: tuple[str, ...] = (),
    gpu_memory_bytes: float | None = None,
    activations: Mapping[str, int] | None = None,
    checkpointing: str = "none",
    **knobs,
) -> dict[str, dict]:
    """Per registered optimizer name, the run's communication totals on `world_size` ranks, nodes of
    `ranks_per_node`.

    Each value holds bits_per_param (nominal, averaged over steps), rounds, syncs, variance_updates
    (|T_v|), fp_allreduces, onebit_allreduces, collective_calls, bytes_per_rank,
    inter_bytes_per_node (over each node's link) and comm_time_s, and whatever its registry entry adds
    (zero_one_adam: variance_update_bound, the paper's log(1-b1)/log(b2), and max_interval). With
    `costs`, also step_time_s (the mean), total_time_s, speedup_vs_adam and, for the 1-bit
    optimizers, speedup_vs_onebit_adam. An optimizer that takes the 1-bit collective gets a
    "hierarchical" record of the same keys for the node-aware sync when there are several nodes of
    several ranks, and each `shardable` optimizer a "sharded" record (comm.shard node: FSDP2 over each
    node's ranks, adam as HSDP) when nodes have several ranks, whose bytes and bits are a rank's shard's
    between nodes, intra_bytes_per_rank FSDP2's, and speed-ups against Adam sharded. `knobs` are
    optimizer knobs by name, as in a recipe's optimizer section; each optimizer takes its own, and the
    library's defaults stand for the rest.

    Each record (the node-aware and sharded ones too) also holds memory_per_rank (`memory_per_rank`:
    bytes of params, grads, optimizer_state, scratch and their total, by buffer in state_buffers and
    scratch_buffers, and sharded FSDP2's largest unit; None for an optimizer whose entry declares none). The model's
    `param_shapes` and `param_names` (model order) lay the state out as the trainer does and find
    FSDP2's units; with `gpu_memory_bytes` each memory record says whether it fits and the headroom
    left; with `activations` (bytes by train.activation_checkpointing mode) each adds those of
    `checkpointing`'s mode, and fits_with names the mode that recomputes least among those that fit."""
    _check_arguments(
        steps, world_size, ranks_per_node, num_params, allreduce_bits, bandwidth_bytes_per_s, intra_bandwidth_bytes_per_s, latency_s, backend, costs,
        gpu_memory_bytes, activations, checkpointing, knobs,
    )  # fmt: skip

    cluster = Cluster(world_size // ranks_per_node, ranks_per_node, bandwidth_bytes_per_s, latency_s, intra_bandwidth_bytes_per_s, backend)
    element = allreduce_bits // 8
    rate, reduce = (costs.compress_rate, costs.reduce_rate) if costs else (math.inf, math.inf)
    # per registered collective of the 1-bit optimizers that fits these nodes (zoa_train/comm/registry.py),
    # the cost of a (full-precision, 1-bit) round of `elements`; and what each adds to a step: all of
    # it, or with overlap what backward does not hide. The first (flat) is every optimizer's base record.
    base, planned = collectives.default(), [c for c in collectives.specs() if c.fits(cluster.nodes, ranks_per_node)]
    rounds = {
        c.name: (
            lambda elements, c=c: c.fp_cost(elements, cluster, element, reduce),
            lambda elements, c=c: c.onebit_cost(elements, cluster, element, rate, reduce),
        )
        for c in planned
    }
    topologies = {name: (fp(num_params), onebit(num_params)) for name, (fp, onebit) in rounds.items()}

    # Memory: the same parameters unsharded on every rank, or sharded over the G ranks of a node with the
    # exchange among the N ranks that hold the same shard.
    nodes, groups = cluster.nodes, parameter_groups(num_params, param_shapes)
    comms = {c.name: lambda sizes, c=c: collective_memory(c.buffers(sizes, nodes, ranks_per_node), c.state) for c in planned}
    shard_comm = lambda sizes: collective_memory(base.buffers(sizes, nodes, 1), base.state)  # noqa: E731 -- the shard among the nodes
    shards = tuple(tuple(shard_shape(shape, ranks_per_node) for shape in group) for group in groups)
    unit = largest_fsdp_unit(num_params, param_shapes, param_names)

    # Sharded: FSDP2 over each node's G ranks, the optimizer's rounds over a rank's shard among the N ranks
    # that hold it (the node's G ranks at once, sharing its link).
    among = Cluster(nodes, 1, cluster.bandwidth / ranks_per_node, latency_s, intra_bandwidth_bytes_per_s, backend)
    shard = sum(math.prod(shape) for group in shards for shape in group)
    fsdp_bytes, fsdp_seconds, fsdp_added = fsdp_step_cost(shard, unit[0], num_params, cluster, costs, element)

    def sharded(spec: OptimizerSpec, counts: PlanCounts, knobs) -> dict:
        fp = node_share(base.fp_cost(shard, among, element, reduce), ranks_per_node)
        fp_step, onebit_step = fp.seconds, None
        if costs is not None and not spec.uses_collective:  # adam: torch's HSDP, each unit's all-reduce started in backward
            fp_step = exposed_time(
                num_params, lambda elements: allreduce_cost(-(-elements // ranks_per_node), element, among, reduce).seconds, costs, 4 * unit[0]
            )
        elif costs is not None and costs.overlap:  # buckets cut by whole tensors, each round the node's shards of one, started in backward
            fp_step = overlapped(lambda elements: node_share(base.fp_cost(-(-elements // ranks_per_node), among, element, reduce), ranks_per_node))
            onebit_step = overlapped(
                lambda elements: node_share(base.onebit_cost(-(-elements // ranks_per_node), among, element, rate, reduce), ranks_per_node)
            )
        record = _summary(
            counts,
            steps=steps,
            num_params=shard,
            fp=fp,
            onebit=node_share(base.onebit_cost(shard, among, element, rate, reduce), ranks_per_node),
            part_cost=lambda elements, size: node_share(allreduce_cost(-(-elements // ranks_per_node), size, among, reduce), ranks_per_node),
            gather_cost=lambda message_bytes: node_share(allgather_cost(message_bytes, among), ranks_per_node),
            allreduce_bits=allreduce_bits,
            world_size=nodes,
            compute_s=costs.step_time + fsdp_added if costs else None,
            fp_step_s=fp_step,
            onebit_step_s=onebit_step,
        )
        record["intra_bytes_per_rank"] += steps * fsdp_bytes
        record["comm_time_s"] += steps * fsdp_seconds
        record["memory_per_rank"] = memory_per_rank(spec, knobs, shards, nodes, shard_comm, unit, gpu_memory_bytes, activations, checkpointing)
        return record

    overlapped = functools.partial(_overlapped_step, num_params=num_params, costs=costs)
    result = {}
    for name in registry.names():
        spec = registry.get(name)
        context = PlanContext(steps, lr_schedule, world_size, num_params, allreduce_bits, betas, spec.knobs_from(knobs), param_shapes)
        counts = spec.plan(context)
        compute = costs.step_time if costs else None
        records = {
            topology: _summary(
                counts,
                steps=steps,
                num_params=num_params,
                fp=fp,
                onebit=onebit,
                part_cost=lambda elements, size: allreduce_cost(elements, size, cluster, reduce),
                gather_cost=lambda message_bytes: allgather_cost(message_bytes, cluster),
                allreduce_bits=allreduce_bits,
                world_size=world_size,
                compute_s=compute,
                # What a full-precision step adds: all of it in step(), the exposed part of DDP's or an overlapped one.
                fp_step_s=(fp.seconds if overlapped(rounds[topology][0]) is None else overlapped(rounds[topology][0]))
                if spec.uses_collective or costs is None
                else ddp_exposed_time(num_params, element, cluster, costs),
                onebit_step_s=overlapped(rounds[topology][1]),
            )
            for topology, (fp, onebit) in (topologies.items() if spec.uses_collective else [(base.name, topologies[base.name])])
        }
        for topology, record in records.items():
            record["memory_per_rank"] = memory_per_rank(
                spec, context.knobs, groups, world_size, comms[topology], gpu_memory=gpu_memory_bytes, activations=activations, checkpointing=checkpointing
            )
        result[name] = records.pop(base.name) | records
        if ranks_per_node > 1 and spec.shardable:  # with one rank a node sharding changes nothing
            result[name]["sharded"] = sharded(spec, counts, context.knobs)
    if costs is not None:
        _add_speedups(result)
    return result


# A parameter of a numbered block (transformer.h.3., model.layers.3., encoder.layer.3.): FSDP2 unit of that block.
_BLOCK = re.compile(r"^(.*?\.\d+)\.")


def parameter_groups(num_params: int, param_shapes: tuple[tuple[int, ...], ...]) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """The shapes in the trainer's parameter groups (zoa_train.optim.training.parameter_groups: matrices
    and kernels, then the rest), or one vector of num_params where the shapes are unknown or count
    another number."""
    if not param_shapes or sum(math.prod(shape) for shape in param_shapes) != num_params:
        return (((num_params,),),)
    return tuple(s for s in param_shapes if len(s) >= 2), tuple(s for s in param_shapes if len(s) < 2)


def shard_shape(shape: tuple[int, ...], ranks: int) -> tuple[int, ...]:
    """A rank's FSDP2 shard of a tensor of `shape` over `ranks`: ceil(rows / ranks) rows (FSDP2 pads
    every shard to rank 0's)."""
    return (-(-shape[0] // ranks), *shape[1:]) if shape else shape


def largest_fsdp_unit(num_params: int, param_shapes: tuple[tuple[int, ...], ...], param_names: tuple[str, ...]) -> tuple[int, str]:
    """(parameters, which) of FSDP2's largest unit, taking one unit per numbered block (a parameter path
    with a layer index: transformer.h.3, model.layers.3) and the root for the rest (embeddings, final
    norm, output layer), as fully_shard is applied to each block and then to the model; scaled to
    num_params where the shapes count another number. Without names: the whole model."""
    counted = sum(math.prod(shape) for shape in param_shapes)
    if not counted or len(param_names) != len(param_shapes):
        return num_params, "the whole model (units unknown)"
    units: dict[str, int] = {}
    for name, shape in zip(param_names, param_shapes):
        match = _BLOCK.match(name)
        key = match.group(1) if match else ""
        units[key] = units.get(key, 0) + math.prod(shape)
    key = max(units, key=units.get)
    return round(units[key] * num_params / counted), f"a block ({key})" if key else "the root (what no numbered block holds)"


def memory_per_rank(
    spec: OptimizerSpec,
    knobs,
    shapes: tuple[tuple[tuple[int, ...], ...], ...],
    world_size: int,
    collective: Callable[[list[list[int]]], MemoryCounts],
    unit: tuple[int, str] | None = None,
    gpu_memory: float | None = None,
    activations: Mapping[str, int] | None = None,
    checkpointing: str = "none",
) -> dict | None:
    """Bytes one rank holds to train with `spec`'s optimizer over parameters of `shapes` (by group; a
    shard of each when `unit`, FSDP2's largest unit, is given) exchanging among `world_size` ranks
    through `collective`: fp32 params and grads, its optimizer state and scratch, sharded the unit's
    unsharded fp32 params and grads, and `activations[checkpointing]` where counted. None where its
    entry plans none."""
    counts = spec.memory(MemoryContext(shapes, world_size, knobs, collective, unit is not None)) if spec.memory else None
    if counts is None:
        return None
    elements = sum(math.prod(shape) for group in shapes for shape in group)
    record = {"params": 4 * elements, "grads": 4 * elements, "optimizer_state": sum(counts.state.values()), "scratch": sum(counts.scratch.values())}
    if unit is not None:
        record["fsdp_unit"] = 2 * 4 * unit[0]
    if activations is not None:
        record["activations"] = activations[checkpointing]
    record["total"] = sum(record.values())
    if unit is not None:
        record |= {"fsdp_unit_params": unit[0], "fsdp_unit_is": unit[1]}
    record |= {"state_buffers": dict(counts.state), "scratch_buffers": dict(counts.scratch)}
    if gpu_memory is not None:
        record |= {"fits": record["total"] <= gpu_memory, "headroom": gpu_memory - record["total"]}
    if activations is not None:
        record["activations_by_mode"] = dict(activations)
        if gpu_memory is not None:
            without = record["total"] - record["activations"]
            record["fits_with"] = next((mode for mode, size in activations.items() if without + size <= gpu_memory), None)
    return record


def variants(record: dict):
    """(topology, record) of an optimizer's plan: flat, then the other collectives and sharded where planned."""
    base = collectives.default().name
    yield base, record
    for key in (*collectives.names(), "sharded"):
        if key != base and key in record:
            yield key, record[key]


def _add_speedups(result: dict[str, dict]) -> None:
    """Each variant against Adam's (DDP's for flat and node-aware, HSDP for sharded) and the 1-bit
    optimizers' against 1-bit Adam's of the same topology."""
    adam, onebit = result.get(registry.BASELINE), result.get(ONEBIT_BASELINE)
    for name, record in result.items():
        for key, variant in variants(record):
            if not variant["total_time_s"]:
                continue
            if adam:
                variant["speedup_vs_adam"] = dict(variants(adam)).get(key, adam)["total_time_s"] / variant["total_time_s"]
            if onebit and registry.get(name).uses_collective:
                variant["speedup_vs_onebit_adam"] = dict(variants(onebit))[key]["total_time_s"] / variant["total_time_s"]


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise UserError(message)
