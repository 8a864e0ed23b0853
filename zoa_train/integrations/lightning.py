"""zoa-train's self-syncing optimizers (0/1 Adam, 1-bit Adam, DiLoCo, DataParallelAdam) in PyTorch Lightning.

These optimizers do their own data-parallel communication, so the model must not be wrapped in DDP
(DDP would average every gradient in full precision on top of the 1-bit sync). `SelfSyncingStrategy`
is Lightning's `DDPStrategy` without the wrapper: the process group, device placement, distributed
sampler and launchers are DDPStrategy's own; `configure_ddp` leaves the module as it is. Return a
zoa optimizer from `configure_optimizers` (e.g. `ZeroOneAdam(self.parameters(), ...)`) and train:

    trainer = Trainer(strategy=SelfSyncingStrategy(), accelerator="cpu", devices=2, ...)

What it adds: the ranks are synchronised (0/1 Adam's pending local steps ended) before every
validation, every checkpoint and at the end of training; every checkpoint carries every rank's own
optimizer state (the 1-bit error buffers), gathered to rank 0, so `trainer.fit(ckpt_path=...)`
continues exactly; `CommMetrics` (added to the trainer unless given) logs what the optimizer sent.

Tested with Lightning 2.6.6 (the `lightning` package; `pytorch_lightning` is the same code under
another name and is not supported here).
"""

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy

from zoa_train.errors import UserError
from zoa_train.optim.base import DataParallelOptimizer
from zoa_train.optim.training import SelfSyncing

RANK_STATES = "zoa_rank_states"  # key, in each optimizer's checkpointed state, of every rank's own state (rank order)
# DDPStrategy arguments that configure the DDP wrapper, which this strategy does not build.
DDP_ONLY = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")


