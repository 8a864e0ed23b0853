"""What a training loop needs of an optimizer, declared once, and the two ways of meeting it.

`TrainingOptimizer` is the interface the trainer (and any loop that trains data-parallel) uses,
without knowing which optimizer it drives. Two wrappers implement it:
  DDPBacked    the model wrapped in DDP (bucketed allreduce overlapped with backward) with a torch
               optimizer on top; `adam` is this with AdamW (or without bias correction the same
               math as the 1-bit optimizers), the baseline users would run; it records DDP's traffic,
               or a DDPCommHook records its own (`powersgd`: torch's PowerSGD hook, Adam on top)
  SelfSyncing  an optimizer that communicates itself (`onebit_adam`, `zero_one_adam`, `diloco`):
               the model is not wrapped in DDP
The registry (zoa_train/optim/registry.py) builds one of them for each optimizer name.

Unsupported with the 1-bit optimizers, refused by SelfSyncing in one sentence (a UserError) rather
than silently mis-trained: a module that makes sparse gradients (nn.Embedding/EmbeddingBag with
sparse=True: refused when the optimizer is built; a sparse gradient met at a step: refused then), and
a change of the trainable set after the optimizer is built (a parameter frozen or unfrozen through
requires_grad: checked at every step). Their flat state and 1-bit error buffers are laid out once, at
construction, over the parameters that required gradients then; a parameter unfrozen later would
never be updated, one frozen later would keep moving with its momentum. Parameters frozen before
the build are fine: they are left out of the optimizer and never communicated.

BatchNorm: without DDP each rank's running statistics follow its own batches, so SelfSyncing has
the optimizer average them at every sync and in `average_statistics()` (before validation and
checkpoints). Under DDP they keep DDP's behaviour (rank 0's buffers broadcast at each forward).
"""

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from zoa_train.comm import CommLedger, ring_allreduce_bytes
from zoa_train.comm.sharding import count_fsdp_traffic, local_shard, shard_model, shard_numel
from zoa_train.comm.topology import NodeGroups
from zoa_train.errors import UserError
from zoa_train.optim.base import DataParallelOptimizer
from zoa_train.step_kinds import FULL


class TrainingOptimizer(Protocol):
    """An optimizer as a data-parallel training loop drives it, whoever communicates."""

    module: torch.nn.Module  # what the forward pass runs: the model, or DDP around it
    optimizer: torch.optim.Optimizer  # its param_groups carry the lr an lr scheduler sets
    ledger: CommLedger  # what was sent, step by step

    def no_sync(self) -> AbstractContextManager:
        """A context for the backward passes of all micro-batches but the last (gradient accumulation)."""

    def step(self) -> str:
        """One optimizer step on the gradients of this rank; returns its kind (zoa_train.step_kinds)."""

    def zero_grad(self) -> None:
        """Drop the gradients (set to None), after a step or a skipped one."""

    @property
    def lr(self) -> float:
        """The learning rate the next step takes (as the lr scheduler set it)."""

    def keep_rounds_in_step(self, reason: str) -> None:
        """Start no round during backward: `reason` (clipping, loss scaling, ...) changes the gradients after it."""

    def clip_by_bucket(self, max_norm: float | None) -> None:
        """Clip each bucket's gradients as soon as they are final (train.grad_clip_rule bucket); only the
        optimizers that sync themselves can (DDP and HSDP reduce the raw gradients themselves)."""

    @property
    def variance_updates(self) -> int:
        """Steps so far that updated Adam's second moment."""

    @property
    def parameters_differ(self) -> bool:
        """Whether the ranks' parameters differ now (0/1 Adam inside a local-step period)."""

    @property
    def max_steps_apart(self) -> int:
        """The most steps one rank can be ahead of another (what an agreed stop step must allow for)."""

    def next_step_communicates(self) -> bool:
        """Whether the coming step() communicates (a small collective may then ride on it)."""

    def wait_for_rounds(self) -> None:
        """Wait for a round still running behind the step (0/1 Adam's delayed sync), without applying it,
        so that the ledger counts it: before the final totals are read. Changes nothing in training."""

    def synchronize(self) -> None:
        """Make parameters and statistics identical on every rank now, ending any local steps."""

    def average_statistics(self) -> None:
        """Average buffers such as BatchNorm's running statistics; never changes training."""

    def shared_state_dict(self) -> dict:
        """The state that is the same on every rank: saved once."""

    def rank_state_dict(self) -> dict:
        """This rank's own state (error buffers, local-step state): saved by every rank."""

    def load_state_dicts(self, shared: dict, rank: dict) -> None:
        """Restore both parts saved at the same world size; ValueError for another optimizer's state."""

    def load_resharded(self, shared: dict, load_parameters: Callable[[dict], None] | None = None) -> None:
        """Continue a shared state saved at another world size or sharding (--reshard); `load_parameters`,
        where the checkpoint has one, fills the optimizer's state per parameter (a sharded run's)."""

    def resharded_state(self) -> str:
        """What load_resharded keeps and what starts afresh, in words (the reshard's warning)."""


