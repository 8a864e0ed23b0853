"""The interface every task implements, and the evaluation loop they share."""

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from zoa_train.precision import autocast

# data.source values that name image sets: the image task reads them, the language tasks refuse them.
IMAGE_SOURCES = ("digits", "folder")


class Task:
    """One workload: its data for one rank, its model, its loss and its validation metrics.

    Subclasses set `name`, `unit` (what throughput counts: "tokens", "images") and
    `units_per_sample` (per training sample: seq_len tokens, one image), build `self.loader` (an
    endless iterator of batches with state_dict/load_state_dict, the exact position in the data)
    in __init__, and implement the methods below that raise NotImplementedError.
    """

    name: str
    unit: str
    units_per_sample: int = 1
    metrics: tuple[str, ...]  # the keys metric_sums returns besides "count"

    def __init__(self, recipe, rank: int, world_size: int):
        self.recipe, self.rank, self.world_size = recipe, rank, world_size
        self.loader = None

    # ---- recipe ----------------------------------------------------------------------------------

    @classmethod
    def check(cls, recipe, origin: str) -> None:
        """Rules on the recipe that only this task knows (its data section); UserError of one sentence."""

    @classmethod
    def model_for_counting(cls, recipe) -> torch.nn.Module:
        """The recipe's model with the sizes it would get, built without data (under torch.device('meta'))."""
        raise NotImplementedError

    # ---- training -----------------------------------------------------------------------------

    def build_model(self) -> torch.nn.Module:
        raise NotImplementedError

    @classmethod
    def loss(cls, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        """Mean loss of a training batch (a scalar)."""
        raise NotImplementedError

    @classmethod
    def example_batch(cls, recipe, size: int) -> dict:
        """A training batch of `size` samples shaped as the recipe's (values all zero): what `plan` runs on
        fake tensors to count the activations kept for backward (zoa_train/tasks/activations.py)."""
        raise NotImplementedError

    def to_device(self, batch: dict, device: torch.device) -> dict:
        return {k: v.to(device, non_blocking=True) for k, v in batch.items()}

    def flops_per_unit(self, model: torch.nn.Module) -> float | None:
        """The model FLOPs of one unit of throughput (a token), forward and backward, for MFU; None where
        the task does not count them (docs/metrics.md, "MFU"): then no MFU is logged."""
        return None

    def save_artifacts(self, run_dir: Path) -> None:
        """Write what a checkpoint's model needs to be used (e.g. the tokenizer) into the run directory."""

    def close(self) -> None:
        """Release data workers."""

    # ---- validation ---------------------------------------------------------------------------

    def validation_batches(self, max_batches: int | None) -> Iterator[dict]:
        """This rank's validation batches, the same on every call."""
        raise NotImplementedError

    def metric_sums(self, model: torch.nn.Module, batch: dict) -> dict[str, torch.Tensor]:
        """Sums over one validation batch of each metric, plus "count", what they are averaged over."""
        raise NotImplementedError

    def evaluate(self, model: torch.nn.Module, device: torch.device, precision: str = "fp32", max_batches: int | None = None) -> dict[str, float]:
        """Every metric averaged over all ranks' validation batches (one allreduce)."""
        batches = self.validation_batches(max_batches)
        averages, _ = evaluate_batches(model, batches, self.metric_sums, self.metrics, self.to_device, device, precision)
        return averages


@torch.no_grad()
def evaluate_batches(
    model: torch.nn.Module, batches: Iterable[dict], metric_sums, metrics: tuple[str, ...], to_device, device: torch.device, precision: str = "fp32"
) -> tuple[dict[str, float], int]:
    """Sum `metric_sums(model, batch)` over this rank's batches (a rank may have none), add the sums
    of all ranks (one allreduce, in float64 so that counts stay exact); returns each metric divided
    by the total "count", and that count."""
    model.eval()
    keys = ("count", *metrics)
    totals = torch.zeros(len(keys), dtype=torch.float64, device=device)
    for batch in batches:
        with autocast(precision, device):
            sums = metric_sums(model, to_device(batch, device))
        totals += torch.stack([sums[k].detach().double() for k in keys])
    if dist.is_initialized():
        dist.all_reduce(totals)
    count, *values = totals.tolist()
    return {key: value / count for key, value in zip(metrics, values)}, int(count)