def _unwrap(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _to_cpu(state: Any) -> Any:
    """`state` with every tensor on the CPU: gathered objects are unpickled on rank 0, where another
    rank's CUDA device would not be the right one."""
    if isinstance(state, torch.Tensor):
        return state.detach().cpu()
    if isinstance(state, Mapping):
        return {k: _to_cpu(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_to_cpu(v) for v in state)
    return state


class SelfSyncingStrategy(DDPStrategy):
    """Lightning's DDPStrategy for zoa-train's self-syncing optimizers: the model is not wrapped in DDP.

    Takes DDPStrategy's arguments (accelerator, parallel_devices, cluster_environment, checkpoint_io,
    precision_plugin, process_group_backend, timeout, start_method) except those of the DDP wrapper
    (comm hooks, model averaging, DDP's own keyword arguments), which are refused.

    Refused in one sentence (a UserError) when training starts: an optimizer that is not one of
    zoa-train's self-syncing ones (it would need DDP to average the gradients), a precision other
    than 32-true and bf16-mixed (16-mixed's loss scaler skips an overflowing step on one rank alone,
    putting the ranks out of step; the -true half precisions and 64-true change the parameters' dtype,
    and the optimizers keep fp32 master weights), and sync_batchnorm (a full-precision allreduce in
    every forward; the optimizers average BatchNorm statistics at every sync instead).
    Gradient accumulation (accumulate_grad_batches) works as with DDP: the optimizer averages the
    accumulated gradients at its step. Gradient clipping uses each rank's own gradient norm, as
    zoa-train's trainer does (a global norm would cost a full-precision allreduce every step).
    """

    strategy_name = "zoa_self_syncing"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        given = [key for key in DDP_ONLY if kwargs.get(key) is not None]
        wrapper_kwargs = [key for key in kwargs if key not in DDP_ONLY and key not in _STRATEGY_ARGUMENTS]
        if given or wrapper_kwargs:
            raise UserError(
                f"SelfSyncingStrategy does not wrap the model in DDP, so it takes no {(given or wrapper_kwargs)[0]}; "
                "the optimizer does the data-parallel communication itself."
            )
        super().__init__(*args, **kwargs)
        self._zoa: list[SelfSyncing] = []

    # ---- refusals, and the model without DDP ----------------------------------------------------

    def setup_environment(self) -> None:
        """Refuse what cannot work before any process group starts, then DDPStrategy's setup."""
        self._check_precision()
        if self._layer_sync is not None:
            raise UserError(
                "SelfSyncingStrategy does not support sync_batchnorm=True (a full-precision allreduce in every forward); "
                "zoa-train's optimizers average BatchNorm statistics at every sync instead."
            )
        super().setup_environment()

    def _check_precision(self) -> None:
        plugin = self.precision_plugin
        if type(plugin) is Precision or (type(plugin) is MixedPrecision and plugin.precision == "bf16-mixed"):
            return
        precision = getattr(plugin, "precision", type(plugin).__name__)
        if precision == "16-mixed":
            raise UserError(
                "SelfSyncingStrategy does not support precision 16-mixed: its loss scaler skips an overflowing step on one "
                'rank alone, which puts the ranks of a self-syncing optimizer out of step; use precision="bf16-mixed" or 32-true.'
            )
        raise UserError(
            f"SelfSyncingStrategy trains in precision 32-true or bf16-mixed, not {precision}: zoa-train's optimizers keep fp32 master "
            'weights and do their own communication; use precision="bf16-mixed" for lower-precision compute.'
        )

    def configure_ddp(self) -> None:
        """DDPStrategy.setup calls this after moving the model to its device and before building the
        optimizers: here the model stays as it is, since the optimizer does the communication. What
        DDP's construction would do is kept: every rank starts from rank 0's parameters and buffers."""
        if self.world_size > 1:
            _sync_module_states(self.model)

    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        """Lightning's optimizers from configure_optimizers, each checked to be self-syncing over this world."""
        super().setup_optimizers(trainer)
        self._zoa = []
        for optimizer in map(_unwrap, self.optimizers):
            if not isinstance(optimizer, DataParallelOptimizer):
                raise UserError(
                    f"SelfSyncingStrategy trains with zoa-train's self-syncing optimizers (ZeroOneAdam, OneBitAdam, DiLoCo, DataParallelAdam), "
                    f'not {type(optimizer).__name__}, which needs DDP to average the gradients; use strategy="ddp" for it.'
                )
            try:
                optimizer.bind()  # built before the strategy started the process group: joins it now
            except ValueError as e:
                raise UserError(f"{e}.") from None
            if optimizer.world_size != self.world_size:
                raise UserError(
                    f"{type(optimizer).__name__} was built over a process group of {optimizer.world_size} rank(s) and the trainer runs on "
                    f"{self.world_size}: build it over the default process group (process_group=None)."
                )
            # Lightning clips after backward and accumulates without the optimizer's no_sync(): rounds
            # started during backward would use gradients that still change, so those start in step().
            if trainer.gradient_clip_val:
                optimizer.keep_rounds_in_step("Lightning's gradient_clip_val")
            elif trainer.accumulate_grad_batches > 1:
                optimizer.keep_rounds_in_step("Lightning's accumulate_grad_batches")
            # SelfSyncing refuses sparse gradients and averages BatchNorm statistics at every sync.
            self._zoa.append(SelfSyncing(self.lightning_module, optimizer, type(optimizer).__name__))
        if not any(isinstance(c, CommMetrics) for c in trainer.callbacks):
            trainer.callbacks.append(CommMetrics())

    @property
    def zoa_optimizers(self) -> list[DataParallelOptimizer]:
        """The zoa optimizers being trained (after setup)."""
        return [z.optimizer for z in self._zoa]

    # ---- one model at validation, checkpoints and the end ----------------------------------------

    def synchronize(self) -> None:
        """Make every rank's model identical now (every rank must call it): pending local steps end."""
        for zoa in self._zoa:
            zoa.synchronize()

    def on_validation_start(self) -> None:
        """Validate the ranks' common model."""
        self.synchronize()
        super().on_validation_start()

    def on_train_end(self) -> None:
        """Every rank ends on the same model."""
        self.synchronize()
        super().on_train_end()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state for a checkpoint, taken on every rank before the optimizers' state (Lightning's
        dump_checkpoint): the ranks are synchronised first, so a checkpoint holds one model."""
        self.synchronize()
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """A zoa optimizer's checkpointed state: the shared state and every rank's own (gathered to rank 0,
        which alone writes the checkpoint). Every rank must call it, as Lightning's save_checkpoint does."""
        optimizer = _unwrap(optimizer)
        if not isinstance(optimizer, DataParallelOptimizer):
            return super().optimizer_state(optimizer)
        if optimizer.parameters_differ:
            raise RuntimeError("the ranks' parameters differ (pending local steps): synchronize() before taking the optimizer's state")
        mine = _to_cpu(optimizer.rank_state_dict())
        gathered: list | None = [None] * self.world_size if self.is_global_zero else None
        if self.world_size > 1:
            dist.gather_object(mine, gathered, dst=0)
        else:
            gathered = [mine]
        if not self.is_global_zero:
            return {}
        return {**optimizer.shared_state_dict(), RANK_STATES: gathered}

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Every rank restores the shared state and its own saved state."""
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            inner = _unwrap(optimizer)
            if isinstance(inner, DataParallelOptimizer):
                ranks = state.get(RANK_STATES)
                if ranks is None:
                    raise UserError(
                        "cannot resume this checkpoint: it holds no per-rank optimizer state (1-bit error buffers), so it was not "
                        "written with SelfSyncingStrategy; resume one that was."
                    )
                if len(ranks) != self.world_size:
                    raise UserError(
                        f"cannot resume this checkpoint: it was saved on {len(ranks)} ranks and this run has {self.world_size}; resume it at {len(ranks)}."
                    )
                try:
                    inner.load_state_dicts(state, ranks[self.global_rank])
                except ValueError as e:
                    raise UserError(f"cannot resume this checkpoint: {e}.") from None
            else:
                optimizer.load_state_dict(state)
        _optimizers_to_device(self.optimizers, self.root_device)


# The keyword arguments DDPStrategy passes to its base classes, as opposed to DDP's own (**kwargs).
_STRATEGY_ARGUMENTS = (
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "checkpoint_io",
    "precision_plugin",
    "process_group_backend",
    "timeout",
    "start_method",
)


class CommMetrics(Callback):
    """Logs what each zoa optimizer sent after every optimizer step, through `LightningModule.log` (so
    every Lightning logger gets it): `bits_per_param` (average per step so far, zoa-train's counting:
    docs/algorithm.md), `total_bits_per_param` (all bits sent so far per parameter: the difference of
    two logs over their steps is that window's average), `rounds` (steps that communicated),
    `bytes_sent` (by this rank) and `variance_updates`. With several optimizers each name ends in
    `_<index>`. SelfSyncingStrategy adds one unless the trainer has one."""

    def __init__(self, prog_bar: bool = False):
        self.prog_bar = prog_bar
        self._steps: list[int] = []

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int) -> None:
        optimizers = [o for o in map(_unwrap, trainer.optimizers) if isinstance(o, DataParallelOptimizer)]
        steps = [o.step_count for o in optimizers]
        if steps == self._steps:  # no optimizer stepped (gradient accumulation)
            return
        self._steps = steps
        for index, optimizer in enumerate(optimizers):
            suffix = f"_{index}" if len(optimizers) > 1 else ""
            ledger = optimizer.ledger
            values = {
                "bits_per_param": ledger.average_bits_per_param,
                "total_bits_per_param": ledger.payload_bits / ledger.num_params,
                "rounds": float(ledger.rounds),
                "bytes_sent": float(ledger.bytes_sent),
                "variance_updates": float(optimizer.variance_updates),
            }
            for name, value in values.items():
                # Every rank holds the same ledger figures: no reduction (a collective inside local steps).
                pl_module.log(
                    name + suffix, value, on_step=True, on_epoch=False, sync_dist=False, batch_size=1, prog_bar=self.prog_bar and name == "bits_per_param"
                )
