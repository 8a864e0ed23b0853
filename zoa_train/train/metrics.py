"""Rank-0 logging: metrics.jsonl (always), a rich progress bar, TensorBoard and wandb (offline by default)."""

import json
import logging
import os
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from zoa_train.config import Recipe

log = logging.getLogger(__name__)


class MetricsLogger:
    def __init__(self, run_dir: Path, recipe: Recipe, total_steps: int, start_step: int, enabled: bool):
        self.enabled = enabled
        self._jsonl = self._tensorboard = self._wandb = self._progress = None
        if not enabled:
            return
        self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        if recipe.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(str(run_dir / "tensorboard"))
        if recipe.logging.wandb != "disabled":
            try:
                import wandb

                os.environ.setdefault("WANDB_SILENT", "true")
                self._wandb = wandb.init(project=recipe.logging.project, dir=str(run_dir), mode=recipe.logging.wandb, config=recipe.to_dict(), resume="allow")
            except ImportError:
                log.warning("wandb is not installed; logging to metrics.jsonl and TensorBoard only")
        self._progress = Progress(TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[status]}"), TimeRemainingColumn())
        self._task = self._progress.add_task("train", total=total_steps, completed=start_step, status="")
        self._progress.start()

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(record) + "\n")
        step = record["step"]
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                if self._tensorboard:
                    self._tensorboard.add_scalar(key, value, step)
        if self._wandb:
            self._wandb.log(record, step=step)
        if "loss" in record:
            unit, rate = next((k.removesuffix("_per_s"), v) for k, v in record.items() if k.endswith("_per_s"))
            status = (
                f"loss {record['loss']:.3f}  lr {record['lr']:.2e}  {rate:,.0f} {unit}/s  {record['bits_per_param']:.2f} bits/param  {record['rounds']} rounds"
            )
            self._progress.update(self._task, completed=step, status=status)

    def close(self) -> None:
        if not self.enabled:
            return
        self._progress.stop()
        self._jsonl.close()
        if self._tensorboard:
            self._tensorboard.close()
        if self._wandb:
            self._wandb.finish()
