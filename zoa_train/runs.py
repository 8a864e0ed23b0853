"""Reading finished (or running) run directories: what `report` plots and `bench netsim` compares.

A run directory holds `recipe.yaml` (the resolved recipe) and `metrics.jsonl` (one JSON record per
log step, written by rank 0: step, loss, lr, throughput, bits_per_param, rounds, bytes_sent,
wall_time, step_kinds, and val_loss on validation steps).

`step_kinds` holds one character per optimizer step since the previous record, from zoa_train.step_kinds
(runs written before it existed lack it).
"""

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from zoa_train.errors import UserError


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
    """Load a run directory; a missing or unreadable one is a UserError naming the path."""
    path = Path(path)
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise UserError(f"{path} is not a run directory (no metrics.jsonl).")
    records = []
    for number, line in enumerate(metrics.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            raise UserError(f"{metrics} line {number} is not valid JSON.") from None
    recipe_file = path / "recipe.yaml"
    recipe = yaml.safe_load(recipe_file.read_text()) if recipe_file.is_file() else {}
    records.sort(key=lambda r: r.get("step", 0))
    return RunLog(path, recipe or {}, records)


def first_reaching(run: RunLog, target: float, key: str = "val_loss") -> dict | None:
    """The first record whose `key` is at or below `target`, or None if the run never got there.

    Its `wall_time`, `step` and `bytes_sent` give time, steps and traffic to that quality.
    """
    return next((r for r in run.series(key) if r[key] <= target), None)
