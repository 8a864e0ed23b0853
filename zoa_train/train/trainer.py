"""The training loop: wires a task, an optimizer, a schedule, logging and checkpoints on one rank.
(Over 600 lines because it is one class, Trainer, whose build, step, save and load share its state;
what can stand alone already does: resume_rules, checkpointer, rundir, metrics, blocks, monitor.)

Launch (see zoa_train/train/launch.py): `zoa-train run RECIPE` starts `train.nproc` local ranks itself;
under `torchrun --nproc-per-node N -m zoa_train.cli run RECIPE` or `srun zoa-train run RECIPE`
each process is one rank and joins the group its launcher describes. Either way every rank
prepares the run directory the same way (train/rundir.py).

The trainer knows neither the task (zoa_train/tasks) nor the optimizer (zoa_train/optim/registry.py
builds it; the trainer drives it as a TrainingOptimizer).
Gradient clipping uses each rank's own gradient norm: with the 1-bit optimizers gradients are never
averaged in full precision, and a global norm would cost a full-precision allreduce every step.
"""

import contextlib
import copy
import functools
import logging
import random
import signal
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import yaml

from zoa_train.comm import ClusterCollective, TopologyChanged
from zoa_train.comm import registry as collectives
from zoa_train.comm.buckets import listing_order
from zoa_train.comm.cluster import shard_collective
from zoa_train.comm.sharding import gradient_order, load_full_model_state, local_shard, node_sharding
from zoa_train.config import CommConfig, Recipe, check_batch_layout, clip_rule, recipe_from_dict, rounds_kept_in_step
from zoa_train.data.prefetch import DevicePrefetcher
from zoa_train.distributed import STOP_SIGNALS, init_process_group, restart_count, threads_per_rank
from zoa_train.errors import UserError
from zoa_train.models import registry as models
from zoa_train.models.blocks import check_compiler, prepare_blocks
from zoa_train.optim import registry
from zoa_train.optim.training import parameter_groups
from zoa_train.plan.counts import PlanContext
from zoa_train.precision import autocast
from zoa_train.tasks import build_task
from zoa_train.train import resume_rules
from zoa_train.train.checkpointer import read_shards, shard_shapes
from zoa_train.train.live import LiveMembership, LiveTraining, RunOver
from zoa_train.train.loss_scaling import LossScaler
from zoa_train.train.metrics import LogWindow, MetricsLogger
from zoa_train.train.monitor import RankMonitor
from zoa_train.train.rundir import MODEL_SHARDS, RunDirectory, agree, complete_checkpoints, read_marker, shards_key

log = logging.getLogger(__name__)


