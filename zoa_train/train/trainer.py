"""The training loop: wires the recipe's model, data, optimizer and schedule together on one rank.

Launch (see zoa_train/cli.py): `zoa-train run RECIPE` starts `train.nproc` local ranks itself;
under `torchrun --nproc-per-node N -m zoa_train.cli run RECIPE` or `srun zoa-train run RECIPE`
each process is one rank and joins the group its launcher describes.

Optimizers: `adam` is DDP + torch.optim.AdamW (foreach, fused on CUDA), the baseline users would
pick; it always applies bias correction, so with `bias_correction: false` the same math runs as
DataParallelAdam instead (no DDP), keeping comparisons with the 1-bit optimizers fair. With
`onebit_adam` and `zero_one_adam` the model is not wrapped in DDP: the optimizer communicates.
Gradient clipping uses each rank's own gradient norm: with the 1-bit optimizers gradients are never
averaged in full precision, and a global norm would cost a full-precision allreduce every step.
"""

import contextlib
import logging
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import yaml

from zoa_train.comm import CommLedger, ring_allreduce_bytes
from zoa_train.config import Recipe, check_batch_layout, recipe_from_dict
from zoa_train.data import DistributedBatchLoader, TextSource, lm_blocks, prepare_lm_data, validation_batches
from zoa_train.distributed import init_process_group, threads_per_rank
from zoa_train.errors import UserError
from zoa_train.models import build_model
from zoa_train.optim import DataParallelAdam, LRSchedule, OneBitAdam, ZeroOneAdam
from zoa_train.runs import FULL, LOCAL, ONEBIT, VARIANCE
from zoa_train.train import checkpoint as ckpt
from zoa_train.train.metrics import MetricsLogger
from zoa_train.train.precision import DTYPES, LossScaler, autocast

log = logging.getLogger(__name__)


def run_rank(recipe_dict: dict, run_dir: str, resume: str | None) -> dict | None:
    """Body of one rank; rank 0 returns the run's summary. A UserError (bad data file, checkpoint, ...)
    comes back as {"user_error": message} so the launching process can report it in one sentence."""
    try:
        trainer = Trainer(recipe_from_dict(recipe_dict), Path(run_dir), resume)
    except UserError as e:
        return {"user_error": str(e)}
    try:
        return trainer.fit()
    except UserError as e:
        return {"user_error": str(e)}
    finally:
        trainer.close()


