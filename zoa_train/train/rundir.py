"""The run directory: one object owns its layout, its preparation in every launch mode, and its checkpoints.
(Over 600 lines, a tenth of them this description: the layout, the atomic writes and the integrity
checks are one contract, kept in one place so that a reader checks it whole.)

Layout (rank 0 writes everything except each rank's own checkpoint files):
  recipe.yaml            the resolved recipe (what the run trains with now)
  recipe_changes.yaml    the keys changed on resumes, each with the step it took effect at (train/resume_rules.py)
  model_config/          the model's Hugging Face config, for a model from model.init_from or model.hf_config
  metrics.jsonl          one JSON record per log step (zoa_train/runs.py reads it)
  tensorboard/, wandb/   when enabled
  tokenizer/ or classes.json   what the task needs beside the model (the task writes it)
  checkpoints/step_00000100/   trainer.pt and optimizer.pt (rank 0: what is the same on every rank, saved
                               once), model.pt (rank 0: the whole model; unsharded runs), model/ (a
                               sharded run's model: every rank writes its shards, torch.distributed.checkpoint),
                               optimizer/ (a sharded run's optimizer state per parameter, at a sync, the same
                               way), rank_00000.pt, rank_00001.pt, ... (what is each rank's own: 1-bit
                               error buffers, data position, RNG states, and inside a 0/1 Adam local-step
                               period an unsharded run's parameters and momentum), COMPLETE

A checkpoint is first written under `step_00000100.tmp/`; after every rank has written, rank 0
writes the COMPLETE marker and renames the directory, so a checkpoint is either whole or
invisible, and every file goes through a temporary name and fsync. Only complete checkpoints are
ever loaded or counted. The trainer saves in the background (save_in_background): the state is
copied to host memory at the step that saves, and a thread of each rank writes it, agrees with the
others over a Gloo group of its own and, on rank 0, publishes it while training goes on; one write
at a time (a save waits for the previous one), and the run's end, a stop and a read of `latest`
wait for it (train/checkpointer.py).

Inside a local-step period (COMPLETE says `synced 0`) the ranks' models differ: an unsharded run's
rank files hold each rank's own, and a sharded run's model/ holds each node's under `node_N`
(`model` when they are one model).

Preparation runs on every rank whatever started it (`zoa-train run`, torchrun, srun): rank 0
decides (refuses a non-empty directory without --overwrite or --resume, empties it with
--overwrite) and every rank gets the same decision, so all ranks fail alike or none does. A resumed
run trims metrics.jsonl back to its step only after every rank has loaded the checkpoint: every
check that can refuse a resume comes before anything in the directory changes.

Integrity: every file of a checkpoint is hashed (SHA-256) by the rank that wrote it, right after
writing; rank 0 gathers the ranks' sizes and digests and writes them into the COMPLETE marker as
`file NAME SIZE SHA256` lines (NAME relative to the checkpoint, e.g. model/__1_0.distcp) beside
`step` and `world_size`. Resuming checks sizes, then hashes (rank 0, a few threads): `--resume auto`
skips a damaged newest checkpoint for the previous intact one with a warning, `--resume PATH` to a
damaged one is a UserError naming the file. Markers written before checksums existed are trusted as
they are.

A failed write (disk full, ...) is agreed on by every rank and stops the run with one sentence;
the staging directory is dropped and the earlier checkpoints are untouched (older ones are pruned
only after the new one is complete).

Lock: rank 0 holds an exclusive flock on <run>/.lock (which records its pid and host) from
`prepare` until `close`, so a second job on the same directory is refused at once; the kernel drops
the lock when the process dies, so a stale file never blocks. `--overwrite` empties the directory
around the lock file, after the lock is taken.
"""

import errno
import fcntl
import hashlib
import json
import logging
import os
import pickle
import re
import shutil
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from zoa_train.errors import UserError
from zoa_train.files import check_directory, make_directory
from zoa_train.train.checkpointer import BackgroundWrite, failure_of, host_copy, write_shards

