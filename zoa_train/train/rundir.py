"""The run directory: one object owns its layout, its preparation in every launch mode, and its checkpoints.

Layout (rank 0 writes everything except each rank's own checkpoint file):
  recipe.yaml            the resolved recipe
  metrics.jsonl          one JSON record per log step (zoa_train/runs.py reads it)
  tensorboard/, wandb/   when enabled
  tokenizer/ or classes.json   what the task needs beside the model (the task writes it)
  checkpoints/step_00000100/   model.pt, optimizer.pt and trainer.pt (rank 0: what is the same on every
                               rank, saved once), rank_00000.pt, rank_00001.pt, ... (what is each
                               rank's own: 1-bit error buffers, data position, RNG states, and inside
                               a 0/1 Adam local-step period its parameters and momentum), COMPLETE

A checkpoint is first written under `step_00000100.tmp/`; after every rank has written, rank 0
writes the COMPLETE marker and renames the directory, so a checkpoint is either whole or
invisible, and every file goes through a temporary name and fsync. Only complete checkpoints are
ever loaded or counted.

Preparation runs on every rank whatever started it (`zoa-train run`, torchrun, srun): rank 0
decides (refuses a non-empty directory without --overwrite or --resume, empties it with
--overwrite, trims metrics.jsonl back to the resumed step) and every rank gets the same decision,
so all ranks fail alike or none does.
"""

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from zoa_train.errors import UserError

MARKER = "COMPLETE"
METRICS = "metrics.jsonl"


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def save_file(obj, path: Path) -> None:
    """torch.save through a temporary name, fsynced, so a crash never leaves a torn file."""
    tmp = path.with_suffix(path.suffix + ".part")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and not p.name.endswith(".tmp")]
    return sorted((p for p in found if (p / MARKER).is_file()), key=lambda p: p.name)


def read_marker(checkpoint: Path) -> dict[str, int]:
    """The step and world size a COMPLETE marker records."""
    fields = {}
    for line in (checkpoint / MARKER).read_text().splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            fields[key] = int(value)
    if "world_size" not in fields:
        raise UserError(f"{checkpoint / MARKER} does not record a world size; the checkpoint is damaged.")
    return fields


def check_resumable(checkpoint: Path, world_size: int) -> None:
    """Refuse a missing, incomplete or other-world-size checkpoint with one sentence."""
    if not (checkpoint / MARKER).is_file():
        raise UserError(f"{checkpoint} is not a complete checkpoint (no {MARKER} marker).")
    saved = read_marker(checkpoint)["world_size"]
    if saved != world_size:
        raise UserError(
            f"checkpoint {checkpoint} was written by {saved} ranks and this run has {world_size}; "
            "the optimizer's error buffers are per rank, so resume with the same number of processes."
        )


