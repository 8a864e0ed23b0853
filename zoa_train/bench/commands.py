"""What each `zoa-train bench` command does with its options: check them against this machine (a
UserError of one sentence before any rank starts), run the benchmark, print its table or JSON.
The benchmarks themselves live beside this module (comm.py, netsim.py, optim.py, loader.py)."""

import math
import os
from pathlib import Path

from zoa_train import console
from zoa_train.bench.limits import check_count, check_fits, check_local_ranks, check_positive_finite
from zoa_train.errors import UserError
from zoa_train.files import dumps_json

# What bench comm holds per rank and element of its largest size (zoa_train/bench/comm.py): the input,
# its exact average, fp32 and bf16 work copies, the running sum and a clone per call, two 1-bit
# collectives' buffers and errors, and on rank 0 the codec's buffers: about 44 bytes, rounded up.
BENCH_COMM_BYTES_PER_ELEMENT = 48


def bench_ops(nproc: int, calls: int, block_size: int, per_group: bool, scale: int) -> None:
    from zoa_train.bench.comm import BENCH_OPS_BYTES_PER_ELEMENT, bert_large_groups, profile_rank
    from zoa_train.bench.limits import RANK_PROCESS_BYTES
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


def bench_comm(sizes: str, nproc: int, backend: str, repeats: int, ranks_per_node: int, as_json: bool, imports: tuple[str, ...] = ()) -> None:
    """Here: start `nproc` ranks; under torchrun or srun: one of their ranks (rank 0 prints). `imports`:
    modules that register collectives, imported here (refused in one sentence) and by every rank."""
    from zoa_train.bench.comm import parse_size, rank_main
    from zoa_train.distributed import cluster_environment, launch_local
    from zoa_train.optim.registry import import_modules

    try:
        numels = [parse_size(s) for s in sizes.split(",") if s.strip()]
    except ValueError as e:
        raise UserError(f"--sizes: {e}.") from None
    check_local_ranks(nproc)
    check_count("--repeats", repeats)
    if backend not in ("", "gloo", "nccl"):
        raise UserError(f"--backend must be gloo or nccl, not {backend!r}.")
    world = int(os.environ["WORLD_SIZE"]) if cluster_environment() is not None else nproc
    if ranks_per_node < 0 or (ranks_per_node and (world % ranks_per_node or world == ranks_per_node)):
        raise UserError(f"--ranks-per-node must divide the {world} ranks into two or more nodes, not {ranks_per_node}.")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if cluster_environment() is not None else nproc
    check_bench_comm_machine(backend, local, max(numels, default=0))
    import_modules(imports, "--imports")
    if cluster_environment() is None:
        rows = launch_local(rank_main, nproc, numels, repeats, backend or None, ranks_per_node, imports)[0]
    else:
        rows = rank_main(numels, repeats, backend or None, ranks_per_node, imports)
        if rows is None:  # not rank 0
            return
        nproc = world
    result = {"nproc": nproc, "backend": backend or "default", "repeats": repeats, "ranks_per_node": ranks_per_node, "results": rows}
    if as_json:
        print(dumps_json(result))
    else:
        _print_comm_tables(rows, nproc, ranks_per_node)


def _print_comm_tables(rows: list[dict], nproc: int, ranks_per_node: int) -> None:
    from rich.table import Table

    from zoa_train.bench.comm import FEEDBACK_CALLS
    from zoa_train.plan.units import format_bytes

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
    console.out.print(table)
    if ranks_per_node:
        nodes = Table(title=f"flat vs node-aware 1-bit allreduce, {nproc // ranks_per_node} nodes x {ranks_per_node} ranks: time and bytes per rank per call")
        for name in ("elements", "flat 1-bit s", "node-aware s", "node-aware vs fp32", "flat between nodes", "node-aware between nodes", "node-aware inside"):
            nodes.add_column(name, justify="right")
        for r in rows:
            nodes.add_row(f"{r['numel']:,}", f"{r['onebit_s']:.4f}", f"{r['node_aware_s']:.4f}", f"{r['node_aware_speedup']:.2f}x",
                          format_bytes(r["onebit_inter_bytes_per_rank"]), format_bytes(r["node_aware_inter_bytes_per_rank"]),
                          format_bytes(r["node_aware_intra_bytes_per_rank"]))  # fmt: skip
        console.out.print(nodes)
    timed = [name for name in rows[0].get("collectives", {})] if rows else []
    if timed:  # the other registered collectives (--imports)
        others = Table(title=f"other registered collectives, {nproc} ranks: time and bytes per rank per call")
        for name in ("elements", "collective", "s", "vs fp32", "bytes", "bits/element"):
            others.add_column(name, justify="right")
        for r in rows:
            for name, c in r["collectives"].items():
                others.add_row(
                    f"{r['numel']:,}", name, f"{c['seconds']:.4f}", f"{c['vs_fp32']:.2f}x", format_bytes(c["bytes_per_rank"]), f"{c['bits_per_element']:.3f}"
                )
        console.out.print(others)


