"""zoa-train's self-syncing optimizers (0/1 Adam, 1-bit Adam, DiLoCo, DataParallelAdam) in Hugging Face
Trainer and accelerate. docs/integrations.md shows both with complete examples (examples/).

These optimizers do their own data-parallel communication, so the model must not be wrapped in DDP
(DDP would average every gradient in full precision on top of the 1-bit sync). `ZoaTrainer` is a
`transformers.Trainer` that prepares the model with accelerate's `prepare_model(evaluation_mode=True)`
(device placement and mixed-precision autocast, no DDP), logs what the optimizer sent, synchronises
the ranks before every evaluation and checkpoint, and writes each rank's own optimizer state (1-bit
error buffers) beside Trainer's checkpoint, so that `train(resume_from_checkpoint=...)` continues
exactly. With accelerate, prepare the data loaders, optimizer and scheduler, not the model, and use
`save_rank_state` / `load_rank_state` around `save_state` / `load_state`.

Tested with transformers 5.24 and accelerate 1.16. The one place that relies on how Trainer calls
accelerate rather than on a documented hook is `_prepare_without_ddp`; a check at the start of
training refuses a model that ended up in DDP all the same.
"""

import dataclasses
import os

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from zoa_train import config
from zoa_train.errors import UserError
from zoa_train.optim import registry
from zoa_train.optim.base import DataParallelOptimizer
from zoa_train.optim.training import SelfSyncing

RANK_STATE = "zoa_rank_{:05d}.pt"  # each rank's own optimizer state, in the checkpoint folder
OPTIMIZER_STATE = "optimizer.pt"  # Trainer's (transformers.trainer.OPTIMIZER_NAME): the shared state
# Shared knobs that Trainer users set in TrainingArguments, as for any Trainer optimizer.
FROM_TRAINING_ARGUMENTS = {"lr": "learning_rate", "betas": "adam_beta1 and adam_beta2", "eps": "adam_epsilon", "weight_decay": "weight_decay"}


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def optimizer_section(name: str, **knobs):
    """A recipe's optimizer section naming `name` with `knobs` (the registry's defaults for the rest),
    each knob checked as a recipe's is: an unknown one, a wrong type or value refused in one sentence."""
    spec = registry.get(name)
    allowed = [f.name for f in dataclasses.fields(registry.SharedKnobs)] + [f.name for f in dataclasses.fields(spec.knobs)]
    unknown = [key for key in knobs if key not in allowed]
    if unknown:
        raise UserError(f"optimizer {name} has no knob {unknown[0]}; its knobs are {', '.join(allowed)}.")
    origin = f"optimizer {name}"
    section = config.build_section(config.optimizer_section(), {"name": name, **knobs}, origin, "optimizer.")
    registry.check_section(section, origin, [name])
    return section


def build_optimizer(model: torch.nn.Module, name: str, collective=None, **knobs) -> SelfSyncing:
    """The optimizer a recipe's optimizer section names, for `model` on its device over the default
    process group (start it first): the registry's builder (weight decay on matrices only, the knobs'
    defaults). `knobs`: the shared ones (lr, betas, eps, weight_decay, bias_correction,
    allreduce_dtype) and the optimizer's own (e.g. var_freeze_step). `collective`: the 1-bit
    optimizers' collective factory, e.g. `zoa_train.comm.ClusterCollective(overlap=True)` (a recipe's
    comm section; default the flat 1-bit allreduce). Only optimizers that communicate themselves are
    accepted; `.optimizer` of the result is the torch optimizer."""
    section = optimizer_section(name, **knobs)
    built = registry.create(section, model, next(model.parameters()).device, _world()[0], **({"collective": collective} if collective else {}))
    if not isinstance(built, SelfSyncing):
        raise UserError(
            f"optimizer {name} lets DDP average the gradients; train it with transformers.Trainer or accelerate's DDP, not zoa-train's integration."
        )
    return built


