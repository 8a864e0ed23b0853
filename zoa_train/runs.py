"""Reading finished (or running) run directories: what `report` plots and `bench netsim` compares.

A run directory holds `recipe.yaml` (the resolved recipe) and `metrics.jsonl` (one JSON record per
log step, written by rank 0: step, loss, lr, throughput, bits_per_param, rounds, bytes_sent,
wall_time, train_s, step_kinds, memory peaks (mem_peak_bytes and each rank's, mem_peak_bytes_by_rank),
mfu_percent where known, and val_loss on validation steps).

`step_kinds` holds one character per optimizer step since the previous record, from zoa_train.step_kinds
(runs written before it existed lack it). `train_s` is the seconds those steps took, validation and
checkpoints excluded, so step times by kind can be recovered (`step_seconds_by_kind`).
"""

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import yaml

from zoa_train.errors import UserError
from zoa_train.files import load_yaml


@dataclass
class RunLog:
    """One run directory's recipe and metric records, in step order."""

    path: Path
    recipe: dict
    records: list[dict]

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def optimizer(self) -> str:
        return self.recipe.get("optimizer", {}).get("name", "?")

    def series(self, key: str) -> list[dict]:
        """The records that carry `key` (e.g. val_loss only on validation steps)."""
        return [r for r in self.records if key in r]

    def final(self, key: str):
        """The last value of `key`, or None if no record has it."""
        found = self.series(key)
        return found[-1][key] if found else None


def read_run(path: str | Path) -> RunLog:
    """Load a run directory; a missing one, or files that are not what zoa-train run writes, is a
    UserError naming the file and line."""
    path = Path(path)
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise UserError(f"{path} is not a run directory (no metrics.jsonl).")
    records = []
    try:
        lines = metrics.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise UserError(f"{metrics} is not a text file of JSON records.") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"{metrics} line {number} is not valid JSON.") from None
        problem = _record_problem(record)
        if problem:
            raise UserError(f"{metrics} line {number} {problem}; each line must be a record that zoa-train run logs.")
        records.append(record)
    records.sort(key=lambda r: r["step"])
    return RunLog(path, _read_recipe(path / "recipe.yaml"), records)


def _record_problem(record) -> str | None:
    """What makes `record` unlike a metrics record (an object with a step, an integer 0 or more, every
    other value a number but step_kinds, a string, and the per-rank keys (`..._by_rank`) and the member ids of a
    live run's membership change (`..._members`), lists of numbers), or None."""
    if not isinstance(record, dict):
        return f"is a JSON {type(record).__name__}, not an object"
    for key, value in record.items():
        if key.endswith(("_by_rank", "_members")):
            if not isinstance(value, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
                return f"has {key} {json.dumps(value)}, which is not a list of numbers"
            continue
        wanted = str if key == "step_kinds" else int if key == "step" else (int, float)
        if not isinstance(value, wanted) or isinstance(value, bool):
            return f"has {key} {json.dumps(value)}, which is not {'a string' if wanted is str else 'an integer' if wanted is int else 'a number'}"
    if record.get("step", -1) < 0:
        return "has no step (an integer, 0 or more)"
    return None


def _read_recipe(path: Path) -> dict:
    """The resolved recipe beside the metrics ({} if there is none); its optimizer names the run's optimizer."""
    if not path.is_file():
        return {}
    try:
        recipe = load_yaml(path.read_text(encoding="utf-8"), str(path)) or {}
    except (UnicodeDecodeError, yaml.YAMLError):
        raise UserError(f"{path} is not a YAML recipe.") from None
    if not isinstance(recipe, dict) or not isinstance(recipe.get("optimizer", {}), dict):
        raise UserError(f"{path} is not a recipe (a mapping of sections, optimizer among them).")
    return recipe


def first_reaching(run: RunLog, target: float, key: str = "val_loss") -> dict | None:
    """The first record whose `key` is at or below `target`, or None if the run never got there.

    Its `wall_time`, `step` and `bytes_sent` give time, steps and traffic to that quality.
    """
    return next((r for r in run.series(key) if r[key] <= target), None)


def _timed_windows(records: list[dict]) -> list[dict]:
    """The records with the seconds and kinds of their window's steps, the first window (start-up:
    allocation, the first collectives) left out when there are others."""
    windows = [r for r in records if "train_s" in r and r.get("step_kinds")]
    return windows[1:] if len(windows) > 1 else windows


def mean_step_seconds(records: list[dict]) -> float | None:
    """Training seconds per step over the timed windows (validation and checkpoints excluded)."""
    windows = _timed_windows(records)
    steps = sum(len(r["step_kinds"]) for r in windows)
    return sum(r["train_s"] for r in windows) / steps if steps else None


def step_seconds_by_kind(records: list[dict], key: str = "train_s") -> dict[str, float]:
    """Seconds of one step of each kind (zoa_train.step_kinds), fitted by least squares to the windows:
    a window's seconds (`key`: train_s, or comm_s and comm_exposed_s, the time of its bucketed rounds
    and what step() waited of it) are the sum over its steps of their kind's seconds. Kinds that never occur are
    absent; with fewer windows than kinds the fit is underdetermined and torch's minimum-norm answer
    is returned, so read it as a diagnostic."""
    import torch

    windows = [r for r in _timed_windows(records) if key in r]
    kinds = sorted({kind for r in windows for kind in r["step_kinds"]})
    if not kinds:
        return {}
    counts = [Counter(r["step_kinds"]) for r in windows]
    a = torch.tensor([[c[k] for k in kinds] for c in counts], dtype=torch.float64)
    b = torch.tensor([[r[key]] for r in windows], dtype=torch.float64)
    solution = torch.linalg.lstsq(a, b, driver="gelsd").solution.flatten().tolist()
    return dict(zip(kinds, solution))


def run_summary(path: str | Path) -> dict:
    """A finished run as a user reads it at its end (and `zoa-train run --json` prints it): steps, wall
    time, the final and best validation metrics, what was sent (bits per parameter, rounds, bytes per rank
    between nodes and inside them), the peak memory, and where the checkpoints and logs are."""
    from zoa_train.train.rundir import complete_checkpoints

    run = read_run(path)
    last = run.records[-1] if run.records else {}
    validation = run.series("val_loss")
    best = min(validation, key=lambda r: r["val_loss"]) if validation else None
    checkpoints = complete_checkpoints(run.path / "checkpoints")
    return {
        "run_dir": str(run.path),
        "steps": last.get("step", 0),
        "wall_time_s": last.get("wall_time"),
        "val_loss": validation[-1]["val_loss"] if validation else None,
        "best_val_loss": best["val_loss"] if best else None,
        "best_val_step": best["step"] if best else None,
        **{key: run.final(key) for key in ("val_top1", "bits_per_param", "rounds", "bytes_sent", "intra_bytes_sent", "mem_peak_bytes", "mfu_percent")},
        "checkpoint": str(checkpoints[-1]) if checkpoints else None,
        "logs": [str(run.path / name) for name in ("metrics.jsonl", "tensorboard", "wandb") if (run.path / name).exists()],
    }