MARKER = "COMPLETE"
METRICS = "metrics.jsonl"
LOCK = ".lock"
MODEL_SHARDS = "model"  # a sharded run's model: a torch.distributed.checkpoint directory of every rank's shards
MODEL_FILES = {"model.pt", MODEL_SHARDS + "/"}  # what reading a checkpoint's model reads (a name ending in / : the files below it)
_CHUNK = 1 << 20
_CHECKPOINT_NAME = re.compile(r"step_\d+")
# Less free space than this after a failed write: the disk is full (torch.save's RuntimeError carries no errno).
_NEARLY_FULL = 1 << 20

log = logging.getLogger(__name__)


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def shards_key(node: int | None) -> str:
    """The key a sharded checkpoint's model/ holds a model under: "model" where every node holds the same
    one, "node_N" for node N's own inside a local-step period (node None)."""
    return "model" if node is None else f"node_{node}"


def file_digest(path: Path) -> str:
    """SHA-256 of a file, read in 1 MiB chunks (hashlib releases the GIL: threads hash in parallel)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def save_file(obj, path: Path) -> tuple[int, str]:
    """torch.save through a temporary name, fsynced, so a crash never leaves a torn file; returns
    the file's (size, SHA-256), hashed right after writing (the bytes are still in the page cache)."""
    tmp = path.with_suffix(path.suffix + ".part")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    recorded = (tmp.stat().st_size, file_digest(tmp))
    os.replace(tmp, path)
    return recorded


def _write_synced(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".part")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # not every file system fsyncs directories
    finally:
        os.close(fd)


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _CHECKPOINT_NAME.fullmatch(p.name)]
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


def read_manifest(checkpoint: Path) -> dict[str, tuple[int, str]]:
    """name -> (size, SHA-256) of each file a COMPLETE marker records ({} for markers older than checksums)."""
    manifest = {}
    for line in (checkpoint / MARKER).read_text().splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == "file" and parts[2].isdigit():
            manifest[parts[1]] = (int(parts[2]), parts[3])
    return manifest


def verify_checkpoint(checkpoint: Path, hashes: bool = True, names: set[str] | None = None) -> str | None:
    """None when a complete checkpoint is intact, else what is wrong, naming the file: every recorded
    file must exist with its recorded size; with `hashes`, those in `names` (all by default; a name
    ending in / stands for every file below it) must also match their SHA-256."""
    try:
        read_marker(checkpoint)
        manifest = read_manifest(checkpoint)
    except (UserError, OSError, UnicodeDecodeError):
        return f"{checkpoint / MARKER} is unreadable or records no world size"
    for name, (size, _) in manifest.items():
        path = checkpoint / name
        if not path.is_file():
            return f"{path} is missing"
        actual = path.stat().st_size
        if actual != size:
            return f"{path} has {actual} bytes where {size} were written"
    if hashes:
        todo = [name for name in manifest if names is None or name in names or any(n.endswith("/") and name.startswith(n) for n in names)]
        with ThreadPoolExecutor(max_workers=max(1, min(8, len(todo), os.cpu_count() or 1))) as pool:
            digests = list(pool.map(lambda name: file_digest(checkpoint / name), todo))
        for name, digest in zip(todo, digests):
            if digest != manifest[name][1]:
                return f"{checkpoint / name} does not match the SHA-256 checksum recorded when it was written"
    return None


def check_resumable(checkpoint: Path, world_size: int, reshard: bool = False) -> None:
    """Refuse a missing or incomplete checkpoint, or one of another world size unless `reshard`, with one sentence."""
    if not (checkpoint / MARKER).is_file():
        raise UserError(f"{checkpoint} is not a complete checkpoint (no {MARKER} marker).")
    marker = read_marker(checkpoint)
    saved = marker["world_size"]
    if saved != world_size and reshard and marker.get("synced") == 0:
        raise UserError(
            f"cannot reshard checkpoint {checkpoint}: it was taken {_unsynced_words(checkpoint)} (the ranks' parameters "
            f"differ there); resume it at its {saved} ranks, or reshard one taken at a synchronised step "
            "(the last step of a run always is)."
        )
    if saved != world_size and not reshard:
        raise UserError(
            f"checkpoint {checkpoint} was written by {saved} ranks and this run has {world_size}; "
            "the optimizer's error buffers are per rank, so resume with the same number of processes, "
            "or pass --reshard to continue at this size (error buffers reset; see docs/faults.md)."
        )