def save_rank_state(optimizer: DataParallelOptimizer, directory: str | os.PathLike) -> None:
    """Every rank: write this rank's own optimizer state (its 1-bit error buffers) to `directory`.
    The shared state is what the framework saves from the main process (optimizer.state_dict()).
    Call `optimizer.synchronize()` first: a checkpoint holds one model, so the ranks must agree."""
    if optimizer.parameters_differ:
        raise ValueError("the ranks' parameters differ (pending local steps): call optimizer.synchronize() on every rank before saving")
    world, rank = _world()
    os.makedirs(directory, exist_ok=True)
    torch.save({"world_size": world, "rank": rank, "state": optimizer.rank_state_dict()}, os.path.join(directory, RANK_STATE.format(rank)))


def load_rank_state(optimizer: DataParallelOptimizer, directory: str | os.PathLike) -> None:
    """Every rank, after the framework loaded the main process's optimizer.state_dict() into every
    rank: replace the rank's own part (which that load took from rank 0) by this rank's saved one."""
    world, rank = _world()
    path = os.path.join(directory, RANK_STATE.format(rank))
    if not os.path.isfile(path):
        raise UserError(
            f"cannot resume from {directory}: it holds no {RANK_STATE.format(rank)} (each rank's own optimizer state), so it was "
            f"written by another trainer or on fewer than {world} ranks; resume a checkpoint that ZoaTrainer or save_rank_state wrote."
        )
    saved = torch.load(path, map_location=next(p.device for g in optimizer.param_groups for p in g["params"]), weights_only=True)
    if saved["world_size"] != world:
        raise UserError(
            f"cannot resume from {directory}: it was saved on {saved['world_size']} ranks and this run has {world}; resume it at {saved['world_size']}."
        )
    try:
        optimizer.load_state_dicts(optimizer.shared_state_dict(), saved["state"])
    except ValueError as e:
        raise UserError(f"cannot resume from {directory}: {e}.") from None


def broadcast_buffers(model: torch.nn.Module) -> None:
    """Give every rank rank 0's buffers (e.g. BatchNorm statistics, or any a model initialises per rank),
    as DDP's construction does; the optimizer already started every rank from rank 0's parameters.
    Setup, not training: not in the ledger."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    with torch.no_grad():
        for buffer in model.buffers():
            staged = buffer.contiguous()  # broadcast needs contiguous memory
            dist.broadcast(staged, src=0)
            if staged is not buffer:
                buffer.copy_(staged)


def prepare_accelerate(accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *objects):
    """accelerate's `prepare` for a self-syncing optimizer: the model only placed and given the
    accelerator's autocast (`prepare_model(evaluation_mode=True)`: no DDP), the optimizer and the
    rest (data loaders, scheduler) prepared as usual. Returns (model, optimizer, *objects). Refuses
    fp16 (its loss scaler skips an overflowing step on one rank alone) and DeepSpeed, FSDP and
    Megatron-LM, which wrap or shard the model. Every rank gets rank 0's buffers, as DDP would give."""
    from accelerate.utils import DistributedType

    if accelerator.mixed_precision == "fp16":
        raise UserError("fp16 does not work with a self-syncing optimizer: its loss scaler skips an overflowing step on one rank alone; use bf16 or fp32.")
    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM):
        raise UserError(f"zoa-train's optimizers are data-parallel only, not for {accelerator.distributed_type.value}, which shards or wraps the model.")
    model = accelerator.prepare_model(model, evaluation_mode=True)
    broadcast_buffers(model)
    prepared = accelerator.prepare(optimizer, *objects)
    return (model, *(prepared if objects else (prepared,)))


