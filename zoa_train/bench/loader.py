"""`zoa-train bench loader RECIPE`: the data loader alone vs a training step on the same micro-batches.

One process: the time to produce a micro-batch (memory-mapped tokens and masking for the language
tasks, decoding and augmentation in worker processes for images) against the time of forward +
backward + AdamW step on it, so one sees whether the loader could ever be the bottleneck. Ratios
are measured in the same run.
"""

import time

import torch

from zoa_train.config import Recipe
from zoa_train.tasks import build_task


def run_loader_bench(recipe: Recipe, batches: int = 20) -> dict:
    from zoa_train.bench.limits import check_fits
    from zoa_train.optim.plan import format_bytes

    task = build_task(recipe)
    try:
        first = next(task.loader)  # start-up (worker processes, first file reads) is not throughput
        # the timed micro-batches are kept for the training steps: refused before they are read if they cannot be
        size = sum(t.numel() * t.element_size() for t in (first.values() if isinstance(first, dict) else first) if torch.is_tensor(t))
        check_fits(f"--batches {batches:,} micro-batches of {format_bytes(size)} each", batches * size, "pass fewer --batches")
        start = time.perf_counter()
        kept = [next(task.loader) for _ in range(batches)]
        loader_s = (time.perf_counter() - start) / batches
    finally:
        task.close()

    torch.manual_seed(recipe.train.seed)
    model = task.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.optimizer.lr, foreach=True)

    def train_step(batch):
        task.loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    model.train()
    train_step(kept[0])
    start = time.perf_counter()
    for batch in kept:
        train_step(batch)
    step_s = (time.perf_counter() - start) / batches
    units = recipe.train.micro_batch_size * task.units_per_sample
    return {
        "task": task.name,
        "unit": task.unit,
        "micro_batch_size": recipe.train.micro_batch_size,
        "units_per_sample": task.units_per_sample,
        "threads": torch.get_num_threads(),
        "loader_s_per_batch": loader_s,
        "step_s_per_batch": step_s,
        "loader_units_per_s": units / loader_s,
        "step_units_per_s": units / step_s,
        "loader_share_of_step": loader_s / step_s,
    }
