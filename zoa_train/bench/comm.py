"""`zoa-train bench comm`: fp32 allreduce vs the 1-bit allreduce on the same tensors, same run.

The bf16 allreduce of the same elements is timed too: it is what the recipes' full-precision rounds
(DDP's bf16 hook, `optimizer.allreduce_dtype: bf16`) send, and what `plan` prices them at.

The 1-bit allreduce is timed with the kernels "auto" picks (fused where the device has them) and
on the torch path, side by side. Each size reports the median time of each collective, their
ratios, the relative L2 error of one
1-bit call and of the running mean of 50 calls against the exact mean, and the memory traffic
of packing plus unpacking next to a plain torch.add of the same size (the bandwidth limit here).

`python -m zoa_train.bench.comm --profile-ops --nproc 2 [--block-size N] [--per-group]` counts the
torch ops (each about one kernel launch on an accelerator) and times one 1-bit step of BERT-Large's
398 tensors in its two parameter groups (docs/results/one-bit-call.md, "Ops per 1-bit call").
"""

import os
import statistics
import time

import torch
import torch.distributed as dist

from zoa_train.comm import CommLedger, OneBitAllReduce, pack_signs, unpack_signs
from zoa_train.comm import registry as collectives
from zoa_train.comm.topology import node_groups, nodes_by_count
from zoa_train.distributed import init_process_group, threads_per_rank
from zoa_train.optim.registry import import_modules

FEEDBACK_CALLS = 50
# What `bench ops` holds per rank and element of the call: the input buffers, the 1-bit call's error
# buffers and wire segments, the torch path's per-block scratch and a random draw: about 11 bytes, rounded up.
BENCH_OPS_BYTES_PER_ELEMENT = 16


def parse_size(text: str) -> int:
    """'64M' -> 67108864, '1k' -> 1024, '1000' -> 1000."""
    text = text.strip()
    units = {"k": 2**10, "m": 2**20, "g": 2**30}
    factor = units.get(text[-1:].lower(), 1)
    number = text[:-1] if factor > 1 else text
    if not number.isdigit() or int(number) <= 0:
        raise ValueError(f"size {text!r} is not a positive count like 1M, 16M or 1000")
    return int(number) * factor


def _median_times(fns, repeats: int, device: torch.device) -> list[float]:
    """Median time of each (prepare, collective) pair over `repeats` rounds. The pairs take turns
    within a round, so a slow spell of the machine hits all of them alike; each collective starts
    together on all ranks and only the collective itself is timed."""
    times = [[] for _ in fns]
    for _ in range(repeats):
        for (prepare, collective), spent in zip(fns, times):
            prepare()
            if device.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            spent.append(_timed(collective, device))
    return [statistics.median(spent) for spent in times]


def _relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return (torch.linalg.vector_norm(approx - exact) / torch.linalg.vector_norm(exact)).item()