class RunDirectory:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.checkpoints = self.path / "checkpoints"

    # ---- preparation ---------------------------------------------------------------------------

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        found = complete_checkpoints(self.checkpoints)
        return found[-1] if found else None

    def check(self, resume: str | None, overwrite: bool, world_size: int) -> Path | None:
        """Read-only: the checkpoint to resume from (None: start at step 0), or a UserError for a
        directory or checkpoint this run must not use."""
        if resume and overwrite:
            raise UserError("--resume and --overwrite cannot be used together.")
        if self.path.exists() and not self.path.is_dir():
            raise UserError(f"run directory {self.path} exists and is not a directory.")
        if resume:
            if resume != "auto" and not Path(resume).is_dir():
                raise UserError(f"--resume {resume}: no such checkpoint directory.")
            target = self.latest() if resume == "auto" else Path(resume)
            if target is not None:
                check_resumable(target, world_size)
            return target
        if not overwrite and self.path.is_dir() and any(self.path.iterdir()):
            raise UserError(f"run directory {self.path} is not empty: pass --resume auto to continue it or --overwrite to start again.")
        return None

    def prepare(self, resume: str | None, overwrite: bool, world_size: int, rank: int) -> Path | None:
        """On every rank (a collective when torch.distributed is initialised): rank 0 checks and sets
        the directory up (emptied with `overwrite`, metrics.jsonl trimmed to the resumed step);
        returns the checkpoint to resume from. Raises the same UserError on every rank."""
        decision: list = [None, None]  # [checkpoint path or None, error message or None]
        if rank == 0:
            try:
                target = self.check(resume, overwrite, world_size)
                if overwrite and self.path.exists():
                    shutil.rmtree(self.path)
                self.path.mkdir(parents=True, exist_ok=True)
                if resume:
                    self.trim_metrics(read_marker(target)["step"] if target is not None else 0)
                decision = [str(target) if target is not None else None, None]
            except UserError as e:
                decision = [None, str(e)]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(decision, src=0)
        if decision[1] is not None:
            raise UserError(decision[1])
        return Path(decision[0]) if decision[0] is not None else None

    def trim_metrics(self, step: int) -> None:
        """Drop the records logged after `step`: a run that died after its last checkpoint logged
        steps that the resumed run will log again."""
        metrics = self.path / METRICS
        if not metrics.is_file():
            return
        kept = [line for line in metrics.read_text().splitlines() if line.strip() and _record_step(line) <= step]
        tmp = metrics.with_suffix(".jsonl.part")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, metrics)

    # ---- checkpoints ---------------------------------------------------------------------------

    def save(self, step: int, rank: int, world_size: int, rank_state: dict, shared_files: dict[str, object], keep: int) -> Path:
        """Collective: every rank writes `rank_state` as rank_XXXXX.pt; rank 0 also writes each of
        `shared_files` (name -> object, e.g. model.pt), then publishes the checkpoint and drops all
        but the newest `keep`."""
        staged = self.checkpoints / (checkpoint_name(step) + ".tmp")
        if rank == 0:
            shutil.rmtree(staged, ignore_errors=True)
            staged.mkdir(parents=True)
        _barrier()
        save_file(rank_state, staged / f"rank_{rank:05d}.pt")
        if rank == 0:
            for name, obj in shared_files.items():
                save_file(obj, staged / name)
        _barrier()
        final = self.checkpoints / checkpoint_name(step)
        if rank == 0:
            missing = [r for r in range(world_size) if not (staged / f"rank_{r:05d}.pt").is_file()]
            if missing:
                raise RuntimeError(f"checkpoint {staged} lacks the state of ranks {missing}")
            (staged / MARKER).write_text(f"step {step}\nworld_size {world_size}\n")
            if final.exists():
                shutil.rmtree(final)
            os.replace(staged, final)
            for old in complete_checkpoints(self.checkpoints)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
        _barrier()
        return final

    @staticmethod
    def load(checkpoint: Path, name: str, device: torch.device | str = "cpu"):
        """One file of a checkpoint (e.g. model.pt, trainer.pt, rank_00001.pt), tensors on `device`."""
        return torch.load(checkpoint / name, map_location=device, weights_only=False)


def _record_step(line: str) -> float:
    try:
        return int(json.loads(line)["step"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        return float("inf")  # a torn line (a crash while writing) is dropped too


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def resolve_model_file(path: str | Path) -> tuple[Path, "RunDirectory | None"]:
    """What `--checkpoint` may name, as (model file, the run directory it belongs to or None): a run
    directory (its latest complete checkpoint's model.pt), a checkpoint directory, or a model file."""
    path = Path(path)
    if path.is_file():
        model = path
    elif (path / MARKER).is_file():
        model = path / "model.pt"
    elif path.is_dir() and (path / "checkpoints").exists():
        latest = RunDirectory(path).latest()
        if latest is None:
            raise UserError(f"run directory {path} has no complete checkpoint.")
        model = latest / "model.pt"
    elif path.is_dir():
        raise UserError(f"{path} is neither a run directory, a complete checkpoint nor a model file.")
    else:
        raise UserError(f"--checkpoint {path}: no such file or directory.")
    if not model.is_file():
        raise UserError(f"checkpoint {model.parent} has no model.pt.")
    # model.pt lies in <run>/checkpoints/step_N/: the run directory holds the recipe and classes.
    for candidate in (model.parent, *model.parents[:3]):
        if (candidate / "recipe.yaml").is_file():
            return model, RunDirectory(candidate)
    return model, None