class DDPCommHook(Protocol):
    """A DDP communication hook that counts what it sends and keeps state (PowerSGD's): DDPBacked
    registers it instead of its own, and saves and restores its state beside the optimizer's."""

    def register(self, module: torch.nn.Module, ledger: CommLedger) -> None:
        """Register on `module` (the DDP wrapper); record each bucket's collectives in `ledger`."""

    def step_kind(self) -> str:
        """What the step whose buckets just ran did (zoa_train.step_kinds)."""

    def shared_state_dict(self) -> dict:
        """Its state that is the same on every rank."""

    def rank_state_dict(self) -> dict:
        """This rank's own state (error feedback)."""

    def load_state_dicts(self, shared: dict, rank: dict) -> None:
        """Restore both parts, saved at the same world size."""

    def load_resharded(self, shared: dict) -> None:
        """Continue from the shared part saved at another world size; the per-rank part starts afresh."""


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices and convolution kernels only: biases and norm weights (1-D) keep weight decay 0."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def batchnorm_statistics(model: torch.nn.Module) -> list[torch.Tensor]:
    """The running mean and variance of every BatchNorm layer."""
    found = []
    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._NormBase) and module.track_running_stats:
            found += [module.running_mean, module.running_var]
    return [t for t in found if t is not None]


class _HoldsTorchOptimizer:
    """What both wrappers give the loop from the torch optimizer they hold."""

    optimizer: torch.optim.Optimizer

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def wait_for_rounds(self) -> None:
        """Nothing runs behind a step but a self-syncing optimizer's delayed rounds."""

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def clip_by_bucket(self, max_norm: float | None) -> None:
        if max_norm is not None:  # a recipe is refused at load (its spec does not sync itself)
            raise TypeError(f"{self.name} reduces its gradients with DDP or FSDP2, which clip_by_bucket cannot reach")


