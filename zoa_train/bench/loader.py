"""`zoa-train bench loader RECIPE`: one rank's data loader against what the trainer takes from it.

One process plays rank 0 of the recipe's `train.nproc` ranks: its loader takes that rank's slice of
each global batch, from whichever source the recipe names (memory-mapped tokens of the token cache and
MLM masking for the language tasks, whether the text came bundled, from files or from the hub;
decoding and augmentation in worker processes for images). Its throughput per rank (tokens/s,
images/s) is set against the trainer's consumption per rank: the recipe's units per step per rank
(global batch / ranks x units per sample) over a step time, either measured here (forward and
backward of the step's micro-batches and one AdamW step, on a rank's share of this machine's threads)
or given (`step_time_s`, e.g. a real run's). Ratios are measured in the same run.
"""

import time

import torch

from zoa_train.config import Recipe, check_batch_layout
from zoa_train.tasks import build_task


def run_loader_bench(recipe: Recipe, batches: int = 20, step_time_s: float | None = None) -> dict:
    from zoa_train.bench.limits import check_fits
    from zoa_train.distributed import threads_per_rank
    from zoa_train.plan.units import format_bytes

    t = recipe.train
    world = t.nproc
    accumulation = check_batch_layout(recipe, world)
    task = build_task(recipe, 0, world)
    try:
        first = next(task.loader)  # start-up (worker processes, first file reads) is not throughput
        # the timed micro-batches are kept for the training steps: refused before they are read if they cannot be
        size = sum(x.numel() * x.element_size() for x in (first.values() if isinstance(first, dict) else first) if torch.is_tensor(x))
        check_fits(f"--batches {batches:,} micro-batches of {format_bytes(size)} each", batches * size, "pass fewer --batches")
        start = time.perf_counter()
        kept = [next(task.loader) for _ in range(batches)]
        loader_s = (time.perf_counter() - start) / batches
    finally:
        task.close()

    threads = threads_per_rank(world)
    if step_time_s is None:
        step_s = _measured_step_s(recipe, task, kept, accumulation, threads)
    else:
        step_s = step_time_s
    per_micro_batch = t.micro_batch_size * task.units_per_sample
    per_step = accumulation * per_micro_batch  # of one rank: its slice of the global batch
    loader_rate, trainer_rate = per_micro_batch / loader_s, per_step / step_s
    return {
        "task": task.name,
        "unit": task.unit,
        "world_size": world,
        "micro_batch_size": t.micro_batch_size,
        "accumulation": accumulation,
        "units_per_sample": task.units_per_sample,
        "units_per_step_per_rank": per_step,
        "loader_s_per_batch": loader_s,
        "loader_units_per_s_per_rank": loader_rate,
        "step_s": step_s,
        "step_time": "given" if step_time_s is not None else "measured",
        "step_threads": threads if step_time_s is None else None,
        "trainer_units_per_s_per_rank": trainer_rate,
        "loader_over_trainer": loader_rate / trainer_rate,
    }


def _measured_step_s(recipe: Recipe, task, kept: list, accumulation: int, threads: int) -> float:
    """Seconds of a training step of one rank: forward and backward of `accumulation` micro-batches and one
    AdamW step, on `threads` threads (a rank's share of this machine), over the kept micro-batches."""
    torch.manual_seed(recipe.train.seed)
    model = task.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.optimizer.lr, foreach=True)
    steps = max(1, len(kept) // accumulation)

    def train_step(step: int) -> None:
        for micro in range(accumulation):
            (task.loss(model, kept[(step * accumulation + micro) % len(kept)]) / accumulation).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model.train()
        train_step(0)  # the first step allocates the optimizer's state
        start = time.perf_counter()
        for step in range(steps):
            train_step(step)
        return (time.perf_counter() - start) / steps
    finally:
        torch.set_num_threads(previous)