def _unsynced_words(checkpoint: Path) -> str:
    """Where in its optimizer's cycle a checkpoint of differing ranks was taken, by the recipe it records."""
    try:
        optimizer = read_checkpoint_file(checkpoint / "trainer.pt")["recipe"]["optimizer"]["name"]
    except (OSError, KeyError, TypeError, UserError, RuntimeError):  # written before checkpoints held their recipe
        optimizer = None
    return {"zero_one_adam": "inside a 0/1 Adam local-step period", "diloco": "between two of DiLoCo's outer steps"}.get(
        optimizer, "while the ranks' parameters differed (inside a 0/1 Adam local-step period or between DiLoCo's outer steps)"
    )


class RunDirectory:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.checkpoints = self.path / "checkpoints"
        self._lock = None  # the open .lock file while this object holds the run directory
        self._created = False  # whether taking the lock created the directory
        self._writing: BackgroundWrite | None = None  # the checkpoint being written in the background
        self._group = None  # the background writes' process group (Gloo), made by the first one

    # ---- the lock ------------------------------------------------------------------------------

    def _in_use(self, holder: str) -> UserError:
        pid, _, host = holder.strip().partition(" ")
        who = f" (pid {pid} on host {host})" if pid.isdigit() and host else ""
        return UserError(f"run directory {self.path} is in use by another job{who}.")

    def lock(self) -> None:
        """Take the exclusive, non-blocking lock on <run>/.lock (creating the directory), or raise
        a UserError naming the job that holds it. Held until close() or this process ends."""
        if self._lock is not None:
            return
        created = not self.path.exists()
        make_directory(self.path, "run directory")
        f = open(self.path / LOCK, "a+")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            f.seek(0)
            holder = f.read()
            f.close()
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise self._in_use(holder) from None
            raise UserError(f"cannot lock run directory {self.path}: {e.strerror or e}.") from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()} {socket.gethostname()}\n")
        f.flush()
        self._lock, self._created = f, created

    def _probe_lock(self) -> None:
        """Refuse a directory another job holds, without keeping (or creating) the lock."""
        if self._lock is not None or not (self.path / LOCK).is_file():
            return
        try:
            f = open(self.path / LOCK)
        except OSError:
            return
        with f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise self._in_use(f.read()) from None
                return

    def close(self) -> None:
        """Release the run directory's lock (idempotent; the lock file stays: removing it would let
        two jobs lock two different files). A directory this job created and left holding only the lock
        (a run refused once its ranks had started) is removed, while still locked: no trace of it. A
        checkpoint still being written is waited for first (published, or its error said in the log)."""
        self.settle_save()
        if self._lock is not None:
            if self._created and self.path.is_dir() and all(p.name == LOCK for p in self.path.iterdir()):
                shutil.rmtree(self.path, ignore_errors=True)
            try:
                fcntl.flock(self._lock.fileno(), fcntl.LOCK_UN)
            finally:
                self._lock.close()
                self._lock = None

    def settle_save(self) -> None:
        """Wait for a checkpoint still being written (published, or its error said in the log, not raised)."""
        writing, self._writing = self._writing, None
        if writing is not None:
            writing.settle()
            if writing.error is not None:
                log.warning(
                    "checkpoint %s was not published: %s",
                    writing.name,
                    str(writing.error).strip().splitlines()[0] if str(writing.error).strip() else type(writing.error).__name__,
                )

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # ---- preparation ---------------------------------------------------------------------------

    def latest(self, hashes: bool = True, names: set[str] | None = None) -> Path | None:
        """The newest complete checkpoint whose files are intact (see verify_checkpoint), or None;
        a damaged one is skipped, with a warning, for the previous one. A checkpoint being written in the
        background by this object is waited for first."""
        if self._writing is not None:
            self._writing.settle()
        for checkpoint in reversed(complete_checkpoints(self.checkpoints)):
            problem = verify_checkpoint(checkpoint, hashes, names)
            if problem is None:
                return checkpoint
            log.warning("skipping damaged checkpoint %s (%s); trying the previous complete one", checkpoint, problem)
        return None

    def _reshardable(self, newest: Path, world_size: int) -> Path:
        """`newest`, or where it was written by another number of ranks inside a local-step period (which
        cannot be resharded) the newest intact checkpoint before it taken at a synchronised step, with a
        warning; `newest` itself when there is none (check_resumable then refuses it)."""
        marker = read_marker(newest)
        if marker["world_size"] == world_size or marker.get("synced") != 0:
            return newest
        earlier = [c for c in complete_checkpoints(self.checkpoints) if c.name < newest.name]
        for checkpoint in reversed(earlier):
            if read_marker(checkpoint).get("synced") != 0 and verify_checkpoint(checkpoint) is None:
                log.warning(
                    "resharding from %d to %d ranks: the newest checkpoint, %s, was taken %s, so the run continues from "
                    "the newest one taken at a synchronised step, %s (%d steps earlier)",
                    marker["world_size"],
                    world_size,
                    newest.name,
                    _unsynced_words(newest),
                    checkpoint.name,
                    marker["step"] - read_marker(checkpoint)["step"],
                )
                return checkpoint
        return newest

    def _check_arguments(self, resume: str | None, overwrite: bool) -> None:
        if resume and overwrite:
            raise UserError("--resume and --overwrite cannot be used together.")
        if self.path.exists() and not self.path.is_dir():
            raise UserError(f"run directory {self.path} exists and is not a directory.")
        check_directory(self.path, "run directory")

    def check(self, resume: str | None, overwrite: bool, world_size: int, reshard: bool = False) -> Path | None:
        """Read-only: the checkpoint to resume from (None: start at step 0), or a UserError for a
        directory or checkpoint this run must not use (one another job holds, among them)."""
        self._check_arguments(resume, overwrite)
        self._probe_lock()
        if resume:
            if resume != "auto" and not Path(resume).is_dir():
                raise UserError(f"--resume {resume}: no such checkpoint directory.")
            if resume == "auto":
                target = self.latest()
                if target is None and complete_checkpoints(self.checkpoints):
                    raise UserError(
                        f"every complete checkpoint under {self.checkpoints} is damaged (see the warnings above): "
                        "resume from a copy of an intact one or pass --overwrite to start again."
                    )
                if target is not None and reshard:
                    target = self._reshardable(target, world_size)
            else:
                target = Path(resume)
            if target is not None:
                check_resumable(target, world_size, reshard)
                if resume != "auto":
                    problem = verify_checkpoint(target)
                    if problem is not None:
                        raise UserError(f"checkpoint {target} is damaged: {problem}.")
            return target
        if not overwrite and self.path.is_dir() and any(p.name != LOCK for p in self.path.iterdir()):
            raise UserError(f"run directory {self.path} is not empty: pass --resume auto to continue it or --overwrite to start again.")
        return None

    def _empty(self) -> None:
        """Remove everything in the run directory but the lock file this job holds."""
        for entry in self.path.iterdir():
            if entry.name == LOCK:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()

    def prepare(self, resume: str | None, overwrite: bool, world_size: int, rank: int, reshard: bool = False) -> Path | None:
        """On every rank (a collective when torch.distributed is initialised): rank 0 checks and sets
        the directory up (emptied with `overwrite`); returns the checkpoint to resume from. A resumed
        run's metrics.jsonl is trimmed by the caller (trim_metrics) only once the checkpoint has been
        loaded: a checkpoint the run refuses (another model or optimizer) leaves the directory as it was. Raises the same UserError on every rank. Rank 0 first
        takes the run directory's lock, held until close(): the caller must call close() when the run ends."""
        decision: list = [None, None]  # [checkpoint path or None, error message or None]
        if rank == 0:
            held = self._lock is not None
            try:
                self._check_arguments(resume, overwrite)
                self.lock()  # before emptying or trimming anything: two jobs never both get here
                target = self.check(resume, overwrite, world_size, reshard)
                if overwrite:
                    self._empty()
                decision = [str(target) if target is not None else None, None]
            except UserError as e:
                decision = [None, str(e)]
                if self._lock is not None and not held:
                    self.close()  # a directory it created is removed: no trace of a refused run
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(decision, src=0)
        if decision[1] is not None:
            raise UserError(decision[1])
        return Path(decision[0]) if decision[0] is not None else None

    def last_record(self) -> tuple[dict, float] | None:
        """The last record of metrics.jsonl and when the file was last written (seconds since the epoch),
        or None: where a run that died had got to."""
        metrics = self.path / METRICS
        lines = metrics.read_text().splitlines() if metrics.is_file() else []
        last = next((line for line in reversed(lines) if line.strip()), None)
        if last is None:
            return None
        try:
            record = json.loads(last)
        except json.JSONDecodeError:  # a line torn by the failure
            return None
        return (record, metrics.stat().st_mtime) if isinstance(record, dict) and isinstance(record.get("step"), int) else None

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

    def save(
        self,
        step: int,
        rank: int,
        world_size: int,
        rank_state: dict,
        shared_files: dict[str, object],
        keep: int,
        synced: bool = True,
        sharded: dict[str, dict] | None = None,
        group=None,
    ) -> Path:
        """Collective over `group` (None: the default group): every rank writes `rank_state` as
        rank_XXXXX.pt and its shards of each of `sharded` (directory name -> state dict, e.g. a sharded
        run's model/, through torch.distributed.checkpoint); rank 0 also writes each of `shared_files`
        (name -> object, e.g. model.pt), then publishes the checkpoint, its files' sizes and SHA-256 in
        the marker, and drops all but the newest `keep`. A write that fails on any rank raises the same
        UserError on every rank and leaves the earlier checkpoints as they were."""
        name = checkpoint_name(step)
        staged = self.checkpoints / (name + ".tmp")
        final = self.checkpoints / name
        error = None
        if rank == 0:
            try:
                shutil.rmtree(staged, ignore_errors=True)
                staged.mkdir(parents=True)
            except OSError as e:
                error = self._save_error(name, e)
        error = agree(error, group)
        recorded: dict[str, tuple[int, str]] = {}  # name -> (size, SHA-256) of each file this rank wrote
        if error is None:
            own = f"rank_{rank:05d}.pt"
            try:
                for directory, state in (sharded or {}).items():
                    for file in write_shards(state, staged / directory, group):
                        recorded[f"{directory}/{file.name}"] = (file.stat().st_size, file_digest(file))
                recorded[own] = save_file(rank_state, staged / own)
                if rank == 0:
                    for shared, obj in shared_files.items():
                        recorded[shared] = save_file(obj, staged / shared)
            # torch.save reports a failed write (a full disk) as a RuntimeError; DCP a failure on any rank as a
            # CheckpointException on every rank
            except (OSError, RuntimeError, CheckpointException) as e:
                error = self._save_error(name, failure_of(e))
        error, everyone = _gather(error, recorded, group)
        if error is None and rank == 0:
            try:
                self._publish(staged, final, step, world_size, everyone, synced)
            except OSError as e:
                error = self._save_error(name, e)
            except _MissingRanks as e:
                error = f"could not write checkpoint {name} under {self.checkpoints}: {e}; the earlier checkpoints are untouched."
        error = agree(error, group)
        if error is not None:
            if rank == 0:
                shutil.rmtree(staged, ignore_errors=True)
            _barrier(group)  # every rank sees the directory as it was before this save
            raise UserError(error)
        if rank == 0:  # only now that the new checkpoint is complete; and what a crash left staged
            for old in [*complete_checkpoints(self.checkpoints)[:-keep], *self.checkpoints.glob("step_*.tmp")]:
                shutil.rmtree(old, ignore_errors=True)
        _barrier(group)
        return final

    def save_in_background(
        self,
        step: int,
        rank: int,
        world_size: int,
        rank_state: dict,
        shared_files: dict[str, object],
        keep: int,
        synced: bool = True,
        sharded: dict[str, dict] | None = None,
        timeout_s: float | None = None,
        on_failure: Callable[[], None] | None = None,
    ) -> None:
        """`save` without making the caller wait for the files: on every rank, once the previous background
        save is published (its error raised here, the same on every rank), the state is copied to host
        memory and a thread of its own writes, agrees and publishes it over a Gloo group made once (its
        collectives never meet the training's; `timeout_s`, its timeout), while the caller goes on.
        `on_failure()` is called on that thread when the write failed; wait_for_save() raises its error."""
        self.wait_for_save()
        if self._group is None:
            self.make_group(timeout_s)
        storages: dict = {}  # one copy of a storage several tensors share
        rank_state, shared_files, sharded = (host_copy(part, storages) for part in (rank_state, shared_files, sharded or {}))

        def write() -> Path:
            return self.save(step, rank, world_size, rank_state, shared_files, keep, synced, sharded, self._group)

        self._writing = BackgroundWrite(checkpoint_name(step), write, on_failure)

    def make_group(self, timeout_s: float | None) -> None:
        """The background writes' own Gloo group (a collective of every rank), made by the first save, or
        beforehand by a run whose ranks change (train.elastic live makes it with each new group of ranks,
        so that no save waits in a rendezvous for a rank that is gone)."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s) if timeout_s else None)

    def wait_for_save(self) -> Path | None:
        """Wait for the checkpoint being written in the background: the published checkpoint (None when
        none was), or its error raised, the same UserError on every rank (every rank's writer agreed on it)."""
        writing, self._writing = self._writing, None
        return writing.wait() if writing is not None else None

    def _save_error(self, name: str, e: Exception) -> str:
        """One sentence for a failed checkpoint write: a full disk named by where it is mounted."""
        usage = shutil.disk_usage(self.checkpoints) if self.checkpoints.is_dir() else None
        if getattr(e, "errno", None) == errno.ENOSPC or (usage is not None and usage.free < _NEARLY_FULL):
            mount = self.checkpoints.resolve()
            while not os.path.ismount(mount):
                mount = mount.parent
            why = f"no space is left on the disk mounted at {mount} ({usage.free if usage else 0:,} of {usage.total if usage else 0:,} bytes free)"
        else:
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).strip().splitlines()[0]
        return f"could not write checkpoint {name} under {self.checkpoints}: {why}; its staged files are removed and the earlier checkpoints are untouched."

    def _publish(self, staged: Path, final: Path, step: int, world_size: int, recorded: dict[str, tuple[int, str]], synced: bool = True) -> None:
        """Rank 0: write every rank's files' sizes and digests into the marker, then make the checkpoint visible."""
        missing = [r for r in range(world_size) if not (staged / f"rank_{r:05d}.pt").is_file()]
        if missing:
            raise _MissingRanks(f"the state of ranks {missing} is missing")
        absent = [n for n in recorded if not (staged / n).is_file()]
        if absent:  # written where rank 0 does not see it (a directory that is not shared between the nodes)
            raise _MissingRanks(f"{absent[0]} is missing")
        lines = [f"step {step}", f"world_size {world_size}", f"synced {int(synced)}"]  # synced 0: inside a local-step period
        lines += [f"file {n} {size} {digest}" for n, (size, digest) in sorted(recorded.items())]
        _write_synced(staged / MARKER, "".join(line + "\n" for line in lines))
        for directory in [staged, *(p for p in staged.iterdir() if p.is_dir())]:  # the sharded parts' entries too
            _fsync_dir(directory)
        aside = None
        if final.exists():  # the same step saved again: keep the old one until the new one is in place
            aside = final.with_name(final.name + ".replaced")
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(final, aside)
        try:
            os.replace(staged, final)
        except OSError:
            if aside is not None:
                os.replace(aside, final)
            raise
        _fsync_dir(self.checkpoints)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)

    @staticmethod
    def load(checkpoint: Path, name: str, device: torch.device | str = "cpu"):
        """One file of a checkpoint (e.g. model.pt, trainer.pt, rank_00001.pt), tensors on `device`."""
        return read_checkpoint_file(checkpoint / name, device)