class DDPBacked(_HoldsTorchOptimizer):
    """An optimizer on top of DDP, which averages the gradients (bucketed allreduce overlapped with
    backward, gradients as bucket views, buffers broadcast only when the model has BatchNorm
    statistics; fp16/bf16 on the wire with `allreduce_dtype`). `make_optimizer(param_groups)` builds
    the torch optimizer once the model is wrapped; `name` is the recipe's, kept in the state so that
    another optimizer's checkpoint is refused. `adam` is this with AdamW (registry.py)."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        world_size: int,
        make_optimizer: Callable[[list[dict]], torch.optim.Optimizer],
        *,
        name: str,
        weight_decay: float = 0.0,
        allreduce_dtype: torch.dtype | None = None,
        second_moment: bool = True,
        comm_hook: "DDPCommHook | None" = None,
    ):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel

        self.module = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            gradient_as_bucket_view=True,
            broadcast_buffers=bool(batchnorm_statistics(model)),
        )
        self.comm_dtype = allreduce_dtype
        self.num_params = sum(p.numel() for p in model.parameters())
        self.ledger = CommLedger(num_params=self.num_params)
        self.comm_hook = comm_hook
        if comm_hook is not None:
            comm_hook.register(self.module, self.ledger)
        else:
            hook = {torch.float16: default_hooks.fp16_compress_hook, torch.bfloat16: default_hooks.bf16_compress_hook}.get(self.comm_dtype)
            if hook:
                self.module.register_comm_hook(None, hook)
        self.optimizer = make_optimizer(parameter_groups(model, weight_decay))
        self.name = name
        self.second_moment = second_moment
        self.world_size = world_size
        self.steps = 0

    def no_sync(self):
        return self.module.no_sync()

    def zero_grad(self) -> None:
        """Drop the gradients, and after the first synchronised backward lay DDP's buckets out in the
        order its gradients came (DDP's one rebuild: two broadcasts over the world) now, at the end of a
        step on every rank, rather than at the next forward, where under gradient accumulation it would
        cross between nodes inside a step's first micro-batch (docs/algorithm.md, "Gradient accumulation")."""
        super().zero_grad()
        self.module.reducer._rebuild_buckets()  # DDP's own entry point (its Join hook calls it); False, sending nothing, once done

    def keep_rounds_in_step(self, reason: str) -> None:
        """DDP's allreduce of the raw gradients during backward is what clipping and loss scaling expect."""

    def step(self) -> str:
        self.optimizer.step()
        kind = FULL
        if self.comm_hook is not None:  # it recorded each bucket's collectives as backward ran them
            kind = self.comm_hook.step_kind()
        else:  # DDP averaged the gradients during backward (bucketed ring allreduce): count it here
            bits = 32 if self.comm_dtype is None else 16
            nbytes = ring_allreduce_bytes(self.num_params, bits // 8, self.world_size)
            self.ledger.record("ddp_allreduce", payload_bits=bits, elements=self.num_params, bytes_sent=nbytes)
        self.ledger.end_step()
        self.steps += 1
        return kind

    @property
    def variance_updates(self) -> int:
        return self.steps if self.second_moment else 0

    parameters_differ = False
    max_steps_apart = 1  # DDP's allreduce in every backward keeps the ranks in step

    def next_step_communicates(self) -> bool:
        return True  # DDP allreduces every step's gradients

    def synchronize(self) -> None:
        """Parameters are identical after every step; nothing to do."""

    def average_statistics(self) -> None:
        """DDP's buffers stay as DDP keeps them."""

    # The optimizer's state is the same on every rank: saved once; a comm hook may keep some per rank.
    def shared_state_dict(self) -> dict:
        state = {"ddp_optimizer": self.name, "state": self.optimizer.state_dict(), "ledger": self.ledger.state_dict(), "steps": self.steps}
        if self.comm_hook is not None:
            state["comm_hook"] = self.comm_hook.shared_state_dict()
        return state

    def rank_state_dict(self) -> dict:
        return {"comm_hook": self.comm_hook.rank_state_dict()} if self.comm_hook is not None else {}

    def load_state_dicts(self, shared: dict, rank: dict) -> None:
        self._load_shared(shared)
        if self.comm_hook is not None:
            self.comm_hook.load_state_dicts(shared["comm_hook"], rank["comm_hook"])

    def _load_shared(self, shared: dict) -> None:
        if "adamw" in shared and self.name == "adam":  # written before optimizers had a registry
            shared = {"ddp_optimizer": "adam", "state": shared["adamw"], **shared}
        if shared.get("ddp_optimizer") != self.name:
            raise ValueError(f"the checkpoint holds another optimizer's state, not {self.name}'s (DDP with {type(self.optimizer).__name__})")
        self.optimizer.load_state_dict(shared["state"])
        self.ledger.load_state_dict(shared["ledger"])
        self.steps = shared["steps"]

    def load_resharded(self, shared: dict, load_parameters: Callable[[dict], None] | None = None) -> None:
        """A checkpoint of another world size: the optimizer's state is the same on every rank; a comm
        hook keeps its shared part and starts its per-rank part afresh. (`load_parameters` is for
        sharded states, which DDP's never are.)"""
        self._load_shared(shared)
        if self.comm_hook is not None:
            self.comm_hook.load_resharded(shared["comm_hook"])

    def resharded_state(self) -> str:
        return "parameters and the optimizer's state carry over" + ("; the comm hook's error feedback starts afresh" if self.comm_hook is not None else "")


class HSDPBacked(_HoldsTorchOptimizer):
    """A torch optimizer on torch's HSDP: the model sharded by FSDP2 over each node's ranks and
    replicated across nodes (the 2-D mesh of `sharding`), so gradients are reduce-scattered inside the
    node and their shards all-reduced across nodes in full precision (`allreduce_dtype`, FSDP2's reduce
    dtype, as DDP's comm hook sends Adam's), at the end of the last micro-batch's backward. `adam` with comm.shard node: the baseline of the sharded 1-bit optimizers.
    The ledger counts this rank's shard: the all-reduce between nodes, and FSDP2's collectives
    inside the node (link "intra")."""

    parameters_differ = False
    max_steps_apart = 1

    def __init__(
        self,
        model: torch.nn.Module,
        sharding: NodeGroups,
        make_optimizer: Callable[[list[dict]], torch.optim.Optimizer],
        *,
        name: str,
        weight_decay: float = 0.0,
        allreduce_dtype: torch.dtype | None = None,
    ):
        self.module = shard_model(model, sharding.mesh, allreduce_dtype)
        self.optimizer = make_optimizer(parameter_groups(model, weight_decay))
        self.shard = shard_numel(model)
        self.ledger = CommLedger(num_params=self.shard)
        count_fsdp_traffic(model, self.ledger, sharding.ranks_per_node, allreduce_dtype)
        self.nodes, self.name, self.steps = sharding.nodes, name, 0
        self.wire_bytes = (allreduce_dtype or torch.float32).itemsize

    @contextlib.contextmanager
    def no_sync(self):
        """All but the last micro-batch: reduce-scattered inside the node only; FSDP2 adds their sums
        to the last one's before its all-reduce across nodes, once per step."""
        self.module.set_requires_all_reduce(False)
        try:
            yield
        finally:
            self.module.set_requires_all_reduce(True)

    def keep_rounds_in_step(self, reason: str) -> None:
        """FSDP2 reduces the raw gradients during backward, as clipping and loss scaling expect."""

    def step(self) -> str:
        self.optimizer.step()
        self.ledger.record(
            "hsdp_allreduce", payload_bits=8 * self.wire_bytes, elements=self.shard, bytes_sent=ring_allreduce_bytes(self.shard, self.wire_bytes, self.nodes)
        )
        self.ledger.end_step()
        self.steps += 1
        return FULL

    @property
    def variance_updates(self) -> int:
        return self.steps

    def next_step_communicates(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Parameters are identical across nodes after every step; nothing to do."""

    def average_statistics(self) -> None:
        """Buffers stay each rank's own, as FSDP2 keeps them."""

    # Sharded: each rank's optimizer state is its shard's (checkpoints of sharded runs are per rank).
    def shared_state_dict(self) -> dict:
        return {"ddp_optimizer": self.name, "ledger": self.ledger.state_dict(), "steps": self.steps}

    def rank_state_dict(self) -> dict:
        """The torch optimizer's state with this rank's shards as plain tensors (a checkpoint holds no DTensor)."""
        state = self.optimizer.state_dict()
        return {"state": {**state, "state": {i: {k: local_shard(v) for k, v in s.items()} for i, s in state["state"].items()}}}

    def load_state_dicts(self, shared: dict, rank: dict) -> None:
        if shared.get("ddp_optimizer") != self.name:
            raise ValueError(f"the checkpoint holds another optimizer's state, not {self.name}'s (HSDP with {type(self.optimizer).__name__})")
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        saved = rank["state"]
        state = {}  # the shards back into DTensors shaped as their parameters
        for i, entries in saved["state"].items():
            p = params[int(i)]
            state[i] = {
                k: DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()) if v.shape == local_shard(p).shape and v.dim() else v
                for k, v in entries.items()
            }
        self.optimizer.load_state_dict({**saved, "state": state})
        self.ledger.load_state_dict(shared["ledger"])
        self.steps = shared["steps"]

    def load_resharded(self, shared: dict, load_parameters: Callable[[dict], None] | None = None) -> None:
        raise UserError(f"{self.name} sharded inside the node (HSDP) resumes at the layout it was saved at; resume it there, without --reshard.")

    def resharded_state(self) -> str:
        return "none: HSDP does not reshard"


class SelfSyncing(_HoldsTorchOptimizer):
    """An optimizer that does its own data-parallel communication (a DataParallelOptimizer), driving
    the model itself: no DDP wrapper. `name` is how its messages call it (the recipe's name)."""

    def __init__(self, model: torch.nn.Module, optimizer: DataParallelOptimizer, name: str = "this optimizer"):
        self.module = model
        self.optimizer = optimizer
        self.ledger = optimizer.ledger
        self.name = name
        sparse = [n for n, m in model.named_modules() if getattr(m, "sparse", False) is True]
        if sparse:
            raise UserError(
                f"{name} cannot train {sparse[0]}: it makes sparse gradients (sparse=True), which the 1-bit optimizers do not "
                "support (their state and error buffers are dense); build it with sparse=False or use optimizer.name adam."
            )
        if optimizer.shard_group is not None:  # sharded inside the node: FSDP2's collectives there are counted too
            count_fsdp_traffic(model, optimizer.ledger, dist.get_world_size(optimizer.shard_group), optimizer.allreduce_dtype)
        self._named = list(model.named_parameters())
        self._trainable = [p.requires_grad for _, p in self._named]  # the set the optimizer's state was laid out for
        optimizer.average_at_sync(batchnorm_statistics(model))

    def no_sync(self):
        return self.optimizer.no_sync()

    def _check_parameters(self) -> None:
        """Refuse a trainable set that changed since the build, or a sparse gradient (a loop over the
        parameter list: negligible next to a step)."""
        for (n, p), trainable in zip(self._named, self._trainable):
            if p.requires_grad != trainable:
                now = "unfrozen" if p.requires_grad else "frozen"
                raise UserError(
                    f"parameter {n} was {now} (requires_grad set to {p.requires_grad}) after {self.name} was built; its state "
                    "and 1-bit error buffers are laid out once over the parameters trainable then, so freeze or unfreeze "
                    "before building the optimizer (for a new phase, start a run from this one's model)."
                )
            if p.grad is not None and p.grad.is_sparse:
                raise UserError(f"parameter {n} has a sparse gradient, which {self.name} does not support; make it dense or use optimizer.name adam.")

    def step(self) -> str:
        self._check_parameters()
        self.optimizer.step()
        return self.optimizer.last_step.kind

    def keep_rounds_in_step(self, reason: str) -> None:
        self.optimizer.keep_rounds_in_step(reason)

    def regroup(self, broadcast: bool = False) -> None:
        """The state laid out again over the process group as it is now (DataParallelOptimizer.regroup)."""
        self.optimizer.regroup(broadcast)

    def clip_by_bucket(self, max_norm: float | None) -> None:
        self.optimizer.clip_by_bucket(max_norm)

    @property
    def variance_updates(self) -> int:
        return self.optimizer.variance_updates

    @property
    def parameters_differ(self) -> bool:
        return self.optimizer.parameters_differ

    @property
    def max_steps_apart(self) -> int:
        return self.optimizer.max_steps_apart

    def next_step_communicates(self) -> bool:
        return self.optimizer.next_step_communicates()

    def synchronize(self) -> None:
        self.optimizer.synchronize()

    def wait_for_rounds(self) -> None:
        self.optimizer.wait_for_rounds()

    def average_statistics(self) -> None:
        self.optimizer.average_now()

    # State identical on every rank is saved once (by rank 0); each rank file holds only what is its own.
    def shared_state_dict(self) -> dict:
        return self.optimizer.shared_state_dict()

    def rank_state_dict(self) -> dict:
        return self.optimizer.rank_state_dict()

    def load_state_dicts(self, shared: dict, rank: dict) -> None:
        self.optimizer.load_state_dicts(shared, rank)

    def load_resharded(self, shared: dict, load_parameters: Callable[[dict], None] | None = None) -> None:
        self.optimizer.load_resharded(shared, load_parameters)

    def resharded_state(self) -> str:
        return self.optimizer.resharded_state()
