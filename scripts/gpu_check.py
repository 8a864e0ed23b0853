"""GPU validation, prepared for the day a GPU is lent (one GPU, no network, a few minutes):

    python scripts/gpu_check.py                 # on CUDA: every check below
    python scripts/gpu_check.py --device cpu    # the same checks on the CPU (the test suite runs them
                                                # with --quick --skip runs: on the CPU, section 3 is
                                                # tests/test_run.py's end-to-end run and resume)

1. sign packing and unpacking on the device equal the CPU's, bit for bit;
2. one step of each optimizer on the device equals the same step on the CPU (one rank; the math of the
   flat state, the denominators, update clipping, weight decay);
3. short `zoa-train run`s of recipes/gpt2_tiny.yaml on one rank with each optimizer (the field's baselines
   PowerSGD and DiLoCo too; NCCL on CUDA), in bf16 and fp16 on CUDA, and a run stopped at a checkpoint and
   resumed that ends on exactly the parameters of an uninterrupted one (checkpoints read to the CPU, device
   RNG restored through it); the same for PowerSGD, whose hook keeps DDP's overlapped buckets on NCCL: its
   resumed run ends within 1e-5 of the uninterrupted one (the first resumed step has other buckets, whose
   matrix products round differently; on Gloo it is exact);
4. two ranks sharing the device (Gloo: it takes CUDA tensors for every collective the project uses and
   stages them through host memory; NCCL refuses two ranks on one GPU):
   - the 1-bit allreduce (two parameter groups, a few calls, so the error feedback is exercised) on
     device buffers equals the same calls on CPU buffers, and both ranks hold the same average;
   - ZeroOneAdam trains a small model, each rank on its own data, through the variance freeze and
     local-step periods: after every sync the parameters are bit-identical across ranks;
   - one 1-bit call of BERT-Large's 398 tensors (`zoa-train bench ops`' sizes; divided by 16 with
     --quick): torch ops per call (and CUDA kernel launches, from torch.profiler), host wall time and
     device busy time per call; it fails when the ops or launches exceed what the design allows;
5. the node-aware 1-bit sync (zoa_train/comm/hierarchical.py), four Gloo ranks sharing the device as 2
   nodes x 2 ranks: on device buffers it equals the same calls on CPU buffers, every rank holds the same
   average, and ZeroOneAdam through it keeps the parameters bit-identical across ranks after every sync;
   with 2 or more GPUs, the same sync over NCCL, a rank per GPU (2 GPUs: one node of 2, where it is the
   exact average; 4 or more: 2 nodes), every rank holding the same average;
6. rounds overlapped with backward (zoa_train/comm/buckets.py), two Gloo ranks sharing the device:
   ZeroOneAdam in buckets with its rounds started during backward (on CUDA a background thread and a
   stream of its own) equals the same buckets started in step(), bit for bit, after every step;
7. sharded inside the node (zoa_train/comm/sharding.py): ZeroOneAdam on a model sharded with FSDP2 over
   2 nodes x 2 ranks equals it unsharded on 2 ranks that see their nodes' micro-batches (CPU: Gloo, bit
   for bit; CUDA: NCCL, a GPU per rank, 4 GPUs or SKIP); and in buckets cut by whole tensors, its rounds
   started as FSDP2 reduces each layer equal the same buckets in step(), bit for bit;
8. the integrations (zoa_train.integrations) on the device, one rank under torchrun (NCCL on CUDA): the HF
   Trainer example (ZoaTrainer: no DDP, accelerate's placement and, on CUDA, bf16 autocast), the accelerate
   example and the Lightning example (SelfSyncingStrategy), each through 0/1 Adam's warm-up into its
   local steps: the run completes, its loss falls and stays finite, and the model it trained sits on the
   device; SKIP where transformers, accelerate or lightning is not installed;
9. what a large model needs (issue 50), one rank: activation checkpointing trains the same model, compiled
   blocks within 1e-4 of eager, and a few steps of a Llama (llama_1b on CUDA) with and without
   recomputation logging every rank's peak memory and MFU, the peaks' difference beside plan's count;
10. on CUDA, `zoa-train bench optim`: 0/1 Adam's local step against AdamW(fused), target 1.1x.
What one GPU cannot validate: NCCL between ranks and the 1-bit collectives over NCCL (two GPUs), and
communication speed (Gloo through host memory on one machine says nothing of NCCL over NVLink or a
network; the two ranks also share the GPU's time). Prints one line per check; exit 1 on a failure.
"""

import argparse
import functools
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zoa_train.bench.comm import bert_large_groups, count_ops  # noqa: E402
from zoa_train.comm import ClusterCollective, CommLedger, OneBitAllReduce, onebit_layout, pack_signs, unpack_signs  # noqa: E402
from zoa_train.comm.buckets import BucketedCollective  # noqa: E402
from zoa_train.comm.kernels import PartViews, backend, select_kernels  # noqa: E402
from zoa_train.comm.kernels.torch_ops import block_elements  # noqa: E402
from zoa_train.distributed import init_process_group, threads_per_rank  # noqa: E402
from zoa_train.optim import DataParallelAdam, OneBitAdam, ZeroOneAdam  # noqa: E402

FAILED = []


def report(name: str, ok: bool, detail: str = "", against_cpu: torch.device | None = None) -> None:
    """PASS or FAIL; a check of a device against the CPU (`against_cpu`: that device) that ran on the
    CPU itself is SKIP when it holds: it compared the CPU with itself through the same code, which
    runs the script's paths but proves nothing a GPU run would."""
    status = "PASS" if ok else "FAIL"
    if ok and against_cpu is not None and against_cpu.type == "cpu":
        status, detail = "SKIP", "the CPU against itself: a check for a GPU"
    print(f"{status}  {name}{'  ' + detail if detail else ''}", flush=True)
    if not ok:
        FAILED.append(name)


def check_packing(device: torch.device) -> None:
    x = torch.randn(3 * (1 << 20) + 5, generator=torch.Generator().manual_seed(0))
    x[::97] = 0.0
    start = time.perf_counter()
    packed = pack_signs(x.to(device))
    signs = unpack_signs(packed, x.numel(), 0.5)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    reference = pack_signs(x)
    ok = torch.equal(packed.cpu(), reference) and torch.equal(signs.cpu(), unpack_signs(reference, x.numel(), 0.5))
    report("pack/unpack equal the CPU's", ok, f"{x.numel():,} signs in {elapsed * 1e3:.1f} ms", against_cpu=device)


