"""Atomic, per-rank checkpoints.

A checkpoint is a directory `step_00000100/` holding `model.pt` and `trainer.pt` (rank 0), and
`rank_00000.pt`, `rank_00001.pt`, ... (each rank's optimizer state with its error buffers, its
data position and RNG states). Everything is first written under `step_00000100.tmp/`; after all
ranks have written, rank 0 writes the `COMPLETE` marker and renames the directory, so a
checkpoint is either whole or invisible. Only complete checkpoints are ever loaded or counted.
"""

import os
import shutil
from pathlib import Path

import torch

MARKER = "COMPLETE"


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and not p.name.endswith(".tmp")]
    return sorted((p for p in found if (p / MARKER).is_file()), key=lambda p: p.name)


def staging_dir(root: Path, step: int) -> Path:
    return root / (checkpoint_name(step) + ".tmp")


def save_file(obj, path: Path) -> None:
    """torch.save through a temporary name, fsynced, so a crash never leaves a torn file."""
    tmp = path.with_suffix(path.suffix + ".part")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def publish(root: Path, step: int, keep: int, world_size: int) -> Path:
    """Rank 0, after every rank wrote: mark complete, rename into place, drop old checkpoints."""
    staged = staging_dir(root, step)
    missing = [r for r in range(world_size) if not (staged / f"rank_{r:05d}.pt").is_file()]
    if missing:
        raise RuntimeError(f"checkpoint {staged} lacks the state of ranks {missing}")
    (staged / MARKER).write_text(f"step {step}\nworld_size {world_size}\n")
    final = root / checkpoint_name(step)
    if final.exists():
        shutil.rmtree(final)
    os.replace(staged, final)
    for old in complete_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def read_world_size(checkpoint: Path) -> int:
    for line in (checkpoint / MARKER).read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "world_size":
            return int(value)
    raise ValueError(f"{checkpoint / MARKER} does not record a world size")