def check_bench_comm_machine(backend: str, local_ranks: int, numel: int) -> None:
    """Refuse a backend or a size this machine cannot give `local_ranks` ranks, before starting any."""
    import torch

    from zoa_train.bench.limits import available_memory
    from zoa_train.plan.units import format_bytes

    gpus = torch.cuda.device_count()
    nccl = (backend or ("nccl" if gpus else "gloo")) == "nccl"
    if nccl and gpus < local_ranks:
        raise UserError(f"--backend nccl needs a GPU for each of the {local_ranks} local ranks and this machine has {gpus}; pass --backend gloo.")
    if nccl:  # each rank its own GPU, judged by its size (asking for its free memory would give this process a context on each)
        room, where, whom = min(torch.cuda.get_device_properties(i).total_memory for i in range(local_ranks)), "on its GPU", "each rank"
    else:
        room, where, whom = available_memory(), "of memory available on this machine", f"{local_ranks} ranks"
    need = BENCH_COMM_BYTES_PER_ELEMENT * numel * (1 if nccl else local_ranks)
    if need > room:
        raise UserError(
            f"--sizes {numel:,} elements need about {format_bytes(need)} for {whom} and there are {format_bytes(room)} {where}; pass smaller sizes."
        )


def bench_netsim(
    recipe: Path,
    overrides: list[str],
    *,
    ranks: int,
    nodes: int | None,
    ranks_per_node: int,
    shard: bool,
    bandwidth: str,
    intra_bandwidth: str,
    latency: str,
    optimizers: str,
    steps: int,
    comm_sizes: str,
    out: Path,
    margin: float,
    target_loss: float | None,
    as_json: bool,
    variants: list[str] = (),
) -> int:
    """The exit code: 0, or 1 where a rank failed (said in one sentence)."""
    from zoa_train.bench.netsim import RankFailed, format_netsim, parse_optimizers, parse_variants, run_netsim
    from zoa_train.config import load_recipe
    from zoa_train.plan.recipe import count_parameters

    world = check_netsim_options(ranks, nodes, ranks_per_node, shard, steps, margin, target_loss)
    overrides = [*overrides, *([f"train.steps={steps}"] if steps else [])]
    config = load_recipe(recipe, overrides)  # also imports the modules that register its optimizers
    names, extra = parse_optimizers(optimizers), parse_variants(list(variants))
    num_params = count_parameters(config)
    numels = _comm_numels(comm_sizes, num_params)
    if not names and not extra and not numels:
        raise UserError("--optimizers none and --comm-sizes none leave nothing to run.")
    # bench comm over the links holds what it holds on one machine (--sizes), on every rank of this one
    check_fits(f"--comm-sizes {max(numels, default=0):,} elements", BENCH_COMM_BYTES_PER_ELEMENT * max(numels, default=0) * world, "pass smaller --comm-sizes")
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
            progress=lambda m: console.err.print(m, highlight=False),
            margin=margin,
            ranks_per_node=ranks_per_node,
            intra_bandwidth=intra_bandwidth,
            num_params=num_params,
            target_loss=target_loss,
            shard=shard,
            variants=extra,
        )
    except RankFailed as e:
        console.error(str(e))
        return 1
    if as_json:
        print(dumps_json(result))
    else:
        console.out.print(format_netsim(result))
    return 0