class ZoaTrainer(Trainer):
    """A `transformers.Trainer` that trains with one of zoa-train's self-syncing optimizers, without DDP.

    Give the optimizer as Trainer takes one, `optimizers=(optimizer, scheduler)` (a zoa_train.optim
    optimizer over the model's parameters, built before or after TrainingArguments starts the process
    group: it is bound to the group here, on the device Trainer put the model on; scheduler None:
    Trainer's from TrainingArguments),
    or by name: `zoa_optimizer="zero_one_adam", zoa_optimizer_kwargs={"var_freeze_step": 100}` (a
    recipe's optimizer name and knobs, the registry's defaults for the rest; lr, betas, eps and
    weight decay come from TrainingArguments). Everything else is Trainer's own arguments.

    What it changes: the model is not wrapped in DDP; `bits_per_param` (average per step so far),
    `window_bits_per_param` (since the previous log), `rounds`, `bytes_sent` and `variance_updates`
    join every training log; the ranks are synchronised (0/1 Adam's pending local steps ended)
    before every evaluation, checkpoint and the end of training; every rank writes its own
    optimizer state into each checkpoint. `average_tokens_across_devices` is turned off: it would be
    a collective at every step, which 0/1 Adam's local steps must not have (each rank's loss is then
    the mean over its own tokens, averaged over the ranks by the optimizer as DDP averages gradients).

    Refused in one sentence: fp16 (its loss scaler skips an overflowing step on one rank alone,
    putting the ranks out of step; use bf16), DeepSpeed and FSDP (they shard or wrap the model),
    several GPUs in one process (nn.DataParallel; start one process per GPU with torchrun).
    """

    def __init__(self, *args, zoa_optimizer: str | None = None, zoa_optimizer_kwargs: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if self.optimizer is not None and zoa_optimizer is not None:
            raise UserError("ZoaTrainer takes its optimizer either through optimizers=(optimizer, scheduler) or by zoa_optimizer's name, not both.")
        if self.optimizer is None and zoa_optimizer is None:
            raise UserError('ZoaTrainer needs a zoa-train optimizer: pass zoa_optimizer="zero_one_adam" (or another name) or optimizers=(optimizer, None).')
        if self.optimizer is not None and not isinstance(self.optimizer, DataParallelOptimizer):
            raise UserError(
                f"ZoaTrainer trains with zoa-train's self-syncing optimizers, not {type(self.optimizer).__name__}, which needs DDP; use transformers.Trainer for it."
            )
        if _world()[0] != self.args.world_size:
            raise UserError(
                f"torch.distributed has {_world()[0]} ranks and Trainer sees {self.args.world_size}; on a machine without GPUs pass "
                "TrainingArguments(use_cpu=True), which makes accelerate take torchrun's ranks."
            )
        if self.optimizer is not None:
            try:
                self.optimizer.bind()  # built before TrainingArguments started the process group: joins it now
            except ValueError as e:
                raise UserError(f"{e}.") from None
            if self.optimizer.world_size != self.args.world_size:
                raise UserError(
                    f"the optimizer was built over a process group of {self.optimizer.world_size} rank(s) and Trainer runs on "
                    f"{self.args.world_size}: build it over the default group (process_group=None)."
                )
        given = [key for key in FROM_TRAINING_ARGUMENTS if key in (zoa_optimizer_kwargs or {})]
        if given:
            raise UserError(f"set {given[0]} through TrainingArguments ({FROM_TRAINING_ARGUMENTS[given[0]]}), not zoa_optimizer_kwargs.")
        if self.args.fp16 or self.accelerator.mixed_precision == "fp16":
            raise UserError(
                "ZoaTrainer does not support fp16: its loss scaler skips an overflowing step on one rank alone, which puts the ranks "
                "of a self-syncing optimizer out of step; use bf16=True or fp32."
            )
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise UserError("ZoaTrainer is data-parallel only: DeepSpeed and FSDP shard or wrap the model, which zoa-train's optimizers do not support.")
        if self.args.n_gpu > 1:
            raise UserError(
                f"ZoaTrainer runs one process per GPU and this process sees {self.args.n_gpu}; start it with torchrun --nproc_per_node {self.args.n_gpu}."
            )
        self.args.average_tokens_across_devices = False
        # Trainer clips after backward and runs micro-batches without the optimizer's no_sync(): a round
        # started during backward would use gradients that still change, so those runs start them in step().
        self._keeps_rounds_in_step = (
            "max_grad_norm" if self.args.max_grad_norm else "gradient_accumulation_steps" if self.args.gradient_accumulation_steps > 1 else None
        )
        self.zoa_name, self.zoa_kwargs = zoa_optimizer, dict(zoa_optimizer_kwargs or {})
        if zoa_optimizer is not None:
            optimizer_section(zoa_optimizer, **self.zoa_kwargs)  # refuse a bad knob now, not when train() starts
        self.zoa: SelfSyncing | None = SelfSyncing(self.model, self.optimizer, type(self.optimizer).__name__) if self.optimizer is not None else None
        self._resume_from: str | None = None
        self._logged = (0, 0)  # the ledger's (steps, payload bits) at the previous training log
        self.add_callback(_ZoaCallback(self))

    # ---- the optimizer, and the model without DDP ----------------------------------------------

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        """The zoa optimizer by name (unless one was given), then the model prepared without DDP."""
        if self.optimizer is None:
            a = self.args
            shared = dict(lr=a.learning_rate, betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_epsilon, weight_decay=a.weight_decay)
            self.zoa = build_optimizer(self.model if model is None else model, self.zoa_name, **shared, **self.zoa_kwargs)
            self.optimizer = self.zoa.optimizer
        self._prepare_without_ddp()
        return self.optimizer

    def _prepare_without_ddp(self) -> None:
        """accelerate's documented `prepare_model(evaluation_mode=True)` places the model and applies
        mixed-precision autocast without DDP, and marks it prepared; Trainer's `accelerator.prepare(model,
        optimizer)`, which comes right after `create_optimizer` (transformers 5.x), then leaves it as it
        is instead of wrapping it in DDP. Every rank gets rank 0's buffers, as DDP's construction gives
        (a resumed run then loads the checkpoint's on every rank)."""
        self.accelerator.prepare_model(self.model, evaluation_mode=True)
        broadcast_buffers(self.model)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """Trainer's `train`; a resumed run also restores every rank's own optimizer state."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        self._resume_from = resume_from_checkpoint or None
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _begin_training(self) -> None:
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(self.model_wrapped, DistributedDataParallel):
            raise RuntimeError(
                "Trainer wrapped the model in DDP despite ZoaTrainer (this transformers version prepares models differently from 5.x); "
                "DDP would average the gradients on top of the optimizer's own sync."
            )
        if self._keeps_rounds_in_step:
            self.zoa.optimizer.keep_rounds_in_step(f"Trainer's {self._keeps_rounds_in_step}")
        if self._resume_from is not None and os.path.isfile(os.path.join(self._resume_from, OPTIMIZER_STATE)):
            load_rank_state(self.zoa.optimizer, self._resume_from)
        self._logged = (self.zoa.ledger.steps, self.zoa.ledger.payload_bits)

    # ---- synchronised evaluation, per-rank checkpoints, logged communication -------------------

    def evaluate(self, *args, **kwargs):
        """Trainer's `evaluate` on the ranks' common model (pending local steps ended first)."""
        if self.zoa is not None:
            self.zoa.synchronize()
        return super().evaluate(*args, **kwargs)

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        """Trainer's `log`, with what the optimizer sent joined to the training logs (the step logs and
        the summary at the end), as zoa-train's own trainer records it (zoa_train.comm.CommLedger)."""
        if self.zoa is not None and ("loss" in logs or "train_loss" in logs):
            ledger = self.zoa.ledger
            sent = {"bits_per_param": ledger.average_bits_per_param, "rounds": ledger.rounds, "bytes_sent": ledger.bytes_sent}
            if "loss" in logs:  # a step log: also the bits of the steps since the previous one
                steps, bits = ledger.steps - self._logged[0], ledger.payload_bits - self._logged[1]
                sent["window_bits_per_param"] = bits / (ledger.num_params * steps) if steps else 0.0
                self._logged = (ledger.steps, ledger.payload_bits)
            logs = {**logs, **sent, "variance_updates": self.zoa.variance_updates}
        super().log(logs, *args, **kwargs)


class _ZoaCallback(TrainerCallback):
    """ZoaTrainer's hooks into Trainer's loop: the run's start, each step's end and each checkpoint."""

    def __init__(self, trainer: ZoaTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._begin_training()

    def on_step_end(self, args, state, control, **kwargs):
        # DefaultFlowCallback, which runs before this one, has decided whether this step saves or ends
        # the run; the decision is the same on every rank, so each joins the sync.
        if control.should_save or control.should_training_stop:
            self.trainer.zoa.synchronize()

    on_epoch_end = on_step_end

    def on_save(self, args, state, control, **kwargs):
        if not args.save_only_model:
            folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            save_rank_state(self.trainer.zoa.optimizer, folder)
