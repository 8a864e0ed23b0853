"""Optimizer step cost and optimizer memory: torch AdamW against our three optimizers, same run.

Everything runs in this one process, on the CPU or on `device` (e.g. cuda), with world size 1
(torch.distributed is not initialised), so no step communicates: what is timed is the optimizer's
own arithmetic and memory traffic, the part that 0/1 Adam's local steps must keep close to Adam's
for the saved communication to turn into faster training.

The model is a set of parameter shapes like a small GPT (see `model_shapes`): token and position
embeddings, `layers` blocks of (layer norm, qkv, attention projection, layer norm, 4x MLP) with
biases, and a final layer norm, about `params_millions` million fp32 parameters in all. The
gradients are made once (random, fixed seed) and every optimizer steps on the same ones, so only
the optimizer step is timed. All optimizers use the same lr, betas, eps and decoupled weight decay
(0.01, so the weight-decay pass is paid by all of them).

1. Step time, the median of `repeats` timed steps after warm-up; the optimizers take turns, step
   by step, so that drift of the machine affects them alike (on CUDA each step is timed up to a
   synchronisation). Each is reported as seconds per step and as a ratio to
   torch.optim.AdamW(fused=True) of the same run, the fastest AdamW a user can run on CPU and GPU.
   The rows:
   - AdamW fused: the baseline. AdamW foreach: the multi-tensor path, for reference.
   - ZeroOneAdam local: var_freeze_step=1, local_steps="fixed", local_step_interval=10**9.
     Step 0 is the one variance step (it also freezes v into its denominator); every later step
     is a local step that communicates nothing. (With var_freeze_step=0 no variance step happens
     at all: v stays zero, its denominator is +inf and no parameter moves, so 1 is used.)
   - ZeroOneAdam sync: the same with local_step_interval=1, so every step after step 0
     syncs. At world size 1 the 1-bit exchange is a copy of the accumulator: this row is the
     optimizer-side work of a sync (momentum rebuild, return to the anchor), no compression.
   - OneBitAdam frozen: freeze_step=1 (for the same reason as above); at world size 1
     the 1-bit allreduce returns its input, so this is the Adam update with a frozen denominator.
   - DataParallelAdam: flat gradient copy, Adam update (its allreduce is a no-op here).
   Target: a ZeroOneAdam local step at most 1.1x AdamW(fused).

2. Persistent memory, counted from the tensors each optimizer holds after its steps, in bytes per
   parameter and in fp32 copies of the model (4 bytes per parameter each):
   - AdamW: every tensor in `opt.state` (exp_avg, exp_avg_sq and the step counters).
   - ours, "state": the flat buffers in `opt._buffers` and, for its OneBitAllReduce
     `opt.collective`, its worker buffer `_worker` (the accumulator / worker error) and server
     buffer `_server` (the server error of this rank's chunk).
   - ours, "comm workspace": the same OneBitAllReduce's wire buffers `_send`, `_recv`,
     `_gathered`, `_mine` and its kernels' scratch (none for the fused kernels; on the torch path
     per-block `_flags`, `_flag_bytes`, `_words`, `_index`, `_tables` and per-row server coefficients).
   Transient tensors made during a step (a denominator, a flat gradient) are not counted.
   At world size 1 the OneBitAllReduce is inactive (no padding, no server chunk, no byte
   buffers), so the buffers are also computed from the class's sizing rules for n = 2, 8 and 64
   (`onebit_allreduce_bytes`), where 0/1 Adam should hold about 4 + 1/n copies as DeepSpeed's
   does (m, v, the accumulator, worker error and server error; ours keeps the accumulator inside
   the worker error buffer and holds the anchor x instead). The sizing rules are checked against
   the measured buffers at n = 1.

3. `profile_zero_one_local_step` (separate, so as not to disturb the timings) lists the ops that
   take a ZeroOneAdam local step's time, from torch.profiler.

Timings are wall clock: on a machine shared with other jobs, run with threads=1 as well, since a
multi-threaded op waits for its slowest thread and a busy machine stretches every such op.
"""

import math
import os
import statistics
import time

import torch
from rich.table import Table

from zoa_train.comm.onebit import onebit_buffers
from zoa_train.optim import DataParallelAdam, OneBitAdam, ZeroOneAdam

LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01
WARMUP_STEPS = 3  # step 0 of ours is a variance / warm-up step; the next two warm the caches
TARGET_LOCAL_VS_ADAMW = 1.1
ANALYTIC_WORLD_SIZES = (1, 2, 8, 64)
STATE_KEYS = ("_worker", "_server")  # OneBitAllReduce buffers that carry error across calls


def model_shapes(params_millions: float) -> tuple[list[tuple[str, tuple[int, ...]]], dict]:
    """Parameter shapes of a small GPT-like model of about `params_millions` million parameters.

    Width d = 512 (halved while one block would exceed half the target), context 1024, blocks
    filling about 3/4 of the target, and the token embedding (tied with the output layer) sized
    so that the total lands on the target. Returns the (name, shape) list and a summary.
    """
    d, context, layers, vocab = _dimensions(params_millions)
    shapes = [("tok_emb", (vocab, d)), ("pos_emb", (context, d))]
    shapes += [(f"blocks.{i}.{name}", shape) for i in range(layers) for name, shape in _block(d)]
    shapes += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    summary = {"d_model": d, "layers": layers, "vocab": vocab, "context": context, "tensors": len(shapes)}
    return shapes, summary


def model_numel(params_millions: float) -> int:
    """The parameters of `model_shapes(params_millions)`, without listing its tensors (a list that
    alone would fill the memory of a machine for a size no machine can hold)."""
    d, context, layers, vocab = _dimensions(params_millions)
    return vocab * d + context * d + layers * sum(math.prod(shape) for _, shape in _block(d)) + 2 * d


