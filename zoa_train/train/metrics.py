"""Rank-0 logging: metrics.jsonl (always), progress (a rich bar on a terminal; where output is piped,
as in Slurm logs, CI or `| tee`, one plain line per log step), TensorBoard and wandb (offline by default)."""

import json
import logging
import os
import sys
import time
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from zoa_train.comm import CommLedger
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
        self.total_steps, self.start_step, self.started = total_steps, start_step, time.monotonic()
        if sys.stdout.isatty():
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
                + _utilization(record)
            )
            if self._progress is not None:
                self._progress.update(self._task, completed=step, status=status)
            else:
                self._plain_line(step, status, record)

    def _plain_line(self, step: int, status: str, record: dict) -> None:
        """One line of progress, whole (no terminal to fit), flushed at once: a log shows it as it happens."""
        elapsed = time.monotonic() - self.started
        done = step - self.start_step
        eta = elapsed / done * (self.total_steps - step) if done > 0 else None
        validation = "".join(f"  {k} {v:.4f}" for k, v in record.items() if k.startswith("val_") and isinstance(v, float))
        line = f"step {step}/{self.total_steps}  {status}{validation}  elapsed {clock(elapsed)}  ETA {clock(eta) if eta is not None else '-'}"
        print(line, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.stop()
        self._jsonl.close()
        if self._tensorboard:
            self._tensorboard.close()
        if self._wandb:
            self._wandb.finish()


class LogWindow:
    """The steps since the last log line and their time: a log step's training record. Time spent
    in validation and checkpoints is not training throughput: the trainer leaves it out (`exclude`)."""

    def __init__(self, every: int, units_per_step: int, unit: str):
        self.every, self.units_per_step, self.throughput_key = every, units_per_step, f"{unit}_per_s"
        self._timed = (0.0, 0.0)  # the ledger's round and exposed seconds at the last record
        self._restart()

    def _restart(self) -> None:
        self.start, self.steps, self.kinds = time.perf_counter(), 0, ""

    def should_log(self, step: int, last: bool) -> bool:
        return step % self.every == 0 or last

    def add(self, kind: str) -> None:
        """One step taken, of this kind (zoa_train.step_kinds)."""
        self.steps += 1
        self.kinds += kind

    def exclude(self, seconds: float) -> None:
        self.start += seconds

    def record(self, loss: float, lr: float, ledger: CommLedger, variance_updates: int) -> dict:
        """The window's record (`loss` averaged over the ranks, which waited for the device), and a new window."""
        elapsed = time.perf_counter() - self.start
        record = {
            "loss": loss,
            "lr": lr,
            self.throughput_key: self.units_per_step * self.steps / max(elapsed, 1e-9),
            "bits_per_param": ledger.average_bits_per_param,
            "rounds": ledger.rounds,
            "bytes_sent": ledger.bytes_sent,
            "intra_bits_per_param": ledger.average_intra_bits_per_param,
            "intra_bytes_sent": ledger.intra_bytes_sent,
            "variance_updates": variance_updates,
            "step_kinds": self.kinds,
            "train_s": elapsed,  # the window's steps alone: step times by kind (zoa_train.runs)
        }
        if ledger.round_seconds:  # bucketed rounds (comm.bucket_cap_mb): their seconds, and what step() waited of them
            record["comm_s"] = ledger.round_seconds - self._timed[0]
            record["comm_exposed_s"] = ledger.exposed_seconds - self._timed[1]
            self._timed = (ledger.round_seconds, ledger.exposed_seconds)
        self._restart()
        return record


def _utilization(record: dict) -> str:
    """The console's memory (the maximum over ranks: the window's peak, or the lifetime peak where the window's
    cannot be measured) and MFU, where the record has them (zoa_train/train/monitor.py)."""
    text = ""
    if "mem_peak_bytes" in record:
        text += f"  mem {record['mem_peak_bytes'] / 1e9:.2f} GB"
    elif "mem_lifetime_peak_bytes" in record:
        text += f"  mem {record['mem_lifetime_peak_bytes'] / 1e9:.2f} GB (lifetime peak)"
    if "mfu_percent" in record:
        text += f"  MFU {record['mfu_percent']:.3g}%"
    return text


def clock(seconds: float) -> str:
    """h:mm:ss, or m:ss under an hour."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
