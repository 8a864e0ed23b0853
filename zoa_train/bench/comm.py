"""`zoa-train bench comm`: fp32 allreduce vs the 1-bit allreduce on the same tensors, same run.

Each size reports the median time of each collective, their ratio, the relative L2 error of one
1-bit call and of the running mean of 50 calls against the exact mean, and the memory traffic
of packing plus unpacking next to a plain torch.add of the same size (the bandwidth limit here).
"""

import statistics
import time

import torch
import torch.distributed as dist

from zoa_train.comm import CommLedger, OneBitAllReduce, pack_signs, unpack_signs
from zoa_train.distributed import init_process_group, threads_per_rank

FEEDBACK_CALLS = 50


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


def rank_main(sizes: list[int], repeats: int, backend: str | None) -> list[dict] | None:
    """Body of one rank; rank 0 returns the rows."""
    device = init_process_group(backend)
    torch.set_num_threads(threads_per_rank(dist.get_world_size()))
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for numel in sizes:
        comm = OneBitAllReduce(numel, device=device, ledger=CommLedger(num_params=numel))
        g = torch.Generator().manual_seed(1234 + rank)
        x = torch.zeros(comm.layout.padded, device=device)  # a buffer in the layout: padding at the end
        x[:numel] = torch.randn(numel, generator=g).to(device)
        exact = x.clone()
        dist.all_reduce(exact)
        exact /= world

        work = torch.empty_like(x)

        def reset():
            work.copy_(x)

        pairs = [(reset, lambda: dist.all_reduce(work)), (reset, lambda: comm.op(work))]
        _median_times(pairs, 1, device)  # warm-up
        fp32_s, onebit_s = _median_times(pairs, repeats, device)

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
                "onebit_s": onebit_s,
                "speedup": fp32_s / onebit_s,
                "rel_error_one_call": one_call_error,
                f"rel_error_mean_of_{FEEDBACK_CALLS}": feedback_error,
                "pack_unpack_gbps": codec_gbps,
                "add_gbps": add_gbps,
                "pack_unpack_vs_add": codec_gbps / add_gbps if add_gbps else 0.0,
                "onebit_bytes_per_rank": comm.bytes_per_call,
                "fp32_bytes_per_rank": 2 * (world - 1) * numel * 4 // world,
            }
        )
    dist.destroy_process_group()
    return rows if rank == 0 else None