def _codec_traffic(numel: int, repeats: int, device: torch.device) -> tuple[float, float]:
    """GB/s of memory traffic for pack+unpack and for torch.add on `numel` fp32 elements."""
    x = torch.randn(numel, device=device)
    packed = torch.empty((numel + 7) // 8, dtype=torch.uint8, device=device)
    unpacked = torch.empty(numel, device=device)
    summed = torch.empty(numel, device=device)

    def codec():
        pack_signs(x, out=packed)
        unpack_signs(packed, numel, out=unpacked)

    def add():
        torch.add(x, x, out=summed)

    codec()
    add()
    codec_s = min(_timed(codec, device) for _ in range(repeats))
    add_s = min(_timed(add, device) for _ in range(repeats))
    codec_bytes = 2 * (numel * 4 + packed.numel())  # read fp32 + write bytes, read bytes + write fp32
    return codec_bytes / codec_s / 1e9, 3 * numel * 4 / add_s / 1e9


def _timed(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


NODE_AWARE = "hierarchical"  # the registry's node-aware collective, timed with --ranks-per-node in columns of its own


def others(node_aware: bool) -> list[collectives.CollectiveSpec]:
    """The registered collectives timed besides flat and node-aware ones (those of --imports): the
    node-aware among them only where there are nodes."""
    return [c for c in collectives.specs()[1:] if c.name != NODE_AWARE and (node_aware or not c.node_aware)]


def rank_main(sizes: list[int], repeats: int, backend: str | None, ranks_per_node: int = 0, imports: tuple[str, ...] = ()) -> list[dict] | None:
    """Body of one rank; rank 0 returns the rows. `ranks_per_node` G (nodes of G consecutive ranks):
    the node-aware 1-bit allreduce is timed too, and the flat one's bytes are split by link. `imports`:
    modules that register collectives of their own, each timed too."""
    import_modules(imports, "--imports")
    device = init_process_group(backend)
    torch.set_num_threads(threads_per_rank(dist.get_world_size()))
    rank, world = dist.get_rank(), dist.get_world_size()
    nodes = node_groups(nodes_by_count(world, ranks_per_node), "cuda" if device.type == "cuda" else "cpu") if ranks_per_node else None
    flat = collectives.default().build
    rows = []
    for numel in sizes:
        comm = flat(collectives.Settings())(numel, device=device, ledger=CommLedger(num_params=numel))
        unfused = flat(collectives.Settings(kernels="torch"))(numel, device=device, ledger=CommLedger(num_params=numel))
        g = torch.Generator().manual_seed(1234 + rank)
        x = torch.zeros(comm.layout.padded, device=device)  # a buffer in the layout: padding at the end
        x[:numel] = torch.randn(numel, generator=g).to(device)
        exact = x.clone()
        dist.all_reduce(exact)
        exact /= world

        work = torch.empty_like(x)
        work_bf16 = torch.empty(numel, dtype=torch.bfloat16, device=device)

        def reset(work=work, x=x):
            work.copy_(x)

        def reset_bf16(work=work_bf16, x=x[:numel]):
            work.copy_(x)

        pairs = [
            (reset, lambda work=work: dist.all_reduce(work)),
            (reset, lambda work=work, comm=comm: comm.op(work)),
            (reset_bf16, lambda work=work_bf16: dist.all_reduce(work)),
            (reset, lambda work=work, comm=unfused: comm.op(work)),
        ]
        if nodes is not None:
            node_aware = collectives.get(NODE_AWARE).build(collectives.Settings(nodes=nodes))(numel, device=device, ledger=CommLedger(num_params=numel))
            pairs.append((reset, lambda work=work, comm=node_aware: comm.op(work)))  # the same layout as the flat call's
        extra = {
            c.name: c.build(collectives.Settings(nodes=nodes))(numel, device=device, ledger=CommLedger(num_params=numel)) for c in others(nodes is not None)
        }
        for other in extra.values():  # the packed elements: its layout may not be flat's
            pairs.append((reset, lambda work=work[:numel], comm=other: comm.op(work)))
        _median_times(pairs, 1, device)  # warm-up
        fp32_s, onebit_s, bf16_s, unfused_s, *more_s = _median_times(pairs, repeats, device)
        node_aware_s, extra_s = more_s[: len(more_s) - len(extra)], more_s[len(more_s) - len(extra) :]

        feedback = OneBitAllReduce(numel, device=device, ledger=CommLedger(num_params=numel))
        running = torch.zeros_like(x)
        for k in range(FEEDBACK_CALLS):
            running += feedback.op(x.clone())
            if k == 0:
                one_call_error = _relative_error(running, exact)
        feedback_error = _relative_error(running / FEEDBACK_CALLS, exact)

        dist.barrier()
        codec_gbps = add_gbps = 0.0
        if rank == 0:  # the other ranks wait, so the measurement has the machine to itself
            codec_gbps, add_gbps = _codec_traffic(numel, repeats, device)
        dist.barrier()
        rows.append(
            {
                "numel": numel,
                "allreduce_fp32_s": fp32_s,
                "allreduce_bf16_s": bf16_s,
                "onebit_s": onebit_s,
                "speedup": fp32_s / onebit_s,
                "kernels": type(comm.kernels).__module__.rsplit(".", 1)[-1].removesuffix("_ops"),
                "onebit_vs_fp32": onebit_s / fp32_s,
                "onebit_torch_path_s": unfused_s,
                "onebit_torch_path_vs_fp32": unfused_s / fp32_s,
                "rel_error_one_call": one_call_error,
                f"rel_error_mean_of_{FEEDBACK_CALLS}": feedback_error,
                "pack_unpack_gbps": codec_gbps,
                "add_gbps": add_gbps,
                "pack_unpack_vs_add": codec_gbps / add_gbps if add_gbps else 0.0,
                "onebit_bytes_per_rank": comm.bytes_per_call,
                "fp32_bytes_per_rank": 2 * (world - 1) * numel * 4 // world,
            }
        )
        if nodes is not None:
            # A flat call sends each of the other ranks the same share, so (n - G) / (n - 1) of its
            # bytes leave the node (the ring allreduce's neighbours are one rank over: 1 in G leaves).
            rows[-1] |= {
                "ranks_per_node": ranks_per_node,
                "node_aware_s": node_aware_s[0],
                "node_aware_speedup": fp32_s / node_aware_s[0],
                "onebit_inter_bytes_per_rank": comm.bytes_per_call * (world - ranks_per_node) // (world - 1),
                "fp32_inter_bytes_per_rank": 2 * (world - 1) * numel * 4 // world // ranks_per_node,
                "node_aware_inter_bytes_per_rank": node_aware.bytes_per_call,
                "node_aware_intra_bytes_per_rank": node_aware.intra_bytes_per_call,
            }
        for (name, other), seconds in zip(extra.items(), extra_s):
            sent = other.ledger.end_step()  # its 1 + repeats calls (warm-up and timed), as each pair above
            rows[-1].setdefault("collectives", {})[name] = {
                "seconds": seconds,
                "vs_fp32": seconds / fp32_s,
                "bytes_per_rank": sent.bytes_sent // (1 + repeats),
                "bits_per_element": sent.bits_per_param / (1 + repeats),
            }
    dist.destroy_process_group()
    return rows if rank == 0 else None


# Ops that only make a view or set metadata: no kernel on an accelerator.
_VIEW_OPS = {
    "aten::view", "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::as_strided", "aten::reshape",
    "aten::_reshape_alias", "aten::expand", "aten::split", "aten::alias", "aten::narrow", "aten::detach", "aten::t",
    "aten::transpose", "aten::permute", "aten::view_as", "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::resize_",
}  # fmt: skip


def bert_large_groups() -> list[list[int]]:
    """Tensor sizes of BERT-Large pre-training (BertForPreTraining: 336M parameters, 398 tensors)
    in the two parameter groups of the BERT recipes: weights (decayed), then biases and LayerNorms."""
    h, ff, vocab = 1024, 4096, 30522
    weights = [vocab * h, 512 * h, 2 * h]  # word, position and token-type embeddings
    others = [h, h]  # embedding LayerNorm
    for _ in range(24):
        weights += [h * h] * 4 + [h * ff, ff * h]  # query, key, value, attention output; feed-forward
        others += [h] * 4 + [h, h] + [ff, h] + [h, h]  # their biases, LayerNorm, feed-forward biases, LayerNorm
    weights += [h * h, h * h, 2 * h]  # pooler, masked-LM transform, next-sentence head (decoder tied)
    others += [h, h, h, h, vocab, 2]  # their biases, the transform's LayerNorm, decoder and head biases
    return [weights, others]


def cpu_profile():
    """torch.profiler over the CPU's ops. A CUDA build's profiler (Kineto) asks the CUDA driver for its
    devices when it writes a trace, whatever activities it was given, and on a machine without one logs
    the refusal as an ERROR line in a run that succeeded (and a line at each start and stop); there
    Kineto's own log is silenced (KINETO_LOG_LEVEL 6, above all its levels, read when the profiler
    starts; a level the user set is kept). A trace that failed would still fail the count here."""
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    return profile(activities=[ProfilerActivity.CPU])


def count_ops(fn) -> dict[str, int]:
    """Torch ops that fn() runs directly (not inside other ops), by name, view ops left out: on
    an accelerator each is about one kernel launch. Only namespaced ops count (aten::, c10d::,
    zoa:: for the fused 1-bit passes): with CUDA the profiler also lists runtime calls
    (cudaEventRecord, cudaStreamSynchronize), which are not ops."""
    from torch.profiler import record_function

    with cpu_profile() as prof:
        with record_function("counted"):
            fn()
    (counted,) = [e for e in prof.events() if e.name == "counted"]
    ops: dict[str, int] = {}
    for child in counted.cpu_children:
        if "::" in child.name and child.name not in _VIEW_OPS:
            ops[child.name] = ops.get(child.name, 0) + 1
    return ops


def profile_rank(groups: list[list[int]], calls: int, block_size: int | None, per_group: bool, backend: str | None) -> dict | None:
    """Ops and time per 1-bit step of tensors of `groups` sizes: one call for all groups, or with
    `per_group` one call per group (as optimizers did before issue 13). Rank 0 returns the figures."""
    device = init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(threads_per_rank(world))
    numel = sum(map(sum, groups))
    if per_group:
        comms = [OneBitAllReduce(sizes, device=device, block_size=block_size, ledger=CommLedger(num_params=numel)) for sizes in groups]
        buffers = [torch.randn(comm.layout.padded, device=device) for comm in comms]
    else:
        comms = [OneBitAllReduce(groups, device=device, block_size=block_size, ledger=CommLedger(num_params=numel))]
        buffers = [[torch.randn(layout.padded, device=device) for layout in comms[0].layouts]]

    def step():
        for comm, buffer in zip(comms, buffers):
            comm.op(buffer)
        if device.type == "cuda":
            torch.cuda.synchronize()

    step()  # warm-up
    seconds = []
    for _ in range(calls):
        dist.barrier()
        seconds.append(_timed(step, device))
    ops = count_ops(step)
    dist.destroy_process_group()
    if rank:
        return None
    return {
        "world_size": world,
        "elements": numel,
        "tensors": sum(map(len, groups)),
        "groups": len(groups),
        "calls_per_step": len(comms),
        "block_size": block_size,
        "ops_per_step": sum(ops.values()),
        "ops": dict(sorted(ops.items(), key=lambda kv: -kv[1])),
        "seconds_per_step": statistics.median(seconds),
    }