def lr_schedule(recipe: Recipe) -> LRSchedule:
    s = recipe.schedule
    return LRSchedule(s.name, recipe.optimizer.lr, s.warmup_steps, s.decay_factor, s.decay_every, s.min_lr, recipe.train.steps)


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: biases and LayerNorm weights (1-D) keep weight decay 0, as usual for transformers."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class Trainer:
    def __init__(self, recipe: Recipe, run_dir: Path, resume: str | None):
        self.recipe, self.run_dir = recipe, run_dir
        t, o = recipe.train, recipe.optimizer
        self.device = init_process_group(None if t.backend == "auto" else t.backend)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        torch.set_num_threads(threads_per_rank(self.world))
        self.accum = check_batch_layout(recipe, self.world)
        self.is_main = self.rank == 0

        source = TextSource(
            name=recipe.data.source,
            config=recipe.data.config,
            train_files=tuple(recipe.data.train_files),
            validation_files=tuple(recipe.data.validation_files),
            text_field=recipe.data.text_field,
        )
        cache_dir = Path(recipe.data.cache_dir).expanduser()
        data = prepare_lm_data(source, recipe.model.kind, cache_dir, recipe.data.tokenizer, recipe.data.vocab_size)
        self.tokenizer = data.tokenizer
        seq_len = recipe.data.seq_len
        self.loader = DistributedBatchLoader(lm_blocks(recipe.model.kind, data.train, seq_len, data.tokenizer, recipe.model.next_sentence), t.micro_batch_size, self.rank, self.world, t.seed)
        self.val_blocks = lm_blocks(recipe.model.kind, data.validation, seq_len, data.tokenizer, recipe.model.next_sentence)

        torch.manual_seed(t.seed)
        self.model = build_model(recipe.model, len(data.tokenizer), seq_len, data.tokenizer.pad_token_id, data.tokenizer.eos_token_id).to(self.device)
        self.num_params = sum(p.numel() for p in self.model.parameters())
        self.comm_dtype = DTYPES[o.allreduce_dtype]
        self.ddp = None
        self.optimizer = self._build_optimizer()
        self.ledger = getattr(self.optimizer, "ledger", None) or CommLedger(num_params=self.num_params)
        self.schedule = lr_schedule(recipe)
        self.scheduler = self.schedule.scheduler(self.optimizer)
        self.scaler = LossScaler(t.precision == "fp16")
        self.step = 0
        self.wall_offset = 0.0
        self.checkpoints = run_dir / "checkpoints"
        if resume:
            self._load(self._resolve_resume(resume))
        if self.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "recipe.yaml").write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
            self.tokenizer.save_pretrained(str(run_dir / "tokenizer"))
        self.metrics = MetricsLogger(run_dir, recipe, t.steps, self.step, self.is_main)

    # ---- set-up -------------------------------------------------------------------------------

    def _build_optimizer(self) -> torch.optim.Optimizer:
        o = self.recipe.optimizer
        groups = parameter_groups(self.model, o.weight_decay)
        common = dict(lr=o.lr, betas=o.betas, eps=o.eps, bias_correction=o.bias_correction, allreduce_dtype=self.comm_dtype)
        if o.name == "adam" and o.bias_correction:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            from torch.nn.parallel import DistributedDataParallel

            self.ddp = DistributedDataParallel(self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
            hook = {torch.float16: default_hooks.fp16_compress_hook, torch.bfloat16: default_hooks.bf16_compress_hook}.get(self.comm_dtype)
            if hook:
                self.ddp.register_comm_hook(None, hook)
            fused = self.device.type == "cuda"
            return torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, fused=fused, foreach=not fused)
        if o.name == "adam":
            return DataParallelAdam(groups, **common)
        if o.name == "onebit_adam":
            return OneBitAdam(groups, freeze_step=o.freeze_step, **common)
        return ZeroOneAdam(groups, **o.schedule_knobs(), update_clip=o.update_clip, **common)

    # ---- the loop -----------------------------------------------------------------------------

    def fit(self) -> dict | None:
        t = self.recipe.train
        model = self.ddp or self.model
        params = [p for p in self.model.parameters() if p.requires_grad]
        tokens_per_step = t.global_batch_size * self.recipe.data.seq_len
        started = time.perf_counter() - self.wall_offset
        window_start, window_steps = time.perf_counter(), 0
        record, step_kinds = {}, ""
        while self.step < t.steps:
            self.model.train()
            loss_sum = torch.zeros((), device=self.device)
            for micro in range(self.accum):
                batch = {k: v.to(self.device, non_blocking=True) for k, v in next(self.loader).items()}
                sync = micro == self.accum - 1 or self.ddp is None
                with (contextlib.nullcontext() if sync else self.ddp.no_sync()), autocast(t.precision, self.device):
                    loss = model(**batch).loss / self.accum
                self.scaler.scale_loss(loss).backward()
                loss_sum += loss.detach()
            if self.scaler.unscale_and_check(params):
                self.optimizer.zero_grad(set_to_none=True)
                continue  # every rank skips: no optimizer step, schedule or state touched
            if t.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
            lr = self.optimizer.param_groups[0]["lr"]
            self.optimizer.step()
            if self.ddp is not None:  # DDP communicated during backward: count it here
                bits = 32 if self.comm_dtype is None else 16
                nbytes = ring_allreduce_bytes(self.num_params, bits // 8, self.world)
                self.ledger.record("ddp_allreduce", payload_bits=bits, elements=self.num_params, bytes_sent=nbytes)
                self.ledger.end_step()
            step_kinds += self._step_kind()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            window_steps += 1

            last = self.step == t.steps
            if self.step % t.log_every == 0 or last:
                dist.all_reduce(loss_sum)  # monitoring only: one scalar every log_every steps
                elapsed = time.perf_counter() - window_start
                record = {
                    "step": self.step,
                    "loss": loss_sum.item() / self.world,
                    "lr": lr,
                    "tokens_per_s": tokens_per_step * window_steps / max(elapsed, 1e-9),
                    "bits_per_param": self.ledger.average_bits_per_param,
                    "rounds": self.ledger.rounds,
                    "bytes_sent": self.ledger.bytes_sent,
                    "variance_updates": self._variance_updates(),
                    "wall_time": time.perf_counter() - started,
                    "step_kinds": step_kinds,
                }
                window_start, window_steps, step_kinds = time.perf_counter(), 0, ""
                if last and isinstance(self.optimizer, ZeroOneAdam):
                    self.optimizer.synchronize()  # every rank ends on the same parameters
                if (t.val_every and self.step % t.val_every == 0) or last:
                    record["val_loss"] = self.validate()
                self.metrics.log(record)
            if (t.checkpoint_every and self.step % t.checkpoint_every == 0) or last:
                self.wall_offset = time.perf_counter() - started
                self.save()
        if not self.is_main:
            return None
        return {k: record.get(k) for k in ("step", "loss", "val_loss", "tokens_per_s", "bits_per_param", "rounds", "wall_time")} | {
            "run_dir": str(self.run_dir)
        }

    def _step_kind(self) -> str:
        """What the optimizer step just taken did, one character of runs.STEP_KINDS."""
        last = getattr(self.optimizer, "last_step", None)  # torch AdamW (under DDP) has none
        if isinstance(self.optimizer, ZeroOneAdam):
            return VARIANCE if last.variance_updated else ONEBIT if last.synced else LOCAL
        # AdamW, DataParallelAdam and 1-bit Adam's warm-up update the variance from a full-precision average
        return FULL if last is None or last.variance_updated else ONEBIT

    def _variance_updates(self) -> int:
        if isinstance(self.optimizer, ZeroOneAdam):
            return self.optimizer.schedule.variance_updates
        if isinstance(self.optimizer, OneBitAdam):
            return min(self.step, self.optimizer.freeze_step)
        return self.step

    @torch.no_grad()
    def validate(self) -> float:
        """Mean validation loss over `val_batches` micro-batches per rank, averaged over the ranks."""
        t = self.recipe.train
        self.model.eval()
        total, count = torch.zeros((), device=self.device), 0
        for batch in validation_batches(self.val_blocks, t.micro_batch_size, self.rank, self.world, t.seed, t.val_batches):
            with autocast(t.precision, self.device):
                total += self.model(**{k: v.to(self.device) for k, v in batch.items()}).loss.float()
            count += 1
        dist.all_reduce(total)
        return total.item() / (count * self.world)

    # ---- checkpoints --------------------------------------------------------------------------

    def save(self) -> None:
        staged = ckpt.staging_dir(self.checkpoints, self.step)
        if self.is_main:
            shutil.rmtree(staged, ignore_errors=True)
            staged.mkdir(parents=True)
        dist.barrier()
        state = {
            "optimizer": self.optimizer.state_dict(),
            "loader": self.loader.state_dict(),
            "rng": {
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                "numpy": np.random.get_state(),
                "python": random.getstate(),
            },
        }
        if isinstance(self.optimizer, ZeroOneAdam) and self.optimizer.schedule.steps_since_sync:
            state["model"] = self.model.state_dict()  # inside a local-step period each rank's parameters differ
        ckpt.save_file(state, staged / f"rank_{self.rank:05d}.pt")
        if self.is_main:
            ckpt.save_file(self.model.state_dict(), staged / "model.pt")
            trainer_state = {
                "step": self.step,
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(),
                "ledger": self.ledger.state_dict(),
                "wall_time": self.wall_offset,
                "world_size": self.world,
            }
            ckpt.save_file(trainer_state, staged / "trainer.pt")
        dist.barrier()
        if self.is_main:
            ckpt.publish(self.checkpoints, self.step, self.recipe.train.keep_checkpoints, self.world)
        dist.barrier()

    def _resolve_resume(self, resume: str) -> Path | None:
        if resume == "auto":
            found = ckpt.complete_checkpoints(self.checkpoints)
            return found[-1] if found else None
        return Path(resume)

    def _load(self, path: Path | None) -> None:
        if path is None:
            log.info("no complete checkpoint in %s: starting from step 0", self.checkpoints)
            return
        check_resumable(path, self.world)
        self.model.load_state_dict(torch.load(path / "model.pt", map_location=self.device, weights_only=False))
        mine = torch.load(path / f"rank_{self.rank:05d}.pt", map_location=self.device, weights_only=False)
        if "model" in mine:
            self.model.load_state_dict(mine["model"])
        try:
            self.optimizer.load_state_dict(mine["optimizer"])
        except ValueError as e:  # another optimizer, model size or 1-bit layout
            raise UserError(f"cannot resume from {path}: {e}.") from None
        self.loader.load_state_dict(mine["loader"])
        torch.set_rng_state(mine["rng"]["torch"].cpu())
        if mine["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(mine["rng"]["cuda"])
        np.random.set_state(mine["rng"]["numpy"])
        random.setstate(mine["rng"]["python"])
        shared = torch.load(path / "trainer.pt", weights_only=False)
        self.scheduler.load_state_dict(shared["scheduler"])
        self.scaler.load_state_dict(shared["scaler"])
        if self.ddp is not None:
            self.ledger.load_state_dict(shared["ledger"])
        self.step, self.wall_offset = shared["step"], shared["wall_time"]

    def close(self) -> None:
        self.metrics.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def check_resumable(path: Path, world_size: int) -> None:
    """Refuse a missing, incomplete or other-world-size checkpoint with one sentence."""
    if not (path / ckpt.MARKER).is_file():
        raise UserError(f"{path} is not a complete checkpoint (no {ckpt.MARKER} marker).")
    saved = ckpt.read_world_size(path)
    if saved != world_size:
        raise UserError(
            f"checkpoint {path} was written by {saved} ranks and this run has {world_size}; "
            "the optimizer's error buffers are per rank, so resume with the same number of processes."
        )