def _numpy_array_globals() -> list:
    """What torch's weights-only unpickler needs for a plain numpy array: the RNG state of checkpoints
    written before it was saved as a list. Nothing it admits can run code."""
    core = getattr(np, "_core", None) or np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def read_checkpoint_file(path: Path, device: torch.device | str = "cpu", opened=None):
    """torch.load of tensors and plain values only (weights_only): a checkpoint cannot run code when it
    is read. A file holding any other pickled object is refused in one sentence. `opened`: the file,
    opened already (read from it; `path` names it)."""
    try:
        with torch.serialization.safe_globals(_numpy_array_globals()):
            return torch.load(path if opened is None else opened, map_location=device, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f"a pickled {found.group(1)}" if found else "a pickled object"
        raise UserError(
            f"{path} holds {what}, not only tensors and plain values; zoa-train reads no code from a checkpoint, "
            "so it refuses the file (checkpoints it writes never hold one)."
        ) from None


def _record_step(line: str) -> float:
    try:
        return int(json.loads(line)["step"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        return float("inf")  # a torn line (a crash while writing) is dropped too


class _MissingRanks(Exception):
    pass


def agree(error: str | None, group=None) -> str | None:
    """Collective over `group` (None: the default group): the first rank's error message (by rank), the same on every rank, or None."""
    return _gather(error, {}, group)[0]


def _gather(error: str | None, recorded: dict, group=None) -> tuple[str | None, dict]:
    """Collective: the first rank's error (by rank) and the union of every rank's `recorded`, the same on every rank."""
    gathered: list = [(error, recorded)]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (error, recorded), group=group)
    union = {}
    for _, theirs in gathered:
        union.update(theirs)
    return next((e for e, _ in gathered if e is not None), None), union


def _barrier(group=None) -> None:
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.barrier(group=group)


def resolve_model_file(path: str | Path) -> tuple[Path, "RunDirectory | None"]:
    """What `--checkpoint` may name, as (the model's file or directory, the run directory it belongs to or
    None): a run directory (its latest complete checkpoint's model), a checkpoint directory, a model file,
    or a sharded model directory. A checkpoint's model is its model.pt, or a sharded run's model/."""
    path = Path(path)
    if path.is_file() or (path / ".metadata").is_file():  # a model file, or a sharded model's directory
        model = path
    elif (path / MARKER).is_file():
        problem = verify_checkpoint(path, names=MODEL_FILES)
        if problem is not None:
            raise UserError(f"checkpoint {path} is damaged: {problem}.")
        model = model_of(path)
    elif path.is_dir() and (path / "checkpoints").exists():
        latest = RunDirectory(path).latest(names=MODEL_FILES)  # only the model's files are read
        if latest is None:
            raise UserError(f"run directory {path} has no intact complete checkpoint.")
        model = model_of(latest)
    elif path.is_dir():
        raise UserError(f"{path} is neither a run directory, a complete checkpoint nor a model file.")
    else:
        raise UserError(f"--checkpoint {path}: no such file or directory.")
    if not model.exists():
        raise UserError(f"checkpoint {model.parent} has no model.pt.")
    # the model lies in <run>/checkpoints/step_N/: the run directory holds the recipe and classes.
    for candidate in (model.parent, *model.parents[:3]):
        if (candidate / "recipe.yaml").is_file():
            return model, RunDirectory(candidate)
    return model, None


def model_of(checkpoint: Path) -> Path:
    """A checkpoint's model: model/ (a sharded run's shards) where it has one, else model.pt."""
    return checkpoint / MODEL_SHARDS if (checkpoint / MODEL_SHARDS).is_dir() else checkpoint / "model.pt"