def check_netsim_options(ranks: int, nodes: int | None, ranks_per_node: int, shard: bool, steps: int, margin: float, target_loss: float | None) -> int:
    """bench netsim's counts and fractions (UserError of one sentence); the ranks in all."""
    if steps < 0:
        raise UserError("--steps must be positive (0 keeps the recipe's train.steps).")
    for option, count in (("--nodes", nodes), ("--ranks-per-node", ranks_per_node)):
        if count is not None and count < 1:
            raise UserError(f"{option} must be at least 1, not {count}.")
    if ranks_per_node > 1 and nodes is None:
        raise UserError("--ranks-per-node needs --nodes: pass --nodes N --ranks-per-node G for N namespaces of G ranks.")
    if shard and ranks_per_node < 2:
        raise UserError("--shard shards inside each node, so it needs --nodes N --ranks-per-node G with G of 2 or more.")
    if not 0 <= margin < 1:
        raise UserError(f"--margin must be a fraction in [0, 1), not {margin}.")
    if target_loss is not None and not (math.isfinite(target_loss) and target_loss > 0):
        raise UserError(f"--target-loss must be a positive loss, not {target_loss}.")
    return nodes * ranks_per_node if nodes else ranks


def _comm_numels(comm_sizes: str, num_params: int) -> list[int]:
    """--comm-sizes: element counts, none, or the model's parameter count."""
    from zoa_train.bench.comm import parse_size

    if comm_sizes.strip() == "none":
        return []
    elif comm_sizes.strip():
        try:
            return [parse_size(s) for s in comm_sizes.split(",") if s.strip()]
        except ValueError as e:
            raise UserError(f"--comm-sizes: {e}.") from None
    return [num_params]


def bench_optim(params_millions: float, repeats: int, threads: int, device: str, as_json: bool) -> None:
    import torch

    from zoa_train.bench.optim import check_optimizer_bench_memory, format_optimizer_bench, run_optimizer_bench

    check_positive_finite("--params-millions", params_millions)
    check_count("--repeats", repeats)
    check_count("--threads", threads, 0, os.cpu_count() or 1)  # 0: all cores
    try:
        where = torch.device(device)
    except RuntimeError:
        raise UserError(f"--device must be cpu, cuda or cuda:N, not {device!r}.") from None
    if where.type not in ("cpu", "cuda") or (where.type == "cuda" and not torch.cuda.is_available()):
        raise UserError(f"--device {device}: this machine has no such device (CUDA available: {torch.cuda.is_available()}).")
    check_optimizer_bench_memory(params_millions, where)
    result = run_optimizer_bench(params_millions, repeats, threads or None, device)
    if as_json:
        print(dumps_json(result, default=str))
    else:
        console.out.print(format_optimizer_bench(result))


def bench_loader(recipe: Path, overrides: list[str], batches: int, step_time: str, as_json: bool) -> None:
    from zoa_train.bench.loader import run_loader_bench
    from zoa_train.config import load_recipe
    from zoa_train.plan.units import parse_latency

    check_count("--batches", batches)
    step_s = None
    if step_time:
        try:
            step_s = parse_latency(step_time)
        except UserError:
            step_s = 0.0
        if not step_s > 0:
            raise UserError(f"--step-time {step_time!r} is not understood: expected a positive time with a unit ns, us, ms or s, e.g. 250ms.")
    r = run_loader_bench(load_recipe(recipe, overrides), batches, step_s)
    if as_json:
        print(dumps_json(r))
        return
    unit = r["unit"]
    how = f"measured here: forward, backward and AdamW on {r['step_threads']} thread(s), a rank's share" if r["step_time"] == "measured" else "given"
    console.out.print(
        f"rank 0 of {r['world_size']}: the loader gives {r['loader_units_per_s_per_rank']:,.0f} {unit}/s "
        f"({r['loader_s_per_batch'] * 1e3:.2f} ms per micro-batch of {r['micro_batch_size']}); "
        f"the trainer takes {r['trainer_units_per_s_per_rank']:,.0f} {unit}/s per rank "
        f"({r['units_per_step_per_rank']:,} {unit} a step in {r['step_s'] * 1e3:.1f} ms, {how}): "
        f"the loader is {r['loader_over_trainer']:,.1f}x the trainer's need (target: at least 10x)"
    )