def check_optimizers(device: torch.device) -> None:
    for name, make in (
        ("DataParallelAdam", lambda p: DataParallelAdam(p, lr=1e-2, weight_decay=0.1, bias_correction=True)),
        ("OneBitAdam", lambda p: OneBitAdam(p, lr=1e-2, weight_decay=0.1, freeze_step=2)),
        ("ZeroOneAdam", lambda p: ZeroOneAdam(p, lr=1e-2, weight_decay=0.1, var_freeze_step=4, var_update_scaler=1)),
    ):
        results = []
        for where in (torch.device("cpu"), device):
            params = [torch.nn.Parameter(torch.linspace(-1, 1, n, device=where)) for n in (5000, 37)]
            opt = make(params)
            for t in range(6):
                for i, p in enumerate(params):
                    g = torch.Generator().manual_seed(10 * t + i)
                    p.grad = torch.randn(p.shape, generator=g).to(where) * (1 + t)
                opt.step()
            results.append([p.detach().cpu() for p in params])
        ok = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(*results))
        report(f"{name}: 6 steps on {device.type} equal the CPU's", ok, against_cpu=device)


def zoa(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zoa_train.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def check_runs(device: torch.device, quick: bool) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    precisions = ["bf16", "fp16"] if device.type == "cuda" else ["fp32"]
    optimizers = ["zero_one_adam"] if quick else ["adam", "onebit_adam", "zero_one_adam", "powersgd", "diloco"]
    with tempfile.TemporaryDirectory() as tmp:
        common = [
            "train.nproc=1",
            f"train.backend={backend}",
            "train.log_every=1",
            "train.val_every=0",
            "train.val_batches=1",
            "logging.wandb=disabled",
            "logging.tensorboard=false",
            "optimizer.freeze_step=2",
            "optimizer.var_freeze_step=2",
            "optimizer.local_steps=fixed",
            "optimizer.local_step_interval=2",
            "optimizer.powersgd_rank=2",
            "optimizer.sync_every=2",
            f"data.cache_dir={tmp}/cache",
        ]
        for precision in precisions:
            for optimizer in optimizers:
                out = f"{tmp}/{precision}_{optimizer}"
                sets = [*common, "train.steps=6", f"train.precision={precision}", f"optimizer.name={optimizer}"]
                start = time.perf_counter()
                done = zoa("run", "recipes/gpt2_tiny.yaml", "--out", out, *[a for s in sets for a in ("--set", s)])
                detail = f"{time.perf_counter() - start:.1f} s" if done.returncode == 0 else done.stderr.strip().splitlines()[-1][:300]
                report(f"run {optimizer} {precision} on {backend}", done.returncode == 0, detail)
        # resume: stop at the step-3 checkpoint (inside a local-step period; PowerSGD compressing), continue,
        # compare with a whole run
        resumes = [("zero_one_adam", "resume inside a local-step period ends on the uninterrupted run's parameters", 0.0)]
        if not quick:
            resumes.append(("powersgd", "PowerSGD resumed mid-compression ends within 1e-5 of the uninterrupted run", 0.0 if backend == "gloo" else 1e-5))
        for optimizer, name, tolerance in resumes:
            sets = [
                *common,
                "train.steps=6",
                "train.checkpoint_every=3",
                f"optimizer.name={optimizer}",
                "model.dropout=0.1",
                f"train.precision={precisions[0]}",
            ]
            flags = [a for s in sets for a in ("--set", s)]
            whole = zoa("run", "recipes/gpt2_tiny.yaml", "--out", f"{tmp}/whole_{optimizer}", *flags)
            resumed = zoa(
                "run", "recipes/gpt2_tiny.yaml", "--out", f"{tmp}/resumed_{optimizer}", "--resume", f"{tmp}/whole_{optimizer}/checkpoints/step_00000003", *flags
            )
            ok, detail = whole.returncode == 0 and resumed.returncode == 0, ""
            if ok:
                a = torch.load(f"{tmp}/whole_{optimizer}/checkpoints/step_00000006/model.pt")
                b = torch.load(f"{tmp}/resumed_{optimizer}/checkpoints/step_00000006/model.pt")
                worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
                ok, detail = worst <= tolerance, f"largest difference {worst:.2e}"
            report(name, ok, detail)


# --- the fused 1-bit kernels, pass by pass (zoa_train/comm/kernels) ------------------------------


def emulated_part(n: int, rows: int, row: int, device: torch.device, seed: int = 0) -> PartViews:
    """One buffer of a 1-bit call on n emulated ranks (this process is rank 0), on `device`: rows of
    values of many magnitudes, random received and gathered signs and scales, a short first and
    last row (padding), as the collective's own views are shaped (wire segments, strided)."""
    g = torch.Generator().manual_seed(seed)
    chunk, segment = rows * row, rows * row // 8 + 4 * rows

    def wire(k: int):
        w = torch.zeros(k, segment, dtype=torch.uint8, device=device)
        return w[:, : chunk // 8], w[:, chunk // 8 :].view(torch.float32)

    (send_signs, send_scales), (recv_signs, recv_scales), (gathered_signs, gathered_scales), (mine_signs, mine_scales) = (wire(k) for k in (n, n, n, 1))
    valid = torch.full((n, rows), row, dtype=torch.int32)
    valid[0, 0], valid[-1, -1] = 5, row - 24
    worker = torch.randn(n, rows, row, generator=g) * torch.logspace(-4, 4, n * rows).view(n, rows, 1)
    for signs, scales in ((recv_signs, recv_scales), (gathered_signs, gathered_scales)):
        signs.copy_(torch.randint(0, 256, signs.shape, generator=g, dtype=torch.uint8))
        scales.copy_(torch.rand(scales.shape, generator=g) * 3)
    return PartViews(worker=worker.to(device), valid=valid.to(device), norm=valid.clamp(min=1).float().sqrt().to(device), send_signs=send_signs,
                     send_scales=send_scales, recv_signs=recv_signs, recv_scales=recv_scales, server=torch.randn(1, rows, row, generator=g).to(device),
                     rank=0, mine_signs=mine_signs, mine_scales=mine_scales, gathered_signs=gathered_signs, gathered_scales=gathered_scales)  # fmt: skip


def kernel_passes(kernels, device: torch.device, shape: tuple[int, int, int]) -> dict[str, torch.Tensor]:
    """The three passes of backend class `kernels` on an emulated buffer: inputs and outputs, on the CPU."""
    p = emulated_part(*shape, device)
    y, c0 = p.worker.clone(), p.server.clone()
    run = kernels([p], device, None)
    run.worker(0, None)
    run.server(0)
    out = torch.empty(p.worker.numel(), device=device)
    run.output(0, out)
    return {name: t.cpu() for name, t in dict(y=y, c0=c0, out=out, **p._asdict()).items() if isinstance(t, torch.Tensor)}


def compare_passes(fused: dict, ref: dict) -> tuple[bool, str]:
    """The fused passes against the torch path's on the same device: sign bits and outputs equal;
    scales within the last bits (the row's sum of squares is reduced in another order: a tree on
    GPUs, double lanes on CPUs); each error the torch formula y + s - 2s[y >= 0] with the fused
    scale, exactly (its other arithmetic is elementwise and exact in the same order)."""
    problems = []
    for signs in ("send_signs", "mine_signs"):
        if not torch.equal(fused[signs], ref[signs]):
            problems.append(f"{signs} differ")
    worst = 0.0
    for scales in ("send_scales", "mine_scales"):
        worst = max(worst, float(((fused[scales] - ref[scales]).abs() / ref[scales].abs().clamp(min=1e-30)).max()))
    if worst > 1e-6:
        problems.append(f"scales differ by {worst:.1e} relative")
    real = torch.arange(fused["worker"].shape[2]) < fused["valid"][..., None]
    y = torch.where(real, fused["y"], 0.0)
    s = fused["send_scales"].unsqueeze(2)
    if not torch.equal(fused["worker"], torch.where(real, (y + s).addcmul(torch.ge(y, 0).float(), s, value=-2), 0.0)):
        problems.append("worker errors are not the torch formula with the fused scales")
    if not torch.equal(fused["out"], ref["out"]):
        problems.append("outputs differ")
    return not problems, "; ".join(problems) or f"bits and outputs equal, scales within {worst:.1e} relative"


def time_pass(fn, device: torch.device, repeats: int = 20) -> float:
    """Median seconds of fn() (CUDA events on a GPU)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def copy_seconds(elements: int, device: torch.device) -> float:
    source, target = torch.randn(elements, device=device), torch.empty(elements, device=device)
    return time_pass(lambda: target.copy_(source), device)


def pass_seconds(kernels, device: torch.device) -> dict[str, float]:
    """Median seconds of each pass of backend class `kernels` on an emulated BANDWIDTH_SHAPE buffer."""
    p = emulated_part(*BANDWIDTH_SHAPE, device)
    run, out = kernels([p], device, None), torch.empty(p.worker.numel(), device=device)
    return {
        "worker": time_pass(lambda: run.worker(0, None), device),
        "server": time_pass(lambda: run.server(0), device),
        "output": time_pass(lambda: run.output(0, out), device),
    }


BANDWIDTH_SHAPE = (2, 1 << 14, 4096)  # 2 ranks, 16,384 rows of 4,096: 128M elements (512 MiB of fp32)
TARGET_OF_COPY = 0.6


def check_kernels(device: torch.device) -> None:
    fused = select_kernels("auto", device)
    name = fused.__module__.rsplit(".", 1)[-1]
    for shape in ((2, 64, 4096), (3, 5, 1056), (4, 1, 32)):
        ok, detail = compare_passes(kernel_passes(fused, device, shape), kernel_passes(backend("torch"), device, shape))
        report(
            f"{name} 1-bit kernels on {device.type} equal the torch path pass by pass, {shape[0]} ranks x {shape[1]} rows of {shape[2]}",
            ok and name != "torch_ops",
            detail,
        )
    if device.type != "cuda":
        print(f"SKIP  {name} kernels' memory bandwidth  timed on a GPU only (a shared CPU times its neighbours)", flush=True)
        return
    # Bandwidth of each pass, as bytes it must move over its time, against a copy of the buffer in
    # the same run (read and write, what HBM gives a streaming kernel); and the torch path's time.
    n, rows, row = BANDWIDTH_SHAPE
    elements = n * rows * row
    moved = {"worker": elements * (8 + 1 / 8), "server": rows * row * (8 + n / 8), "output": elements * (4 + 1 / 8)}
    copy_bw = 8 * elements / copy_seconds(elements, device)
    seconds = {kernels: pass_seconds(kernels, device) for kernels in (fused, backend("torch"))}
    shares = {k: moved[k] / seconds[fused][k] / copy_bw for k in moved}
    detail = ", ".join(
        f"{k} {moved[k] / seconds[fused][k] / 1e12:.2f} TB/s ({shares[k]:.0%} of the copy's; {seconds[fused][k] * 1e3:.2f} ms vs torch path {seconds[backend('torch')][k] * 1e3:.2f} ms)"
        for k in moved
    )
    report(
        f"{name} kernels at >= {TARGET_OF_COPY:.0%} of a copy's bandwidth ({copy_bw / 1e12:.2f} TB/s), {elements:,} elements",
        min(shares.values()) >= TARGET_OF_COPY,
        detail,
    )
    from zoa_train.bench.comm import _codec_traffic

    codec, add = _codec_traffic(elements, 10, device)
    report(
        f"pack + unpack at >= 0.5 of torch.add's bandwidth on {device.type}: {codec / add:.2f}", codec / add >= 0.5, f"{codec:.0f} GB/s vs add {add:.0f} GB/s"
    )


# --- two Gloo ranks on one device -------------------------------------------------------------

RANKS = 2
ALLREDUCE_CALLS = 4
# Tensor sizes of two parameter groups: whole scale rows, a tensor ending mid-row, small tensors
# sharing rows, so the layout has padding in both groups.
ALLREDUCE_GROUPS = [[3 * 4096, 5000, 37, 100_003], [7, 300, 64, 1]]
ZERO_ONE_STEPS = 18  # variance updates at steps 0, 1, 3; the freeze at 6; then a sync every 3 steps
QUICK_SCALE = 16  # --quick divides BERT-Large's tensor sizes by this (the same 398 tensors)


def rank_main(rank: int, tmp: str, device_name: str, quick: bool) -> None:
    """One of RANKS processes: joins the Gloo group, runs the multi-rank checks' parts on this
    rank and saves what they return for the parent to compare."""
    device = torch.device(device_name)
    torch.set_num_threads(threads_per_rank(RANKS))
    init_process_group("gloo", timeout_s=120, init_method=f"file://{tmp}/store", rank=rank, world_size=RANKS)
    parts = {
        "allreduce": lambda: allreduce_on_rank(rank, device),
        "zero_one": lambda: zero_one_on_rank(rank, device),
        "delayed": lambda: [zero_one_fixed_gradients(rank, device, delay) for delay in (0, 1)],
        "ops": lambda: ops_on_rank(device, quick),
    }
    results = {}
    for part, run in parts.items():
        results[part] = run()
        torch.save(results, f"{tmp}/rank{rank}.pt")  # after each part, so a later failure keeps it
    dist.barrier()
    dist.destroy_process_group()


def allreduce_on_rank(rank: int, device: torch.device, collective=OneBitAllReduce, on_cpu: bool = True) -> dict[str, list[torch.Tensor]]:
    """The same inputs through a `collective` (a factory) on `device` and one on the CPU, call by
    call; each call's outputs (both groups, back to back) on the CPU."""
    numel = sum(map(sum, ALLREDUCE_GROUPS))
    places = (device, torch.device("cpu")) if on_cpu else (device,)
    comms = [collective(ALLREDUCE_GROUPS, group=None, device=where, ledger=CommLedger(num_params=numel)) for where in places]
    outputs: dict[str, list[torch.Tensor]] = {"device": [], "cpu": []}
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(ALLREDUCE_CALLS):
        inputs = []
        for layout in comms[0].layouts:
            buffer = torch.zeros(layout.padded)
            for i, (offset, size) in enumerate(zip(layout.offsets, layout.sizes)):
                # magnitudes that differ by tensor, as layers' gradients do
                buffer[offset : offset + size] = torch.randn(size, generator=g) * 10.0 ** (i % 4 - 2)
            inputs.append(buffer)
        for comm, key in zip(comms, ("device", "cpu")[: len(comms)]):
            out = comm.op([x.to(comm.device, copy=True) for x in inputs])  # op averages in place
            outputs[key].append(torch.cat(out).cpu())
    return outputs


def zero_one_on_rank(rank: int, device: torch.device, collective=OneBitAllReduce) -> list[tuple[bool, int, torch.Tensor]]:
    """(synced, interval, parameters flattened) after each ZeroOneAdam step of a small model,
    each rank on its own data."""
    torch.manual_seed(0)  # the optimizer starts every rank from rank 0's parameters anyway
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.LayerNorm(64), torch.nn.Tanh(), torch.nn.Linear(64, 4)).to(device)
    weights = [p for p in model.parameters() if p.dim() > 1]
    others = [p for p in model.parameters() if p.dim() <= 1]
    optimizer = ZeroOneAdam(
        [{"params": weights, "weight_decay": 0.01}, {"params": others, "weight_decay": 0.0}],
        lr=1e-2, var_freeze_step=6, var_update_scaler=1, local_steps="fixed", local_step_interval=3, collective=collective,
    )  # fmt: skip
    g = torch.Generator().manual_seed(1000 + rank)
    records = []
    for _ in range(ZERO_ONE_STEPS):
        x, y = torch.randn(32, 16, generator=g).to(device), torch.randn(32, 4, generator=g).to(device)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
        records.append((optimizer.last_step.synced, optimizer.last_step.interval, flat))
    return records


def ops_on_rank(device: torch.device, quick: bool) -> dict:
    """Ops, CUDA launches and times of one 1-bit call of BERT-Large's tensors on `device`, with the
    kernels "auto" picks there (fused) and with the torch path."""
    scale = QUICK_SCALE if quick else 1
    groups = [[max(1, size // scale) for size in sizes] for sizes in bert_large_groups()]
    numel = sum(map(sum, groups))
    results = {}
    for kernels in ("auto", "torch"):
        # The torch path with the accelerators' default blocks also on the CPU, so the CPU counts the ops a GPU runs.
        shapes = [(dist.get_world_size(), l.rows, l.row) for l in (onebit_layout(sizes, dist.get_world_size()) for sizes in groups)]
        block = None if device.type == "cuda" or kernels == "auto" else block_elements(shapes, torch.device("cuda"))
        comm = OneBitAllReduce(groups, device=device, block_size=block, ledger=CommLedger(num_params=numel), kernels=kernels)
        buffers = [torch.randn(layout.padded, device=device) for layout in comm.layouts]

        def call(comm=comm, buffers=buffers):
            comm.op(buffers)
            if device.type == "cuda":
                torch.cuda.synchronize()

        call()  # warm-up: allocator, Gloo's pinned staging buffers, the sign tables, Triton's compilation
        seconds = []
        for _ in range(3 if quick else 5):
            dist.barrier()  # both ranks start together, so neither times the other's lateness
            start = time.perf_counter()
            call()
            seconds.append(time.perf_counter() - start)
        result = {"elements": numel, "tensors": sum(map(len, groups)), "groups": len(groups), "backend": type(comm.kernels).__module__.rsplit(".", 1)[-1],
                  "blocks": getattr(comm.kernels, "blocks_per_call", 0), "names": count_ops(call), "host_s": statistics.median(seconds)}  # fmt: skip
        result["ops"] = sum(result["names"].values())
        if device.type == "cuda":
            result.update(cuda_launches(call))
        results[kernels] = result
    return results


def cuda_launches(call) -> dict:
    """Kernel launches (the CUDA runtime's or driver's *LaunchKernel* calls on the host), kernels
    seen on the device, and the device's busy time (kernels and copies) of one call()."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
    events = prof.events()
    on_device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    return {
        "launches": sum("LaunchKernel" in e.name for e in events if e.device_type == torch.autograd.DeviceType.CPU),
        "kernels": sum(not e.name.startswith(("Memcpy", "Memset")) for e in on_device),
        "device_s": sum(e.time_range.elapsed_us() for e in on_device) / 1e6,
    }


def zero_one_fixed_gradients(rank: int, device: torch.device, sync_delay: int) -> tuple[str, torch.Tensor]:
    """ZeroOneAdam with `sync_delay` on gradients that depend on the step and the rank only: (the step
    kinds, the parameters after synchronize()). A delayed round runs on its own thread and, on CUDA, its
    own stream while the next step runs on the default one: the delayed run must still equal the in-step
    one bit for bit (docs/algorithm.md, "Delayed sync")."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)).to(device)
    optimizer = ZeroOneAdam(
        model.parameters(), lr=1e-2, var_freeze_step=6, var_update_scaler=2, local_steps="fixed", local_step_interval=3, sync_delay=sync_delay
    )
    kinds = ""
    for step in range(ZERO_ONE_STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g).to(device)
        optimizer.step()
        kinds += optimizer.last_step.kind
    optimizer.synchronize()
    return kinds, torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


def check_ranks(device: torch.device, quick: bool) -> None:
    kind = device.type
    names = [
        f"1-bit allreduce on {kind} equals the CPU's ({RANKS} Gloo ranks, {ALLREDUCE_CALLS} calls)",
        f"1-bit allreduce: every rank holds the same average, on {kind} and on the CPU",
        f"ZeroOneAdam on {kind}, {RANKS} Gloo ranks: parameters bit-identical across ranks after every sync",
        f"1-bit call of BERT-Large{f' / {QUICK_SCALE}' if quick else ''} on {kind}: ops per call within the design's bound",
        f"ZeroOneAdam's delayed sync on {kind}, {RANKS} Gloo ranks: equals the in-step run bit for bit where gradients do not depend on the parameters",
    ]
    start, error = time.perf_counter(), "no result"
    with tempfile.TemporaryDirectory() as tmp:
        try:  # one pair of processes for all four checks: starting one costs seconds on a small CPU
            mp.spawn(rank_main, args=(tmp, str(device), quick), nprocs=RANKS)
        except Exception as failure:  # the checks whose part did not finish on every rank fail with its message
            lines = [line for line in str(failure).splitlines() if line.strip()] or [repr(failure)]
            error = lines[-1][:300]
        files = [Path(tmp, f"rank{r}.pt") for r in range(RANKS)]
        ranks = [torch.load(f) if f.exists() else {} for f in files]
    print(f"      ({RANKS} ranks started and run in {time.perf_counter() - start:.1f} s)", flush=True)
    finished = {part for part in ("allreduce", "zero_one", "ops", "delayed") if all(part in rank for rank in ranks)}
    if "allreduce" in finished:
        report_allreduce(names[0], names[1], device, [r["allreduce"] for r in ranks])
    else:
        report(names[0], False, error)
        report(names[1], False, error)
    if "zero_one" in finished:
        report_zero_one(names[2], [r["zero_one"] for r in ranks])
    else:
        report(names[2], False, error)
    if "ops" in finished:
        report_ops(names[3], device, ranks[0]["ops"])
    else:
        report(names[3], False, error)
    if "delayed" in finished:
        pairs = [r["delayed"] for r in ranks]
        kinds = pairs[0][0][0]
        same = all(in_step[0] == delayed[0] and torch.equal(in_step[1], delayed[1]) for in_step, delayed in pairs)
        together = all(torch.equal(pairs[0][1][1], pair[1][1]) for pair in pairs)
        report(
            names[4], same and together and {"v", "s", "l"} <= set(kinds), f"steps {kinds}; ranks {'equal' if together else 'NOT equal'} after synchronize()"
        )
    else:
        report(names[4], False, error)


def report_allreduce(equal_name: str, ranks_name: str, device: torch.device, ranks: list[dict]) -> None:
    # Criterion. Bit-equal on the CPU. On CUDA the only reduction in a call is each row's scale
    # (vector_norm over up to 4,096 elements, then / sqrt(count)): CUDA sums the squares in another
    # order than the CPU, so a scale may differ in its last bits. Everything else is elementwise
    # (signs from y >= 0, the server's addcmul per rank in rank order, a table lookup of +-scale),
    # so where the signs agree an output differs by those last bits only (or by an addcmul fused
    # on one device and rounded twice on the other): relative 1e-5 covers that. The error feedback
    # carries those bits into later calls, and a value that lands within rounding of zero may flip
    # its sign: at most 1 in 100,000 signs may differ, while a packing or wire bug flips whole
    # bytes or rows.
    max_relative, flipped, signs = 0.0, 0, 0
    equal = True
    for rank in ranks:
        for on_device, on_cpu in zip(rank["device"], rank["cpu"]):
            equal = equal and torch.equal(on_device, on_cpu)
            same_sign = on_device.sign() == on_cpu.sign()
            flipped += int((~same_sign).sum())
            signs += on_cpu.numel()
            difference = (on_device - on_cpu)[same_sign].abs() / on_cpu[same_sign].abs().clamp(min=1e-30)
            max_relative = max(max_relative, float(difference.max()) if difference.numel() else 0.0)
    if device.type == "cpu":
        report(equal_name, equal, "bit-equal" if equal else f"max relative difference {max_relative:.2e}, {flipped} signs differ", against_cpu=device)
    else:
        ok = max_relative <= 1e-5 and flipped <= signs * 1e-5
        report(equal_name, ok, f"{'bit-equal' if equal else 'not bit-equal'}, max relative difference {max_relative:.2e}, "
               f"{flipped} of {signs:,} signs differ")  # fmt: skip
    same = all(torch.equal(a, b) for key in ("device", "cpu") for rank in ranks[1:] for a, b in zip(ranks[0][key], rank[key]))
    report(ranks_name, same)


def report_zero_one(name: str, ranks: list[list]) -> None:
    steps = list(zip(*ranks))  # per step: each rank's (synced, interval, parameters)
    schedules_agree = all(len({(synced, interval) for synced, interval, _ in step}) == 1 for step in steps)
    syncs = [step for step in steps if step[0][0]]
    identical = all(torch.equal(step[0][2], other[2]) for step in syncs for other in step[1:])
    after_local = sum(step[0][1] > 1 for step in syncs)
    # each rank has its own data, so local steps must leave the ranks apart (else nothing was tested)
    apart = any(not torch.equal(step[0][2], step[1][2]) for step in steps if not step[0][0])
    ok = schedules_agree and identical and after_local >= 3 and apart
    report(name, ok, f"{len(syncs)} syncs of {len(steps)} steps, {after_local} after local steps; "
           f"ranks {'apart' if apart else 'NOT apart'} during local steps{'' if schedules_agree else '; schedules differ'}")  # fmt: skip


def report_ops(name: str, device: torch.device, ops: dict) -> None:
    # The design (zoa_train/comm/onebit.py, zoa_train/comm/kernels; docs/results/one-bit-call.md, "Ops per 1-bit
    # call"). Fused kernels: per call 2 collectives and 3 passes per parameter group, each one
    # kernel launch on a GPU. The torch path: 2 collectives, 4 ops per parameter group and about
    # 34 + n ops per block (worker 12, server 17 + one per rank, unpack 5), whatever the number of
    # tensors or scale rows; a block holds at most 1/20 of the call's buffers (BLOCK_SHARE). The
    # torch path's bound allows 25% more, so an op added per block fits and one per tensor or row
    # (398 tensors, 82,000 rows) does not; on CUDA a few of its ops may launch two kernels.
    fused, unfused = ops["auto"], ops["torch"]
    bounds = {"auto": 2 + 3 * fused["groups"], "torch": round(1.25 * (2 + 4 * unfused["groups"] + (34 + RANKS) * unfused["blocks"]))}
    ok = fused["backend"] != "torch_ops" and all(ops[k]["ops"] <= bounds[k] for k in bounds)
    detail = (f"{fused['backend']} kernels {fused['ops']} ops per call (bound {bounds['auto']}), torch path {unfused['ops']} (bound {bounds['torch']}, "
              f"{unfused['blocks']} blocks); {fused['tensors']} tensors, {fused['elements']:,} elements")  # fmt: skip
    if fused["ops"] > bounds["auto"]:
        detail += f"; fused call's ops: {fused['names']}"
    if device.type == "cuda":
        for kind, result in ops.items():
            # launches as the host's runtime calls where the profiler records them, else as the
            # kernels it saw on the device; none at all means the profiler saw nothing, not a free call
            launches = result["launches"] or result["kernels"]
            ok = ok and 0 < launches <= (3 * result["groups"] if kind == "auto" else 2 * bounds["torch"])
            detail += f"; {result['backend']}: {launches} launches ({result['kernels']} kernels seen), host {result['host_s'] * 1e3:.1f} ms, device {result['device_s'] * 1e3:.1f} ms"
    else:
        detail += f"; host {fused['host_s'] * 1e3:.1f} ms per call fused vs {unfused['host_s'] * 1e3:.1f} ms on the torch path (the CPU is the device)"
    report(name, ok, detail)


NODES, RANKS_PER_NODE = 2, 2  # the node-aware checks' emulated cluster


def node_aware_rank(rank: int, tmp: str, device_name: str, backend: str, world: int, ranks_per_node: int) -> None:
    """One rank of the node-aware checks: the sync against the CPU's (Gloo) or alone (NCCL), then
    ZeroOneAdam through it (Gloo)."""
    device = torch.device(device_name if backend == "gloo" else f"cuda:{rank}")
    if device.index is not None:  # NCCL: a GPU per rank (Gloo ranks share the current one)
        torch.cuda.set_device(device)
    torch.set_num_threads(threads_per_rank(world))
    init_process_group(backend, timeout_s=120, init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    sync = ClusterCollective("hierarchical", ranks_per_node)
    results = {"allreduce": allreduce_on_rank(rank, device, sync, on_cpu=backend == "gloo")}
    torch.save(results, f"{tmp}/rank{rank}.pt")
    if backend == "gloo":
        results["zero_one"] = zero_one_on_rank(rank, device, sync)
        torch.save(results, f"{tmp}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def spawn_ranks(target, world: int, *args) -> tuple[list[dict], str]:
    """Run `target(rank, tmp, *args)` on `world` processes; each rank's saved results and the error, if any."""
    error = ""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.spawn(target, args=(tmp, *args), nprocs=world)
        except Exception as failure:
            lines = [line for line in str(failure).splitlines() if line.strip()] or [repr(failure)]
            error = lines[-1][:300]
        files = [Path(tmp, f"rank{r}.pt") for r in range(world)]
        return [torch.load(f) if f.exists() else {} for f in files], error or "no result"


def check_node_aware(device: torch.device) -> None:
    kind, world = device.type, NODES * RANKS_PER_NODE
    shape = f"{NODES} nodes x {RANKS_PER_NODE} Gloo ranks"
    names = [
        f"node-aware 1-bit sync on {kind} equals the CPU's ({shape}, {ALLREDUCE_CALLS} calls)",
        f"node-aware 1-bit sync: every rank holds the same average, on {kind} and on the CPU",
        f"ZeroOneAdam on {kind} through the node-aware sync, {shape}: parameters bit-identical across ranks after every sync",
    ]
    start = time.perf_counter()
    ranks, error = spawn_ranks(node_aware_rank, world, str(device), "gloo", world, RANKS_PER_NODE)
    print(f"      ({world} ranks started and run in {time.perf_counter() - start:.1f} s)", flush=True)
    if all("allreduce" in r for r in ranks):
        report_allreduce(names[0], names[1], device, [r["allreduce"] for r in ranks])
    else:
        report(names[0], False, error)
        report(names[1], False, error)
    if all("zero_one" in r for r in ranks):
        report_zero_one(names[2], [r["zero_one"] for r in ranks])
    else:
        report(names[2], False, error)

    gpus = torch.cuda.device_count() if kind == "cuda" else 0
    nccl = "node-aware 1-bit sync over NCCL, a rank per GPU: every rank holds the same average"
    if gpus < 2:
        print(f"SKIP  {nccl}  needs 2 GPUs, this machine has {gpus}", flush=True)
        return
    per_node = gpus // 2 if gpus >= 4 else gpus
    ranks, error = spawn_ranks(node_aware_rank, gpus, "cuda", "nccl", gpus, per_node)
    if not all("allreduce" in r for r in ranks):
        report(nccl, False, error)
        return
    outputs = [r["allreduce"]["device"] for r in ranks]
    same = all(torch.equal(a, b) for other in outputs[1:] for a, b in zip(outputs[0], other))
    report(nccl, same, f"{gpus // per_node} node(s) x {per_node} GPUs")


def overlap_rank(rank: int, tmp: str, device_name: str) -> None:
    """One rank of the overlap check: ZeroOneAdam with buckets of 256 elements, rounds in step() and
    started during backward."""
    device = torch.device(device_name)
    torch.set_num_threads(threads_per_rank(RANKS))
    init_process_group("gloo", timeout_s=120, init_method=f"file://{tmp}/store", rank=rank, world_size=RANKS)
    results = {}
    for overlap in (False, True):
        buckets = functools.partial(BucketedCollective, inner=OneBitAllReduce, bucket_cap_mb=256 * 4 / 2**20, overlap=overlap)
        results[overlap] = zero_one_on_rank(rank, device, buckets)
        torch.save(results, f"{tmp}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def check_overlap(device: torch.device) -> None:
    name = f"ZeroOneAdam on {device.type}, {RANKS} Gloo ranks: rounds started during backward equal the same buckets in step(), bit for bit"
    ranks, error = spawn_ranks(overlap_rank, RANKS, str(device))
    if not all(True in r for r in ranks):
        report(name, False, error)
        return
    same = all(torch.equal(a[2], b[2]) and a[:2] == b[:2] for r in ranks for a, b in zip(r[False], r[True]))
    report(name, same, f"{ZERO_ONE_STEPS} steps" if same else "the overlapped parameters differ")


# --- sharded inside the node: FSDP2 in the node, one bit between nodes ------------------------

SHARD_STEPS, SHARD_WIDTH = 16, 128  # a WIDTH x WIDTH weight shards over 2 ranks into whole 4,096-element scale rows


class LayerStack(torch.nn.Module):
    """Layers in an nn.ModuleList, so that FSDP2 shards each as a unit of its own (zoa_train.comm.sharding.units)."""

    def __init__(self, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def sharded_rank(rank: int, tmp: str, device_name: str, backend: str) -> None:
    """One rank of 2 nodes x 2: ZeroOneAdam on a model sharded with FSDP2 inside the node, and on local
    rank 0 of each node the same model unsharded over the 2 nodes, fed both of its node's micro-batches."""
    from zoa_train.comm.sharding import gradient_order, shard_model
    from zoa_train.comm.topology import node_groups

    device = torch.device(device_name if backend == "gloo" else f"cuda:{rank}")
    if device.index is not None:
        torch.cuda.set_device(device)
    world = NODES * RANKS_PER_NODE
    torch.set_num_threads(threads_per_rank(world))
    init_process_group(backend, timeout_s=120, init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    groups = node_groups([list(range(n * RANKS_PER_NODE, (n + 1) * RANKS_PER_NODE)) for n in range(NODES)], device.type)
    firsts = dist.new_group([n * RANKS_PER_NODE for n in range(NODES)])

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(*(torch.nn.Linear(SHARD_WIDTH, SHARD_WIDTH, bias=False) for _ in range(3))).to(device)

    def batch(r: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * t + r)
        return torch.randn(8, SHARD_WIDTH, generator=g).to(device), torch.randn(8, SHARD_WIDTH, generator=g).to(device)

    knobs = dict(lr=0.01, var_freeze_step=8, var_update_scaler=2, local_steps="fixed", local_step_interval=3, update_clip=None)
    sharded = shard_model(model(), groups.mesh["local"])
    opt = ZeroOneAdam(sharded.parameters(), process_group=groups.inter, **knobs)
    reference = model() if groups.local_rank == 0 else None
    ref_opt = ZeroOneAdam(reference.parameters(), process_group=firsts, **knobs) if reference is not None else None

    def bucketed(overlap: bool) -> tuple[torch.nn.Module, ZeroOneAdam]:
        """The layers as FSDP2 units (a ModuleList), a bucket each, rounds in step() or started as FSDP2 reduces each."""
        torch.manual_seed(0)
        net = shard_model(LayerStack(model()), groups.mesh["local"])
        param_groups = [{"params": list(net.parameters())}]
        buckets = functools.partial(
            BucketedCollective, inner=OneBitAllReduce, bucket_cap_mb=SHARD_WIDTH**2 * 4 / 2**20, overlap=overlap, order=gradient_order(net, param_groups)
        )
        return net, ZeroOneAdam(param_groups, process_group=groups.inter, collective=buckets, **knobs)

    pair = [bucketed(False), bucketed(True)]
    differences, overlapped = [], []
    for t in range(SHARD_STEPS):
        x, y = batch(rank, t)
        torch.nn.functional.mse_loss(sharded(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        for net, net_opt in pair:
            torch.nn.functional.mse_loss(net(x), y).backward()
            net_opt.step()
            net_opt.zero_grad(set_to_none=True)
        shards = [[p.to_local() for p in net.parameters()] for net, _ in pair]
        overlapped.append(max((a - b).abs().max().item() for a, b in zip(*shards)))
        full = [p.full_tensor() for p in sharded.parameters()]
        if ref_opt is not None:
            for micro in range(groups.node * RANKS_PER_NODE, (groups.node + 1) * RANKS_PER_NODE):
                x, y = batch(micro, t)
                (torch.nn.functional.mse_loss(reference(x), y) / RANKS_PER_NODE).backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            differences.append(max((a - b.detach()).abs().max().item() for a, b in zip(full, reference.parameters())))
    torch.save({"differences": differences, "overlapped": overlapped}, f"{tmp}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def check_sharded(device: torch.device) -> None:
    """Sharded 0/1 Adam (comm.shard node) on 2 nodes x 2 ranks against unsharded 0/1 Adam on 2 ranks that
    see their nodes' micro-batches: on the CPU over Gloo (bit for bit, as tests/test_sharded.py), on CUDA
    over NCCL with a GPU per rank (4 GPUs; FSDP2 needs a reduce-scatter of CUDA tensors, which Gloo lacks)."""
    world = NODES * RANKS_PER_NODE
    name = f"ZeroOneAdam sharded inside the node (FSDP2) on {device.type}, {NODES} nodes x {RANKS_PER_NODE}: equals it unsharded on the nodes' batches"
    if device.type == "cuda" and torch.cuda.device_count() < world:
        print(f"SKIP  {name}  needs {world} GPUs (a rank per GPU over NCCL), this machine has {torch.cuda.device_count()}", flush=True)
        return
    ranks, error = spawn_ranks(sharded_rank, world, str(device), "nccl" if device.type == "cuda" else "gloo")
    if not all("differences" in r for r in ranks):
        report(name, False, error)
        return
    worst = max(max(ranks[n * RANKS_PER_NODE]["differences"]) for n in range(NODES))
    # bit for bit on the CPU; cuBLAS may sum a matmul of another shape in another order
    report(name, worst == 0.0 if device.type == "cpu" else worst < 1e-5, f"{SHARD_STEPS} steps, largest difference {worst:.3g}")
    # the same arithmetic, its rounds started on the rounds' thread (a stream of its own on CUDA) as FSDP2 reduces each layer
    apart = max(max(r["overlapped"]) for r in ranks)
    name = f"ZeroOneAdam sharded on {device.type}, rounds started as FSDP2 reduces each layer: equal to the same buckets in step()"
    report(name, apart == 0.0, f"{SHARD_STEPS} steps, largest difference {apart:.3g}")


# --- the integrations, one rank under torchrun ------------------------------------------------

INTEGRATIONS = {  # example: (packages it needs, its arguments on CUDA, on the CPU)
    "hf_trainer_zero_one_adam": (("transformers", "accelerate"), ["--steps", "16", "--save-steps", "16", "--bf16"], ["--steps", "16", "--save-steps", "16"]),
    "accelerate_zero_one_adam": (("transformers", "accelerate"), ["--steps", "16", "--mixed-precision", "bf16"], ["--steps", "16"]),
    "lightning_zero_one_adam": (
        ("transformers", "lightning"),
        ["--devices", "1", "--epochs", "2", "--samples", "64", "--accelerator", "gpu", "--precision", "bf16-mixed"],
        ["--devices", "1", "--epochs", "2", "--samples", "64"],
    ),
}


def integration_run(example: str, device: torch.device, tmp: str) -> tuple[subprocess.CompletedProcess, list[float], str]:
    """One example on one rank under torchrun: (the process, its logged losses, its model's device type)."""
    import csv
    import os
    import re

    _, cuda_args, cpu_args = INTEGRATIONS[example]
    out = f"{tmp}/{example}"
    where = ["--out", out] if example.startswith("lightning") else ["--output-dir", out] if example.startswith("hf") else []
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    if device.type != "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, even on a machine with a GPU
    args = [*(cuda_args if device.type == "cuda" else cpu_args), *where]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", f"examples/{example}.py", *args]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return done, [], "?"
    if example.startswith("lightning"):  # CSVLogger's step rows; the parameters as the example saved them
        with open(f"{out}/metrics.csv") as f:
            losses = [float(row["loss"]) for row in csv.DictReader(f) if row.get("loss")]
        model_device = (re.findall(r"trained on (\w+)", done.stdout) or ["?"])[0]  # Lightning moves it to the CPU at teardown
    else:  # Trainer's step logs or the accelerate loop's lines; the device the example names at the end
        pattern = r"'loss': '([^']+)'" if example.startswith("hf") else r"^step \d+ loss (\S+)"
        losses = [float(v) for v in re.findall(pattern, done.stdout, re.M)]
        model_device = (re.findall(r"parameter digest \w+ on (\w+)", done.stdout) or ["?"])[0]
    return done, losses, model_device


def check_integrations(device: torch.device) -> None:
    """Each example in examples/ on one rank under torchrun: it completes, its logged losses fall and
    stay finite, and the model it trained sits on `device`."""
    import importlib.util
    import math

    for example, (needs, _, _) in INTEGRATIONS.items():
        name = f"examples/{example}.py on {device.type}, one rank under torchrun"
        missing = [package for package in needs if importlib.util.find_spec(package) is None]
        if missing:
            print(f"SKIP  {name}  {', '.join(missing)} not installed", flush=True)
            continue
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            done, losses, model_device = integration_run(example, device, tmp)
        if done.returncode != 0:
            report(name, False, (done.stderr.strip().splitlines() or ["no output"])[-1][:300])
            continue
        falls = len(losses) >= 2 and all(map(math.isfinite, losses)) and losses[-1] < losses[0]
        detail = f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, " if losses else "no loss logged, "
        report(name, falls and model_device == device.type, f"{detail}model on {model_device}, {time.perf_counter() - start:.1f} s")


def check_step_cost(device: torch.device) -> None:
    """`zoa-train bench optim` on the GPU: 0/1 Adam's local step against AdamW(fused) (target 1.1x).
    Run on CUDA only: on a CPU it is `bench optim`'s own figure, and a timing is no test."""
    from zoa_train.bench.optim import run_optimizer_bench

    result = run_optimizer_bench(25.0, repeats=20, device=str(device))
    times = {row["name"]: row["step_s"] for row in result["rows"]}
    detail = ", ".join(f"{name} {seconds * 1e3:.2f} ms" for name, seconds in times.items())
    report(
        f"0/1 Adam local step <= {result['target_local_vs_adamw']}x AdamW(fused) on {device.type}: {result['local_vs_adamw']:.2f}x",
        result["target_met"],
        detail,
    )


def check_scale(device: torch.device, quick: bool) -> None:
    """What training a large model needs (issue 50), on one rank: recomputed blocks train the same model
    (CUDA: within 1e-6, its kernels may reduce in another order), compiled blocks within 1e-4 of eager
    (on the CPU only without --quick: inductor's compile takes a minute there), and a few steps of a
    Llama (recipes/llama_1b.yaml on CUDA; a 4-layer llama_tiny on the CPU) with and without recomputation
    whose records hold each rank's peak memory and, on a GPU zoa-train knows, MFU; the peaks' difference
    is printed beside the one `plan` counts."""
    import json

    from zoa_train.config import load_recipe
    from zoa_train.tasks.activations import activation_memory

    backend = "nccl" if device.type == "cuda" else "gloo"
    tolerance = 1e-6 if device.type == "cuda" else 0.0
    with tempfile.TemporaryDirectory() as tmp:
        common = ["train.nproc=1", f"train.backend={backend}", "train.log_every=1", "train.val_every=0", "train.val_batches=1", "logging.wandb=disabled"]
        common += ["logging.tensorboard=false", f"data.cache_dir={tmp}/cache", "train.steps=3", "model.dropout=0.1"]

        def run(recipe: str, name: str, *sets: str) -> tuple[subprocess.CompletedProcess, Path]:
            out = Path(tmp) / name
            return zoa("run", recipe, "--out", str(out), *[a for s in (*common, *sets) for a in ("--set", s)]), out

        def final_model(out: Path) -> dict:
            return torch.load(sorted((out / "checkpoints").glob("step_*"))[-1] / "model.pt", map_location="cpu")

        def largest_difference(a: Path, b: Path) -> float:
            x, y = final_model(a), final_model(b)
            return max((x[k].float() - y[k].float()).abs().max().item() for k in x)

        runs = {mode: run("recipes/gpt2_tiny.yaml", mode, f"train.activation_checkpointing={mode}") for mode in ("none", "full")}
        ok = all(done.returncode == 0 for done, _ in runs.values())
        worst = largest_difference(runs["none"][1], runs["full"][1]) if ok else math.inf
        report(f"activation checkpointing full trains gpt2_tiny's model on {device.type} (within {tolerance:g})", ok and worst <= tolerance, f"{worst:.2e}")
        if quick and device.type == "cpu":
            print("SKIP  compiled blocks within 1e-4 of eager  --quick on the CPU (inductor compiles for a minute)", flush=True)
        else:
            eager, _ = run("recipes/gpt2_tiny.yaml", "eager", "model.dropout=0.0")
            compiled, _ = run("recipes/gpt2_tiny.yaml", "compiled", "model.dropout=0.0", "train.compile=true")
            ok = eager.returncode == 0 and compiled.returncode == 0
            worst = largest_difference(Path(tmp) / "eager", Path(tmp) / "compiled") if ok else math.inf
            report(f"compiled blocks train within 1e-4 of eager on {device.type}", ok and worst <= 1e-4, f"{worst:.2e}" if ok else compiled.stderr[-300:])
        recipe, sizes = (
            ("recipes/llama_1b.yaml", ["train.micro_batch_size=2", "train.global_batch_size=2", "data.seq_len=2048"])
            if device.type == "cuda"
            else (
                "recipes/llama_tiny.yaml",
                ["model.n_layer=4", "data.seq_len=256", "train.micro_batch_size=8", "train.global_batch_size=8", "train.precision=fp32"],
            )
        )
        peaks = {}
        for mode in ("none", "full"):
            done, out = run(recipe, f"llama_{mode}", *sizes, "optimizer.name=adam", f"train.activation_checkpointing={mode}")
            records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] if done.returncode == 0 else []
            memory = all("mem_peak_bytes" in r and len(r["mem_peak_bytes_by_rank"]) == 1 for r in records if "loss" in r)
            mfu = [r["mfu_percent"] for r in records if "mfu_percent" in r]
            known = device.type == "cuda" and "MFU is not logged" not in done.stderr
            ok = bool(records) and memory and (bool(mfu) == known)
            peaks[mode] = max((r["mem_peak_bytes"] for r in records if "mem_peak_bytes" in r), default=0)
            detail = f"peak {peaks[mode] / 1e9:.2f} GB" + (f", MFU {mfu[-1]:.1f}%" if mfu else ", no MFU (device not in the table)")
            report(
                f"{Path(recipe).stem} {mode} on {device.type}: memory in every record, MFU where the device is known",
                ok,
                detail if records else done.stderr[-300:],
            )
        counted = activation_memory(load_recipe(recipe, [*common, *sizes]))
        print(
            f"  {Path(recipe).stem}: measured peak none - full {(peaks['none'] - peaks['full']) / 1e9:.2f} GB, plan's activations none - full {(counted.none - counted.full) / 1e9:.2f} GB"
        )


SECTIONS = {  # name: check(device, quick), in the order they run
    "packing": lambda device, quick: check_packing(device),
    "kernels": lambda device, quick: check_kernels(device),
    "optimizers": lambda device, quick: check_optimizers(device),
    "runs": check_runs,
    "ranks": check_ranks,
    "node_aware": lambda device, quick: check_node_aware(device),
    "overlap": lambda device, quick: check_overlap(device),
    "sharded": lambda device, quick: check_sharded(device),
    "integrations": lambda device, quick: check_integrations(device),
    "scale": check_scale,
    "step_cost": lambda device, quick: check_step_cost(device),  # CUDA only: on a CPU it is `bench optim`'s own figure
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--quick", action="store_true", help="one optimizer in the run checks, BERT-Large / 16 in the ops check")
    parser.add_argument("--only", default="", help=f"comma-separated sections to run, of {', '.join(SECTIONS)} (default: all)")
    parser.add_argument("--skip", default="", help="comma-separated sections not to run")
    args = parser.parse_args()
    only, skip = (set(filter(None, text.split(","))) for text in (args.only, args.skip))
    if unknown := (only | skip) - set(SECTIONS):
        sys.exit(f"unknown sections {', '.join(sorted(unknown))}: expected some of {', '.join(SECTIONS)}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --device cpu to check the script itself")
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    for section, check in SECTIONS.items():
        if (not only or section in only) and section not in skip and (section != "step_cost" or device.type == "cuda"):
            check(device, args.quick)
    print(f"{len(FAILED)} failed" if FAILED else "all passed")
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