def _dimensions(params_millions: float) -> tuple[int, int, int, int]:
    """(width, context, blocks, vocabulary) of model_shapes."""
    target = int(params_millions * 1e6)
    d, context = 512, 1024
    while d > 64 and 12 * d * d > target / 2:
        d //= 2
    per_block = sum(math.prod(shape) for _, shape in _block(d))
    layers = max(1, round(0.75 * target / per_block))
    vocab = max(256, (target - layers * per_block - context * d - 2 * d) // d)
    return d, context, layers, vocab


def _block(d: int) -> list[tuple[str, tuple[int, ...]]]:
    return [
        ("ln1.weight", (d,)),
        ("ln1.bias", (d,)),
        ("attn.qkv.weight", (3 * d, d)),
        ("attn.qkv.bias", (3 * d,)),
        ("attn.proj.weight", (d, d)),
        ("attn.proj.bias", (d,)),
        ("ln2.weight", (d,)),
        ("ln2.bias", (d,)),
        ("mlp.fc.weight", (4 * d, d)),
        ("mlp.fc.bias", (4 * d,)),
        ("mlp.proj.weight", (d, 4 * d)),
        ("mlp.proj.bias", (d,)),
    ]


def onebit_allreduce_bytes(numel: int, world_size: int, device: torch.device | str = "cpu") -> dict[str, int]:
    """Bytes of each buffer a OneBitAllReduce of `numel` elements allocates on `world_size` ranks
    (on `device`, default block size), from the same sizing rules the class allocates by."""
    return {name: size * dtype.itemsize for name, (size, dtype) in onebit_buffers(numel, world_size, device).items()}


MEASURED_RANKS = 2
# What the bench holds per parameter on its device at its peak: the parameters and gradients made once
# (8 bytes), a copy of the parameters per optimizer (6 x 4), their states (AdamW 8 twice, ZeroOneAdam 16
# twice, OneBitAdam 12, DataParallelAdam 12) and, while those are held, the measured ranks' (about 30
# each): about 170 bytes (167 measured at 5M and 20M parameters), rounded up.
BENCH_OPTIM_BYTES_PER_PARAM = 176


def check_optimizer_bench_memory(params_millions: float, device: torch.device) -> None:
    """Refuse, before anything is allocated, a model the bench cannot hold on `device` (a UserError),
    or the processes it starts (this one and MEASURED_RANKS ranks) that this machine cannot hold."""
    from zoa_train.bench.limits import RANK_PROCESS_BYTES, check_fits

    numel = model_numel(params_millions)
    what, need, processes = (
        f"{numel:,} parameters (--params-millions {params_millions:g})",
        BENCH_OPTIM_BYTES_PER_PARAM * numel,
        (1 + MEASURED_RANKS) * RANK_PROCESS_BYTES,
    )
    if device.type == "cuda":
        room = torch.cuda.get_device_properties(device).total_memory
        check_fits(what, need, "pass a smaller --params-millions", room, f"on {device}")
        need = 0
    check_fits(what, need + processes, "pass a smaller --params-millions")


def measure_rank(shapes: list[tuple[str, tuple[int, ...]]], device: str) -> dict | None:
    """One of MEASURED_RANKS real ranks (Gloo, tensors on `device`): ZeroOneAdam over the model's
    tensors after a variance step and a 1-bit sync, what it holds (rank 0 returns it); on CUDA also
    what the allocator gained while it was built and stepped."""
    import torch.distributed as dist

    from zoa_train.distributed import init_process_group

    init_process_group("gloo")
    try:
        where = torch.device(device)
        params = _param_maker(shapes, where)()
        cuda = where.type == "cuda"
        before = torch.cuda.memory_allocated(where) if cuda else 0
        opt = ZeroOneAdam(params, var_freeze_step=1, local_steps="fixed", local_step_interval=1, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
        for _ in range(2):
            opt.step()
        state, workspace = _held_bytes(opt)
        allocated = torch.cuda.memory_allocated(where) - before if cuda else None
        return (
            {"world_size": dist.get_world_size(), "state_bytes": state, "workspace_bytes": workspace, "allocated_bytes": allocated}
            if dist.get_rank() == 0
            else None
        )
    finally:
        dist.destroy_process_group()


def run_optimizer_bench(params_millions: float = 25.0, repeats: int = 10, threads: int | None = None, device: str = "cpu") -> dict:
    """Time one step of each optimizer and count its memory; returns a dict (see the module doc)."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    threads = threads or os.cpu_count() or 1
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _run(params_millions, repeats, threads, torch.device(device))
    finally:
        torch.set_num_threads(previous_threads)


def _run(params_millions: float, repeats: int, threads: int, device: torch.device) -> dict:
    shapes, model = model_shapes(params_millions)
    fresh_params = _param_maker(shapes, device)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    numel = sum(math.prod(shape) for _, shape in shapes)

    hyper = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    ours = dict(hyper, bias_correction=True)  # AdamW always corrects bias; keep the arithmetic alike
    makers = {
        "AdamW foreach": lambda p: torch.optim.AdamW(p, foreach=True, **hyper),
        "AdamW fused": lambda p: torch.optim.AdamW(p, fused=True, **hyper),
        "ZeroOneAdam local": lambda p: ZeroOneAdam(p, var_freeze_step=1, local_steps="fixed", local_step_interval=10**9, **ours),
        "ZeroOneAdam sync": lambda p: ZeroOneAdam(p, var_freeze_step=1, local_steps="fixed", local_step_interval=1, **ours),
        "OneBitAdam frozen": lambda p: OneBitAdam(p, freeze_step=1, **ours),
        "DataParallelAdam": lambda p: DataParallelAdam(p, **ours),
    }
    optimizers = {name: make(fresh_params()) for name, make in makers.items()}

    for _ in range(WARMUP_STEPS):
        for opt in optimizers.values():
            opt.step()
    _check_phases(optimizers)
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for _ in range(repeats):
        for name, opt in optimizers.items():
            synchronize()
            start = time.perf_counter()
            opt.step()
            synchronize()
            times[name].append(time.perf_counter() - start)
    _check_phases(optimizers)

    baseline = statistics.median(times["AdamW fused"])
    rows = []
    for name, opt in optimizers.items():
        step_s = statistics.median(times[name])
        state, workspace = _held_bytes(opt)
        rows.append(
            {
                "name": name,
                "step_s": step_s,
                "vs_adamw_fused": step_s / baseline,
                "state_bytes": state,
                "workspace_bytes": workspace,
                "state_bytes_per_param": state / numel,
                "workspace_bytes_per_param": workspace / numel,
                "state_copies": state / (4 * numel),
                "workspace_copies": workspace / (4 * numel),
            }
        )
    local = next(r for r in rows if r["name"] == "ZeroOneAdam local")["vs_adamw_fused"]

    zero_one = optimizers["ZeroOneAdam local"]
    comm = zero_one.collective
    measured = {key: t.numel() * t.element_size() for key, t in comm.held_buffers().items()}
    analytic = [_analytic_row(numel, n, device) for n in ANALYTIC_WORLD_SIZES]
    from zoa_train.distributed import launch_local

    ranks = launch_local(measure_rank, MEASURED_RANKS, shapes, str(device))[0]
    ranks |= {key.replace("bytes", "copies"): ranks[key] / (4 * numel) for key in ("state_bytes", "workspace_bytes")}
    return {
        "device": str(device),
        "threads": threads,
        "repeats": repeats,
        "world_size": 1,
        "numel": numel,
        "model": model,
        "shapes": [(name, list(shape)) for name, shape in shapes],
        "rows": rows,
        "target_local_vs_adamw": TARGET_LOCAL_VS_ADAMW,
        "local_vs_adamw": local,
        "target_met": local <= TARGET_LOCAL_VS_ADAMW,
        "analytic": analytic,
        "analytic_matches_measured_at_n1": measured == onebit_allreduce_bytes(numel, 1, device),
        "measured_ranks": ranks,
    }


def _param_maker(shapes: list[tuple[str, tuple[int, ...]]], device: torch.device | str = "cpu"):
    """A function returning fresh parameters (same values each call) whose .grad is already set."""
    g = torch.Generator().manual_seed(0)
    initial = [(torch.randn(shape, generator=g) * 0.02).to(device) for _, shape in shapes]
    grads = [(torch.randn(shape, generator=g) * 1e-3).to(device) for _, shape in shapes]

    def fresh_params() -> list[torch.nn.Parameter]:
        params = [torch.nn.Parameter(t.clone()) for t in initial]
        for p, grad in zip(params, grads):
            p.grad = grad  # shared and read-only: no optimizer here writes to .grad
        return params

    return fresh_params


def profile_zero_one_local_step(params_millions: float = 25.0, steps: int = 5, threads: int | None = None, top: int = 10) -> list[dict]:
    """torch.profiler over `steps` ZeroOneAdam local steps (set up as in the bench): the `top` ops
    by self CPU time, as {"op", "ms_per_step", "calls_per_step"}. Not part of run_optimizer_bench,
    whose timings it would disturb; it explains where a local step's time goes."""
    from zoa_train.bench.comm import cpu_profile

    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads or os.cpu_count() or 1)
    try:
        shapes, _ = model_shapes(params_millions)
        opt = ZeroOneAdam(
            _param_maker(shapes)(),
            lr=LR,
            betas=BETAS,
            eps=EPS,
            weight_decay=WEIGHT_DECAY,
            bias_correction=True,
            var_freeze_step=1,
            local_steps="fixed",
            local_step_interval=10**9,
        )
        for _ in range(WARMUP_STEPS):
            opt.step()
        with cpu_profile() as prof:
            for _ in range(steps):
                opt.step()
    finally:
        torch.set_num_threads(previous_threads)
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [{"op": e.key, "ms_per_step": e.self_cpu_time_total / 1e3 / steps, "calls_per_step": e.count / steps} for e in ops]


def _check_phases(optimizers: dict) -> None:
    """Make sure each of ours is in the phase its row claims (a wrong setting would time the wrong thing)."""
    expected = {"ZeroOneAdam local": False, "ZeroOneAdam sync": True}
    for name, synced in expected.items():
        record = optimizers[name].last_step
        if record.variance_updated or record.synced != synced:
            raise RuntimeError(f"{name}: the last step was {record}, not the phase this row measures")
    if optimizers["OneBitAdam frozen"].last_step.variance_updated:
        raise RuntimeError("OneBitAdam is still in its warm-up")


def _held_bytes(opt: torch.optim.Optimizer) -> tuple[int, int]:
    """(persistent state bytes, communication workspace bytes) of the tensors `opt` holds."""

    def size(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    if not hasattr(opt, "_buffers"):  # a torch optimizer: everything is in opt.state
        return sum(size(t) for s in opt.state.values() for t in s.values() if torch.is_tensor(t)), 0
    state = sum(size(t) for buffers in opt._buffers for t in buffers.values())
    workspace = 0
    comm = opt.collective
    if comm is not None:
        held = comm.held_buffers()
        state += sum(size(held[key]) for key in STATE_KEYS)
        workspace += sum(size(t) for key, t in held.items() if key not in STATE_KEYS)
    return state, workspace


def _analytic_row(numel: int, n: int, device: torch.device) -> dict:
    """Buffers at world size n: ZeroOneAdam has three flat buffers (m, denominator, anchor) and
    OneBitAdam two (m, denominator), each plus one OneBitAllReduce of the whole model."""
    comm = onebit_allreduce_bytes(numel, n, device)
    onebit_state = sum(comm[key] for key in STATE_KEYS)
    workspace = sum(size for key, size in comm.items() if key not in STATE_KEYS)
    state = 3 * 4 * numel + onebit_state
    return {
        "world_size": n,
        "state_bytes": state,
        "workspace_bytes": workspace,
        "state_copies": state / (4 * numel),
        "workspace_copies": workspace / (4 * numel),
        "deepspeed_copies": 4 + 1 / n,
        "onebit_adam_state_copies": (2 * 4 * numel + onebit_state) / (4 * numel),
        "buffers": comm,
    }


def format_optimizer_bench(result: dict) -> Table:
    """Two tables in one grid: the measured rows, then ZeroOneAdam's buffers at other world sizes."""
    model = result["model"]
    measured = Table(
        title=(
            f"Optimizer step on {result['device']}, {result['numel'] / 1e6:.2f}M params (GPT-like: d={model['d_model']}, "
            f"{model['layers']} blocks, vocab {model['vocab']}, {model['tensors']} tensors), "
            f"{result['threads']} threads, median of {result['repeats']}, world size 1"
        )
    )
    measured.add_column("optimizer", no_wrap=True)
    for name in ("s/step", "vs AdamW fused", "state B/param", "state copies", "comm B/param", "comm copies"):
        measured.add_column(name, justify="right")
    for r in result["rows"]:
        measured.add_row(
            r["name"],
            f"{r['step_s']:.4f}",
            f"{r['vs_adamw_fused']:.2f}x",
            f"{r['state_bytes_per_param']:.2f}",
            f"{r['state_copies']:.3f}",
            f"{r['workspace_bytes_per_param']:.3f}",
            f"{r['workspace_copies']:.4f}",
        )
    verdict = "met" if result["target_met"] else "NOT met"
    measured.caption = f"target: ZeroOneAdam local step <= {result['target_local_vs_adamw']}x AdamW(fused): {result['local_vs_adamw']:.2f}x, {verdict}"

    analytic = Table(title="ZeroOneAdam's buffers by world size n in fp32 copies of the model, from OneBitAllReduce's sizing rules")
    for name in ("n", "0/1 Adam state", "comm workspace", "0/1 Adam total", "DeepSpeed 0/1 Adam 4 + 1/n", "1-bit Adam state"):
        analytic.add_column(name, justify="right")
    for r in result["analytic"]:
        analytic.add_row(
            str(r["world_size"]),
            f"{r['state_copies']:.4f}",
            f"{r['workspace_copies']:.4f}",
            f"{r['state_copies'] + r['workspace_copies']:.4f}",
            f"{r['deepspeed_copies']:.4f}",
            f"{r['onebit_adam_state_copies']:.4f}",
        )
    m = result["measured_ranks"]
    analytic.add_row(
        f"{m['world_size']} real",
        f"{m['state_copies']:.4f}",
        f"{m['workspace_copies']:.4f}",
        f"{m['state_copies'] + m['workspace_copies']:.4f}",
        f"{4 + 1 / m['world_size']:.4f}",
        "",
    )
    check = "match" if result["analytic_matches_measured_at_n1"] else "DO NOT match"
    allocated = f"; the CUDA allocator gained {m['allocated_bytes'] / (4 * result['numel']):.4f} copies" if m["allocated_bytes"] is not None else ""
    analytic.caption = (
        f"on {result['device']}; at n = 1 the sizing rules {check} the measured buffers; the measured row: "
        f"{m['world_size']} real ranks on {result['device']}, the model's {model['tensors']} tensors{allocated}"
    )

    grid = Table.grid(padding=(1, 0))
    grid.add_row(measured)
    grid.add_row(analytic)
    return grid
