"""Learning-rate schedules as plain functions of the step, so `plan` and the trainer read the same values.

constant     lr
exponential  linear warm-up to lr, then lr * factor ** ((t - warmup) // every)   (the authors' BERT: 0.99 / 520)
cosine       linear warm-up to lr, then cosine decay to `min_lr` at `total_steps` (GPT-2)
"""

import math
from dataclasses import dataclass

import torch

LR_SCHEDULES = ("constant", "exponential", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    name: str = "constant"
    lr: float = 1e-3
    warmup_steps: int = 0
    decay_factor: float = 0.99
    decay_every: int = 520
    min_lr: float = 0.0
    total_steps: int = 0

    def __post_init__(self):
        if self.name not in LR_SCHEDULES:
            raise ValueError(f"lr schedule must be one of {', '.join(LR_SCHEDULES)}, not {self.name!r}")
        if self.lr <= 0 or self.warmup_steps < 0 or self.decay_every < 1 or not 0 < self.decay_factor <= 1:
            raise ValueError("lr must be > 0, warmup_steps >= 0, decay_every >= 1 and 0 < decay_factor <= 1")

    def __call__(self, step: int) -> float:
        """Learning rate of optimizer step `step` (0-based)."""
        if self.name != "constant" and step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.name == "exponential":
            return self.lr * self.decay_factor ** ((step - self.warmup_steps) // self.decay_every)
        if self.name == "cosine":
            span = max(self.total_steps - self.warmup_steps, 1)
            progress = min(max(step - self.warmup_steps, 0) / span, 1.0)
            return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * progress))
        return self.lr

    def scheduler(self, optimizer: torch.optim.Optimizer, start: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
        """A torch scheduler that sets every group's lr to this schedule (times the group's own base lr
        ratio), from step `start` on (a resumed run's: its groups' initial_lr are this schedule's base)."""
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: self(step) / self.lr, last_epoch=start - 1)