_FAILURE_KEY = "zoa_train/user_error"


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than train.timeout_s: a peer stopped answering. One sentence."""


_STOP_KEY, _STOP_COUNT = "zoa_train/stop_at", "zoa_train/stop_requests"
# STOP_SIGNALS (distributed.py): what schedulers send before they kill. A second one (the batch shell and
# torchrun may both forward it) only sets the same flag again; once one has arrived they stay ignored
# until the process exits, so a late one cannot kill a rank that has checkpointed and is on its way out
# with EXIT_PREEMPTED.
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on request after a complete checkpoint; `--resume auto` continues exactly


def run_rank(recipe_dict: dict, run_dir: str, resume: str | None, overwrite: bool = False, reshard: bool = False) -> dict | None:
    """Body of one rank; rank 0 returns the run's summary. A UserError (bad data file, checkpoint, ...)
    comes back as {"user_error": message} so the launching process can report it in one sentence.

    A UserError met by one rank alone (a corrupt image in its batch) breaks the others' next
    collective; the failing rank leaves its message in the rendezvous store first, so the others
    report that sentence ({"user_error": ..., "another_rank": True}) instead of a connection error.

    A rank restarted by torch elastic (a rank of an earlier attempt died: zoa-train run
    --max-restarts, torchrun --max-restarts) continues the run as `--resume auto` would, whatever
    the command line said: never --overwrite again, and from the run directory's latest complete
    checkpoint (an explicit --resume CHECKPOINT holds until this run has written one of its own)."""
    restart = restart_count()
    if restart:
        if resume is None or complete_checkpoints(Path(run_dir) / "checkpoints"):
            resume = "auto"
        overwrite = False
    trainer = None
    try:
        trainer = Trainer(recipe_from_dict(recipe_dict), Path(run_dir), resume, overwrite, reshard)
        return trainer.fit()
    except RunOver:  # train.elastic live: the run ended while this rank waited to join
        return None
    except UserError as e:
        _store_set(_FAILURE_KEY, str(e))
        return {"user_error": str(e)}
    except RuntimeError as e:
        # A rank that refused something left its sentence before it exited (which is what broke this rank's
        # collective), so a short wait finds it; a lost node leaves none, and every second here delays the restart.
        message = _store_get(_FAILURE_KEY, wait_s=1.0)
        if message is not None:
            return {"user_error": message, "another_rank": True}
        if "Timed out" in str(e) and trainer is not None:  # Gloo; NCCL's watchdog names the collective itself
            detail = str(e).strip().splitlines()[-1].split("] ")[-1]
            raise CollectiveTimeout(
                f"rank {trainer.rank} waited more than train.timeout_s = {trainer.recipe.train.timeout_s} s for the other ranks "
                f"during {trainer.phase} at step {trainer.step + 1} ({detail}): a rank stopped answering (stopped, hung, or its "
                "node is gone); see its log, then continue with --resume auto."
            ) from None
        raise
    finally:
        if trainer is not None:
            trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _store():
    """The rendezvous key-value store: it outlives a broken process group (torchrun's agent holds it)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.distributed_c10d._get_default_store()  # a restarted attempt's own (distributed.init_process_group)


def _store_set(key: str, value: str) -> None:
    store = _store()
    if store is not None:
        with contextlib.suppress(RuntimeError):  # the store is gone too: the others report their own error
            store.set(key, value)


def _store_get(key: str, wait_s: float) -> str | None:
    store = _store()
    deadline = time.monotonic() + wait_s
    while store is not None:
        try:
            if store.check([key]):
                return store.get(key).decode()
        except RuntimeError:
            return None
        if time.monotonic() > deadline:
            return None
        time.sleep(0.1)
    return None


def _summed(loss_sum: torch.Tensor) -> float:
    total = loss_sum.clone()  # out of place: a failed allreduce leaves the step's loss as it was
    dist.all_reduce(total)
    return total.item()


def _plain_numpy_state(state: tuple) -> tuple:
    """numpy's RNG state with its key array as a list of ints: a checkpoint holds plain values only."""
    name, keys, *rest = state
    return (name, keys.tolist(), *rest)


SHARDED_STATE = "optimizer"  # the directory of a sharded checkpoint's optimizer state per parameter


def _warn_of_unused_comm_keys(recipe: Recipe) -> None:
    """Say which comm keys set in the recipe do nothing in a run that makes no 1-bit round (DDP's Adam and
    PowerSGD, DiLoCo's full-precision outer sync)."""
    unused = [f"comm.{key}" for key in ("topology", "kernels", "bucket_cap_mb", "overlap") if getattr(recipe.comm, key) != getattr(CommConfig(), key)]
    if unused:
        log.warning(
            "%s %s no effect on this run: optimizer %s sends no 1-bit rounds here (only the 1-bit optimizers' rounds and outer_collective onebit use them)",
            " and ".join(unused),
            "has" if len(unused) == 1 else "have",
            recipe.optimizer.name,
        )


def _layout_refusal(path: Path, changed: list, cause: Exception) -> str:
    """Why a checkpoint's 1-bit layout does not fit this run's, naming the recipe keys that changed it."""
    keys = [c for c in changed if c.key in resume_rules.LAYOUT]
    if not keys:
        return f"cannot resume from {path}: {cause}."
    said = ", ".join(f"{c.key} {resume_rules.show(c.now)} (was {resume_rules.show(c.was)})" for c in keys)
    back = " and ".join(f"{c.key} {resume_rules.show(c.was)}" for c in keys)
    return (
        f"cannot resume from {path} with {said}: that lays the 1-bit rounds out otherwise than the checkpoint's error buffers; "
        f"resume with {back}, or pass --reshard to continue with the error buffers at zero."
    )


def _layout_words(layout: list[int] | None) -> str:
    return f"sharded on {layout[0]} nodes x {layout[1]} ranks" if layout else "unsharded"


def rank_seed(seed: int, rank: int) -> int:
    """A seed for this rank's own random draws, unrelated to the other ranks' and to `seed` itself."""
    return int(np.random.SeedSequence([seed, rank]).generate_state(1, np.uint64)[0] >> 1)


class Trainer(LiveTraining):
    def __init__(self, recipe: Recipe, run_dir: Path, resume: str | None = None, overwrite: bool = False, reshard: bool = False):
        # train.elastic reshard: a resume at another world size (a node lost or added) needs no --reshard
        self.recipe, self.reshard = recipe, reshard or recipe.train.elastic == "reshard"
        t = recipe.train
        # train.elastic live: ranks leave and join while the others go on (zoa_train/train/live.py)
        self.live = LiveMembership("gloo", t.timeout_s) if t.elastic == "live" else None
        if self.live is not None:
            self.device = torch.device("cpu")
            if not self.live.start():
                raise RunOver()
        else:
            self.device = init_process_group(None if t.backend == "auto" else t.backend, timeout_s=t.timeout_s)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.is_main = self.rank == 0
        torch.set_num_threads(threads_per_rank(self.world))
        self.accum = check_batch_layout(recipe, self.world)
        self.run_dir = RunDirectory(run_dir)
        joining = self.live is not None and self.live.joining
        # a rank that joins a live run takes its state from rank 0 (below), not from the run directory
        checkpoint = None if joining else self.run_dir.prepare(resume, overwrite, self.world, self.rank, self.reshard)
        self._previous_handlers = {}
        self.stop_requested = False
        try:
            self._build(recipe, resume if not joining else None, checkpoint)
            if self.live is not None:
                with self._making_groups():  # now, with every member there (zoa_train/train/live.py)
                    self.run_dir.make_group(t.timeout_s)
            if joining:
                self.exchange_state()
        except BaseException:
            self.close()  # run_rank has no trainer to close yet: release the lock, workers and handlers here
            raise

    def _build(self, recipe: Recipe, resume: str | None, checkpoint: Path | None) -> None:
        t = recipe.train
        self.task = build_task(recipe, self.rank, self.world)
        self.batches = DevicePrefetcher(self.task.loader, self.task.to_device, self.device)
        torch.manual_seed(t.seed)  # the same initial model on every rank
        self.model = self.task.build_model().to(self.device)
        if t.compile:
            check_compiler(self.device)
        # per block, before sharding (FSDP2's hooks go around the recomputed, compiled blocks)
        prepare_blocks(self.model, models.get(recipe.model.kind).blocks(self.model), t.activation_checkpointing, t.compile)
        # From here on each rank draws its own dropout masks (the same masks on every rank would
        # correlate the ranks' gradients); the RNG states are in the checkpoint, so resume is exact.
        torch.manual_seed(rank_seed(t.seed, self.rank))
        # bf16 full-precision rounds: the node-aware sync's reduce-scatter inside the node in bf16 too;
        # fp16 would need the scale that flat fp16 rounds take, so it (and fp32) stays fp32 there.
        intra_dtype = torch.bfloat16 if recipe.optimizer.allreduce_dtype == "bf16" else torch.float32
        c = recipe.comm
        groups = parameter_groups(self.model, weight_decay=0.0)  # the optimizer's groups of tensors, for the buckets' order
        if c.shard == "node":  # the model sharded inside each node, its shards exchanged flat between nodes
            self.sharding = node_sharding(c.ranks_per_node)
            # buckets cut by whole tensors, in the order FSDP2 finishes its units
            order = gradient_order(self.model, groups)
            sync, described = shard_collective(c.topology, c.kernels, c.bucket_cap_mb, c.overlap, order)
            if self.is_main:
                print(f"sharded inside the node (FSDP2), {self.sharding.describe()}; {described}", flush=True)
        else:
            self.sharding = None
            # buckets in the order backward finishes the layers, across the parameter groups
            order = listing_order(self.model, groups)
            sync = ClusterCollective(c.topology, c.ranks_per_node, intra_dtype, c.kernels, c.bucket_cap_mb, c.overlap, order)
        self.sync = sync
        with self._making_groups():  # a node-aware sync's node groups
            self.opt = registry.create(recipe.optimizer, self.model, self.device, self.world, collective=sync, sharding=self.sharding)
        self.params = [p for p in self.model.parameters() if p.requires_grad]  # this rank's shards when sharded
        self.clip_rule = clip_rule(recipe)
        if self.clip_rule == "bucket":
            self.opt.clip_by_bucket(t.grad_clip or None)
            if t.grad_clip and self.is_main:
                print(f"gradients clipped bucket by bucket as backward finishes them (train.grad_clip_rule {t.grad_clip_rule})", flush=True)
        self._no_overlap_when_gradients_change(recipe)
        if self.sharding is None and not sync.chosen and self.is_main:
            _warn_of_unused_comm_keys(recipe)
        if self.sharding is None and sync.chosen and self.is_main:
            if sync.spec is not collectives.default():  # flat on one node is what everyone expects: not said
                print(sync.chosen, flush=True)
            if sync.fell_back:
                log.warning("comm.topology auto: the nodes have unequal numbers of ranks, so the 1-bit sync is flat")
        self._warn_about_the_plan(recipe)
        self.ledger = self.opt.ledger
        self.scheduler = recipe.lr_schedule().scheduler(self.opt.optimizer)
        self.scaler = LossScaler(t.precision == "fp16", self.device)
        self.step = 0
        self.wall_offset = 0.0
        self.skipped_nonfinite = 0
        self.first_nonfinite = self._step_tensor(self._NONE)
        self.stop_requested, self.stop_at = False, None
        self.save_due: int | None = None  # train.elastic: the step a periodic checkpoint fell due at, until it is taken
        self.phase = "set-up"
        self.recipe_changes: list[dict] = []  # keys changed on resumes, each with the step it took effect at (resume_rules.py)
        if threading.current_thread() is threading.main_thread():
            self._previous_handlers = {sig: signal.signal(sig, self._request_stop) for sig in STOP_SIGNALS}
        if checkpoint is not None:
            refused = None
            try:
                self._load(checkpoint)
            except UserError as e:
                refused = str(e)
            refused = agree(refused)  # every rank refuses alike, before anything in the run directory changes
            if refused is not None:
                raise UserError(refused)
            if self.is_main and restart_count():
                log.warning("restart %d after a rank failed: every rank resumed from %s (step %d)", restart_count(), checkpoint, self.step)
        elif resume:
            log.info("no complete checkpoint in %s: starting from step 0", self.run_dir.checkpoints)
        # a restart after a failure (torch elastic), or an elastic run's resume at another world size (a node left or joined)
        saved_world = read_marker(checkpoint)["world_size"] if checkpoint is not None else None
        rejoined = restart_count() > 0 or (saved_world not in (None, self.world) and t.elastic == "reshard")
        before = self.run_dir.last_record() if self.is_main and rejoined else None  # where the attempt before got to
        if self.is_main and resume:  # the records logged after the checkpoint are logged again
            self.run_dir.trim_metrics(self.step)
        if self.is_main:
            (self.run_dir.path / "recipe.yaml").write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
            changes = self.run_dir.path / resume_rules.CHANGES
            if self.recipe_changes:
                changes.write_text(yaml.safe_dump(self.recipe_changes, sort_keys=False))
            else:
                changes.unlink(missing_ok=True)
            self.task.save_artifacts(self.run_dir.path)
        self.metrics = MetricsLogger(self.run_dir.path, recipe, t.steps, self.step, self.is_main)
        if self.is_main and rejoined:
            self._log_membership(saved_world, before)

    def _log_membership(self, saved_world: int | None, before: tuple[dict, float] | None) -> None:
        """One metrics record for a restart after a failure or an elastic run's resume at another world size: at the step it
        resumed from, the ranks now and before (the checkpoint's), torch elastic's restarts after failures so
        far, and what the change cost: the steps and samples trained again and the seconds they had taken,
        and the seconds from the last record before to this resume (seeing the failure, stopping, the
        rendezvous, starting, loading)."""
        record = {"step": self.step, "world_size": self.world, "restarts": restart_count()}
        if saved_world is not None:  # the checkpoint's
            record["world_size_before"] = saved_world
        if before is not None:
            last, written = before
            redone = max(0, last["step"] - self.step)
            record |= {"steps_redone": redone, "samples_redone": redone * self.recipe.train.global_batch_size}
            if "wall_time" in last:
                record["seconds_redone"] = round(max(0.0, last["wall_time"] - self.wall_offset), 3)
            record["seconds_down"] = round(max(0.0, time.time() - written), 3)
        self.metrics.log(record)

    def _monitor(self) -> RankMonitor:
        t = self.recipe.train
        return RankMonitor(self.device, self.task.flops_per_unit(self.model), t.precision, t.peak_tflops, self.world, self.is_main)

    def _record_memory(self, throughput: float) -> dict:
        return self.monitor.record(throughput)  # self.monitor: after a regroup (train.elastic live), the new world's

    def _refused_elsewhere(self) -> bool:
        """Whether a rank stopped on bad input and left its sentence (run_rank): its exit broke this collective."""
        return _store_get(_FAILURE_KEY, wait_s=0) is not None

    def _position(self) -> dict:
        """Where the run is (train.elastic live: what rank 0 sends a rank that joins)."""
        return {
            "step": self.step,
            "scheduler": self.scheduler.state_dict()["last_epoch"],
            "wall_time": self.wall_offset,
            "skipped_nonfinite": self.skipped_nonfinite,
            "save_due": self.save_due,
            "stop_at": self.stop_at,
            "loader": self.batches.state_dict(),
            "scaler": self.scaler.state_dict(),
            "recipe_changes": self.recipe_changes,
        }

    def _take_position(self, position: dict) -> None:
        self.step, self.wall_offset, self.skipped_nonfinite = position["step"], position["wall_time"], position["skipped_nonfinite"]
        self.save_due = position["save_due"]  # decides when the next checkpoint synchronises the ranks
        self.stop_at = position["stop_at"]  # agreed in an earlier generation's keys
        self.scheduler = self.recipe.lr_schedule().scheduler(self.opt.optimizer, start=position["scheduler"])
        self.batches.load_state_dict(position["loader"])
        self.scaler.load_state_dict(position["scaler"])
        self.recipe_changes = position["recipe_changes"]
        self._synced_at = self.step

    def _warn_about_the_plan(self, recipe: Recipe) -> None:
        """Say once (rank 0) what the optimizer's plan for this run warns of, e.g. 0/1 Adam's lr policy
        under a schedule that never lets it take a local step."""
        spec, o = registry.get(recipe.optimizer.name), recipe.optimizer
        shapes = tuple(tuple(p.shape) for p in self.model.parameters())
        context = PlanContext(recipe.train.steps, recipe.lr_schedule(), self.world, 1, 32, o.betas, spec.knobs_from(o), shapes)
        warning = spec.plan(context).warning
        if warning and self.is_main:
            log.warning(warning)

    def _no_overlap_when_gradients_change(self, recipe: Recipe) -> None:
        """Rounds started during backward use the gradients as backward left them: a run that changes
        them afterwards starts its rounds in step() instead."""
        reason = rounds_kept_in_step(recipe)
        if reason:
            self.opt.keep_rounds_in_step(reason)

    # ---- the loop -----------------------------------------------------------------------------

    def fit(self) -> dict | None:
        t = self.recipe.train
        started = time.perf_counter() - self.wall_offset
        window = LogWindow(t.log_every, t.global_batch_size * self.task.units_per_sample, self.task.unit)
        self.monitor = self._monitor()
        train_record, val_record = {}, {}
        # Every collective below runs through _survive: under train.elastic live a lost rank is dropped there.
        while self.step < t.steps:
            taken = self.train_step()
            if taken is None:
                continue  # every rank skipped it: no optimizer step, schedule or state touched
            loss_sum, lr, kind = taken
            self.step += 1
            if not self.opt.parameters_differ:
                self._synced_at = self.step
            window.add(kind)
            last = self.step == t.steps
            stopping = not last and self._stop_step() == self.step
            saving = self.should_save(last) or stopping
            log_now = window.should_log(self.step, last)
            if log_now or saving:
                self._survive(self._check_finite)  # before anything is logged or saved
            record = {}
            if log_now:
                if last:
                    self.opt.wait_for_rounds()  # the final totals count a delayed round still running
                total = self._survive(functools.partial(_summed, loss_sum))  # monitoring only: one scalar every log_every steps
                train_record = window.record(total / self.world, lr, self.ledger, self.opt.variance_updates)
                # memory peaks: one small all-gather
                train_record |= self._survive(functools.partial(self._record_memory, train_record[window.throughput_key]))
                record |= train_record
            paused = time.perf_counter()  # validation and checkpoints are not training throughput
            if last:
                self._survive(self.opt.synchronize, undo=True)  # every rank ends on the same model
            if self.should_validate(last):
                val_record = self._survive(self.validate)
                record |= val_record
            if record:
                self.metrics.log({"step": self.step, **record, "wall_time": time.perf_counter() - started})
            if saving:
                if stopping and t.elastic == "reshard" and self.opt.parameters_differ:
                    self.opt.synchronize()  # a stop is how torchrun changes membership: its checkpoint must reshard
                self.wall_offset = time.perf_counter() - started
                self._survive(self.save)
            if stopping:
                self.run_dir.wait_for_save()  # published before the rank exits
                log.warning("stopped at step %d on a termination signal, after a complete checkpoint", self.step)
                return {"preempted": True, "step": self.step, "run_dir": str(self.run_dir.path)}
            window.exclude(time.perf_counter() - paused)
            if self.live is not None and not last:
                self.admit_joiners()
        self.run_dir.wait_for_save()  # the last checkpoint published before the run ends
        if self.live is not None:
            self.live.finish()  # ranks still waiting to join give up
        if not self.is_main:
            return None
        summary = {"step": self.step, **train_record, **val_record, "wall_time": time.perf_counter() - started}
        for key in ("step_kinds", "train_s", "mem_peak_bytes_by_rank", "mem_lifetime_peak_bytes_by_rank"):
            summary.pop(key, None)
        return summary | {"run_dir": str(self.run_dir.path)}

    def should_validate(self, last: bool) -> bool:
        every = self.recipe.train.val_every
        return last or bool(every and self.step % every == 0)

    def should_save(self, last: bool) -> bool:
        t = self.recipe.train
        due = bool(t.checkpoint_every and self.step % t.checkpoint_every == 0)
        if last or t.elastic == "off":
            return last or due
        # elastic: a periodic checkpoint waits for a synchronised step, as only those reshard; the ranks
        # sync within max_steps_apart steps (0/1 Adam's period, DiLoCo's outer step), else the trainer syncs them
        if due and self.save_due is None:
            self.save_due = self.step
        if self.save_due is None:
            return False
        if self.opt.parameters_differ:
            if self.step - self.save_due < self.opt.max_steps_apart:
                return False
            self._survive(self.opt.synchronize, undo=True)
        self.save_due = None
        return True

    def train_step(self) -> tuple[torch.Tensor, float, str] | None:
        """Forward and backward over the step's micro-batches, then the optimizer step: this rank's
        summed loss, the lr stepped with and the step's kind (zoa_train.step_kinds); None when every
        rank skips the step."""
        t = self.recipe.train
        self.model.train()
        self.phase = "forward and backward (DDP's gradient allreduce)"
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(self.accum):
            # no_sync() around forward and backward: DDP reads it at the forward, the 1-bit
            # optimizers at the backward (their rounds start in gradient hooks)
            with contextlib.nullcontext() if micro == self.accum - 1 else self.opt.no_sync():
                with autocast(t.precision, self.device):
                    loss = self.task.loss(self.opt.module, next(self.batches)) / self.accum
                self.scaler.scale_loss(loss).backward()
            loss_sum += loss.detach()
        if self._skip(loss_sum):
            self.opt.zero_grad()
            return None
        if t.grad_clip > 0 and self.clip_rule == "global":  # "bucket": the optimizer clips, bucket by bucket
            torch.nn.utils.clip_grad_norm_(self.params, t.grad_clip)
        lr = self.opt.lr
        self.phase = "the optimizer step (its allreduce)"
        kind = self._survive(self.opt.step, undo=self.opt.next_step_communicates())
        self.phase = "logging, validation or a checkpoint"
        self.scheduler.step()
        self.opt.zero_grad()
        return loss_sum, lr, kind

    def _skip(self, loss_sum: torch.Tensor) -> bool:
        """Whether every rank skips this step: an fp16 overflow in a step that communicates, or a loss
        that is not finite on some rank under train.skip_nonfinite. An overflow in a local step (this
        rank's alone) zeroes its gradients instead; a non-finite loss without skip_nonfinite is noted
        and stops the run at the next check (_check_finite)."""
        t = self.recipe.train
        communicates = self.opt.next_step_communicates()
        if self.scaler.unscale_and_check(self.params, communicates, self.ledger):
            if communicates:
                return True
            for p in self.params:
                if p.grad is not None:
                    p.grad.zero_()
        if not t.skip_nonfinite:  # no communication: remember the first such step
            self.first_nonfinite = torch.where(
                torch.isfinite(loss_sum), self.first_nonfinite, torch.minimum(self.first_nonfinite, self._step_tensor(self.step + 1))
            )
            return False
        if not self._nonfinite_anywhere(loss_sum):  # agreed by one scalar allreduce per step
            return False
        self.skipped_nonfinite += 1
        if self.skipped_nonfinite > t.skip_nonfinite:
            self._stop_nonfinite(self.step + 1)
        log.warning("step %d: the loss is not finite on some rank; every rank skips the step", self.step + 1)
        return True

    # ---- preemption ---------------------------------------------------------------------------

    def _request_stop(self, signum, frame) -> None:
        self.stop_requested = True  # acted on between steps: a handler must not touch the training state

    def _stop_step(self) -> int | None:
        """The step at which every rank stops, once any rank got a stop signal. The first rank to get
        one proposes a step no rank can have passed yet (ranks may run ahead of each other by up to
        a local-step period) and the rendezvous store gives every rank that same step."""
        if self.stop_at is not None:
            return self.stop_at
        store = _store()
        if self.stop_requested:
            proposal = self.step + self.opt.max_steps_apart + 1
            if store is None:
                self.stop_at = proposal
            else:
                if store.add(_STOP_COUNT, 1) == 1:
                    store.set(_STOP_KEY, str(proposal))
                self.stop_at = int(store.get(_STOP_KEY))  # waits for the first proposer's value
        elif store is not None and store.check([_STOP_KEY]):  # one store round trip a step, nothing on the data path
            self.stop_at = int(store.get(_STOP_KEY))
        if self.stop_at is not None and self.stop_at < self.step:
            raise RuntimeError(f"rank {self.rank} is at step {self.step}, past the agreed stop step {self.stop_at}")
        return self.stop_at

    # ---- numerical faults -----------------------------------------------------------------------

    _NONE = 2**62  # first_nonfinite while every loss so far was finite

    def _step_tensor(self, step: int) -> torch.Tensor:
        return torch.tensor(step, dtype=torch.int64, device=self.device)

    def _nonfinite_anywhere(self, loss: torch.Tensor) -> bool:
        def anywhere() -> bool:
            flag = (~torch.isfinite(loss)).to(torch.float32).reshape(1)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            return bool(flag.item())

        return self._survive(anywhere)

    def _check_finite(self) -> None:
        """Stop every rank, before it logs or saves, if any rank's loss was NaN or infinite since the last check."""
        first = self.first_nonfinite.clone()
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
        if int(first) < self._NONE:
            self._stop_nonfinite(int(first))

    def _stop_nonfinite(self, step: int) -> None:
        latest = self.run_dir.latest(hashes=False)
        kept = f"; the last checkpoint, {latest}, was written before it and is intact" if latest is not None else ""
        raise UserError(
            f"the loss was NaN or infinite at step {step} on at least one rank, so the run stopped{kept}: lower optimizer.lr, "
            "set train.grad_clip or let train.skip_nonfinite skip such steps, then continue with --resume auto."
        )

    def validate(self) -> dict[str, float]:
        """The task's validation metrics over `val_batches` micro-batches per rank, averaged over the ranks."""
        self.opt.average_statistics()
        return self.task.evaluate(self.model, self.device, self.recipe.train.precision, self.recipe.train.val_batches)

    # ---- checkpoints --------------------------------------------------------------------------

    def save(self) -> None:
        """Checkpoint this step in the background (RunDirectory.save_in_background): the step waits for the
        previous checkpoint's write and for this one's copy to host memory, not for its files. A sharded
        run's model is written by every rank, its own shards (model/), never gathered."""
        self.opt.average_statistics()
        synced = not self.opt.parameters_differ  # inside a local-step period each rank's (each node's) parameters differ
        rank_state = {
            "optimizer": self.opt.rank_state_dict(),
            "loader": self.batches.state_dict(),
            "scaler": self.scaler.state_dict(),  # each rank's own: local steps check overflow locally
            "rng": {
                "torch": torch.get_rng_state(),
                "device": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None,  # this rank's GPU only
                "numpy": _plain_numpy_state(np.random.get_state()),
                "python": random.getstate(),
            },
        }
        sharded = {}
        if self.sharding:  # the optimizer's state is this rank's shard's, so each rank keeps all of it
            rank_state["optimizer_shared"] = self.opt.shared_state_dict()
            sharded[MODEL_SHARDS] = {shards_key(None if synced else self.sharding.node): self.model.state_dict()}
            # At a sync, the optimizer's state per parameter too, which --reshard loads into another layout
            # (the rank files' flat buffers fit this layout only).
            if synced and hasattr(self.opt.optimizer, "parameter_state"):
                sharded[SHARDED_STATE] = {"optimizer": self.opt.optimizer.parameter_state()}
        elif not synced:
            rank_state["model"] = self.model.state_dict()
        shared = {}
        if self.is_main:
            shared = {} if self.sharding else {"model.pt": self.model.state_dict()}
            shared |= {
                "optimizer.pt": self.opt.shared_state_dict(),
                "trainer.pt": {
                    "step": self.step,
                    "scheduler": self.scheduler.state_dict(),
                    "wall_time": self.wall_offset,
                    "world_size": self.world,
                    "skipped_nonfinite": self.skipped_nonfinite,
                    "sharded": self._shard_layout(),
                    "recipe": self.recipe.to_dict(),  # what it trained with (a resume compares: zoa_train/train/resume_rules.py)
                    "recipe_changes": self.recipe_changes,
                },
            }

        def failed() -> None:  # on the writer's thread: every rank stops at one agreed step, whose save raises the error
            self.stop_requested = True

        t = self.recipe.train
        if self.live is not None:  # a write broken by a lost rank is not a reason to stop: the next checkpoint follows
            self._settle_save()
        on_failure = failed if self.live is None else None
        self.run_dir.save_in_background(self.step, self.rank, self.world, rank_state, shared, t.keep_checkpoints, synced, sharded, t.timeout_s, on_failure)

    def _load(self, path: Path) -> None:
        # Everything is read to the CPU and copied into place: loading onto the GPU would hold
        # extra model-sized copies there, and RNG states must be CPU byte tensors.
        load = self.run_dir.load
        saved_world = read_marker(path)["world_size"]
        resharded = saved_world != self.world  # only with --reshard (RunDirectory.check refuses it otherwise)
        shared = load(path, "trainer.pt")
        saved_recipe = resume_rules.saved_recipe(shared, path)
        changed = resume_rules.changes(saved_recipe, self.recipe, shared["step"]) if saved_recipe is not None else []
        resume_rules.judge(path, changed)  # a key that cannot change during a run: refused before anything loads
        saved_layout = shared.get("sharded")
        if saved_layout != self._shard_layout():
            if not self.reshard:
                raise UserError(
                    f"cannot resume from {path}: it was saved {_layout_words(saved_layout)} and this run is {_layout_words(self._shard_layout())}; "
                    "resume with the comm.shard and node layout that wrote it, or pass --reshard to continue with the error buffers at zero."
                )
            resharded = True
        if (path / MODEL_SHARDS).is_dir():  # a sharded run's: every rank reads what it holds of it, in any layout
            self._load_model_shards(path, self.sharding.node if self.sharding and not resharded else 0)
        else:
            self._load_model(path, load(path, "model.pt"))
        mine = load(path, f"rank_{min(self.rank, saved_world - 1):05d}.pt")
        if "model" in mine and not resharded:  # inside a local-step period: this rank's own (a sharded run's shards, before model/)
            self._load_model(path, mine["model"], local=bool(self.sharding))
        groups = self.opt.optimizer.param_groups
        built = copy.deepcopy([{k: v for k, v in group.items() if k != "params"} for group in groups])  # the recipe's settings
        try:
            if not resharded:
                try:
                    self.opt.load_state_dicts(mine.get("optimizer_shared") or load(path, "optimizer.pt"), mine["optimizer"])
                except TopologyChanged as e:  # another comm.topology or node layout: only --reshard continues
                    if not self.reshard:
                        raise UserError(_layout_refusal(path, changed, e)) from None
                    resharded = True
            if resharded:  # refuses a checkpoint inside a local-step period (rank files then hold their own models)
                per_parameter = path / SHARDED_STATE  # a sharded run's optimizer state, saved by torch.distributed.checkpoint
                loader = (lambda targets: read_shards({"optimizer": targets}, per_parameter)) if per_parameter.is_dir() else None
                self.opt.load_resharded(load(path, "optimizer.pt"), loader)
        except (ValueError, KeyError) as e:  # another optimizer, model size, 1-bit layout or topology
            raise UserError(f"cannot resume from {path}: {e}.") from None
        for group, settings in zip(groups, built):  # the state is the checkpoint's, the settings this recipe's
            group.update(settings)
        # Before the resharding is said: a streamed position is refused at another world size.
        self.batches.load_state_dict(mine["loader"])  # a position between global batches: the same on every rank, valid at any layout but a stream's
        if resharded and self.is_main:
            log.warning(
                "resharding %s from %d to %d ranks%s: %s; the data continue at the same sample of the same epoch order",
                path,
                saved_world,
                self.world,
                "" if saved_world != self.world else " (another 1-bit sync layout)",
                self.opt.resharded_state(),
            )
        if self.rank < saved_world:  # a rank the checkpoint did not have keeps its fresh seed (rank_seed)
            torch.set_rng_state(mine["rng"]["torch"])
            if mine["rng"].get("device") is not None and self.device.type == "cuda":
                torch.cuda.set_rng_state(mine["rng"]["device"], self.device)
            np.random.set_state(tuple(mine["rng"]["numpy"]))
            random.setstate(mine["rng"]["python"])
        # The schedule continues at the saved step, from this recipe's lr and schedule.
        self.scheduler = self.recipe.lr_schedule().scheduler(self.opt.optimizer, start=shared["scheduler"]["last_epoch"])
        if saved_recipe is None or saved_recipe["train"]["precision"] == self.recipe.train.precision:  # else the scaler starts afresh
            self.scaler.load_state_dict(mine["scaler"] if "scaler" in mine else shared["scaler"])  # older checkpoints kept one scale
        self.step, self.wall_offset = shared["step"], shared["wall_time"]
        self.skipped_nonfinite = shared.get("skipped_nonfinite", 0)
        self.recipe_changes = [*shared.get("recipe_changes", []), *resume_rules.recorded(changed)]
        if self.is_main:
            for line in resume_rules.applied(changed):
                print(line, flush=True)

    def _shard_layout(self) -> list[int] | None:
        """[nodes, ranks per node] of a sharded run (what its per-rank state depends on), None unsharded."""
        return [self.sharding.nodes, self.sharding.ranks_per_node] if self.sharding else None

    def _load_model(self, path: Path, state: dict, local: bool = False) -> None:
        """Copy a checkpoint's weights in (whole tensors; with `local`, this rank's shards), or refuse a
        checkpoint of another model in one sentence."""
        if local:
            torch._foreach_copy_([local_shard(v) for v in self.model.state_dict().values()], list(state.values()))
            return
        self._check_model(path, {k: tuple(v.shape) for k, v in state.items()})
        if self.sharding:
            load_full_model_state(self.model, state)
        else:
            self.model.load_state_dict(state)

    def _load_model_shards(self, path: Path, node: int) -> None:
        """Read a sharded checkpoint's model (model/) into this model, sharded or not: the one model at a
        sync, else node `node`'s own; refused in one sentence if it is another model."""
        saved = shard_shapes(path / MODEL_SHARDS)
        key = shards_key(None) if shards_key(None) in saved else shards_key(node)
        self._check_model(path, saved.get(key, {}))
        read_shards({key: self.model.state_dict()}, path / MODEL_SHARDS)  # in place: the values are the parameters (their shards)

    def _check_model(self, path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
        """Refuse, in one sentence, a checkpoint whose model (name -> whole shape) is not this one."""
        own = {k: tuple(v.shape) for k, v in self.model.state_dict().items()}
        missing = [k for k in own if k not in shapes]
        unexpected = [k for k in shapes if k not in own]
        reshaped = [k for k in own if k in shapes and shapes[k] != own[k]]
        if missing or unexpected or reshaped:
            if reshaped:
                first = f"{reshaped[0]} is {list(shapes[reshaped[0]])} there and {list(own[reshaped[0]])} here"
            else:
                first = f"{missing[0]} is not in it" if missing else f"{unexpected[0]} is not in this model"
            raise UserError(
                f"cannot resume from {path}: it holds another model ({len(missing)} tensors missing, {len(unexpected)} extra, "
                f"{len(reshaped)} of another shape; {first}); resume with the model section of the recipe that wrote it."
            )

    def close(self) -> None:
        try:
            if hasattr(self, "metrics"):
                self.metrics.close()
            if hasattr(self, "task"):
                self.task.close()
            for sig, handler in self._previous_handlers.items():
                signal.signal(sig, signal.SIG_IGN if self.stop_requested else handler)
        finally:
            self.run_dir.close()  # the run directory's lock
