"""What the three data-parallel optimizers share: flat fp32 state, gradient gathering, the ledger,
the per-step record; the state dict that carries everything of this rank is in state.py.

These optimizers do their own data-parallel communication: the model is not wrapped in DDP. At
construction (or, for one built before torch.distributed was initialised, when it is bound to the
group: `bind()`, its first step) the ranks' parameter shapes are checked to agree and every parameter
is broadcast from rank 0, so that all ranks start from the same point.
A parameter whose .grad is None in a step counts as having a zero gradient, on every rank alike.

Parameters sharded by FSDP2 (DTensors; zoa_train/comm/sharding.py) are taken as this rank's local
shards: the state follows the shard, and the process group is the ranks that hold the same shard (one
per node). Their gradients are FSDP2's, already averaged over the node. FSDP2 sets them after its
reduce-scatter, not through autograd's accumulation, so rounds start in step(), never during backward.

A delayed sync (`sync_delay` 1, ZeroOneAdam's and DiLoCo's): a sync step's round runs on a thread of its own,
over a duplicate of the process group, while the rank computes the next step's forward and backward
from its own parameters; the next step() (or anything that needs the state: synchronize, a state dict,
a full-precision average) waits for it, and the next step() applies it before anything else
(docs/algorithm.md, "Delayed sync"). The round's records stay in its own step of the ledger, which is
closed when it lands.
"""

import contextlib
import hashlib
import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from zoa_train.comm import Collective, CollectiveFactory, CommLedger, allreduce, group_size_rank, onebit_layout, ring_allreduce_bytes
from zoa_train.comm.buckets import CommThread, duplicate_group
from zoa_train.comm.layout import OneBitLayout
from zoa_train.comm.protocol import buckets_of
from zoa_train.comm.sharding import local_shard
from zoa_train.optim.deepspeed_names import translate
from zoa_train.optim.state import OptimizerState
from zoa_train.step_kinds import FULL, LOCAL, ONEBIT

log = logging.getLogger(__name__)

SPARSE = (
    "a parameter has a sparse gradient, which these optimizers do not support (their flat state and 1-bit error "
    "buffers are dense); make it dense (e.g. nn.Embedding(sparse=False)) or use a torch optimizer"
)


def check_hyperparameters(name: str, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """Refuse what torch.optim's Adam refuses, in one sentence (NaN fails every comparison)."""
    if not lr >= 0:
        raise ValueError(f"{name}: lr must be >= 0, got {lr}")
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise ValueError(f"{name}: betas must be two numbers in [0, 1), got {betas}")
    if not eps >= 0:
        raise ValueError(f"{name}: eps must be >= 0, got {eps}")
    if not weight_decay >= 0:
        raise ValueError(f"{name}: weight_decay must be >= 0, got {weight_decay}")


@dataclass
class StepRecord:
    """What the last optimizer step did on this rank."""

    step: int
    synced: bool  # parameters are identical on all ranks after this step
    variance_updated: bool
    bits_per_param: float  # nominal, docs/algorithm.md "Counting"
    bytes_sent: int
    interval: int = 1
    kind: str = FULL  # one character of zoa_train.step_kinds.STEP_KINDS


class Span(NamedTuple):
    """A run of one group's tensors whose round starts at once: a bucket (zoa_train/comm/buckets.py),
    or the whole group under a collective without buckets."""

    index: int  # the order rounds start in
    group: int
    tensors: tuple[int, ...]  # indices into the group's params
    start: int  # its slice of the group's flat buffers
    stop: int


_UNDECIDED = object()  # no hook has asked yet what the coming step does


class FlatGroup:
    """The parameters of one param group and the layout of its flat state buffers.

    The layout is the group's 1-bit allreduce layout (each parameter where that layout puts it,
    padding between them kept at zero) or, without compression, the parameters back to back."""

    def __init__(self, params: list[torch.Tensor], layout: OneBitLayout):
        self.sources = params  # as given: what holds .grad and requires_grad (a DTensor when sharded)
        self.params = [local_shard(p) for p in params]  # what the state follows: this rank's elements
        self.numel = layout.numel
        self.size = layout.padded  # elements of each flat buffer
        self.offsets = layout.offsets
        self.device = params[0].device if params else torch.device("cpu")
        self._kept: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}

    def zeros(self) -> torch.Tensor:
        return torch.zeros(self.size, dtype=torch.float32, device=self.device)

    def keep(self, flat: torch.Tensor) -> torch.Tensor:
        """Register a buffer that lives as long as the optimizer: its views are made once, not on
        every step (slicing a few hundred views costs more than a small model's whole step)."""
        self._kept[id(flat)] = (flat, self._slice(flat))
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of `flat` shaped like each parameter (do not modify the list)."""
        kept = self._kept.get(id(flat))
        return kept[1] if kept is not None and kept[0] is flat else self._slice(flat)

    def _slice(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[offset : offset + p.numel()].view_as(p) for p, offset in zip(self.params, self.offsets)]

    def flatten(self, tensors: list[torch.Tensor | None]) -> torch.Tensor:
        """One new flat fp32 buffer holding `tensors` (one per parameter; None for zeros)."""
        flat = self.zeros()
        pairs = [(view, t) for view, t in zip(self.views(flat), tensors) if t is not None]
        if pairs:
            torch._foreach_copy_(*map(list, zip(*pairs)))
        return flat

    def grad(self, i: int) -> torch.Tensor | None:
        """The gradient of parameter `i` over this rank's elements (None: it has none)."""
        grad = self.sources[i].grad
        if grad is not None and grad.is_sparse:
            raise ValueError(SPARSE)
        return None if grad is None else local_shard(grad)

    def flat_grad(self) -> torch.Tensor:
        """All gradients in one new flat fp32 buffer (zeros where .grad is None)."""
        return self.flatten([self.grad(i) for i in range(len(self.params))])

    def flatten_into(self, flat: torch.Tensor, span: Span) -> None:
        """Copy the gradients of `span`'s tensors into their views of `flat` (zeros where .grad is None)."""
        views = self.views(flat)
        grads, with_grad, without = self.split_by_grad([views[i] for i in span.tensors], span.tensors)
        if with_grad:
            torch._foreach_copy_(with_grad, grads)
        if without:
            torch._foreach_zero_(without)

    def split_by_grad(self, views: list[torch.Tensor], indices: Sequence[int] | None = None):
        """(grads, views of params that have one, views of params that have none), for the parameters
        at `indices` (default: all of the group's) and their `views`."""
        grads, with_grad, without = [], [], []
        for i, view in zip(range(len(self.params)) if indices is None else indices, views):
            grad = self.grad(i)
            if grad is None:
                without.append(view)
            else:
                grads.append(grad)
                with_grad.append(view)
        return grads, with_grad, without


def _shard_group(name: str, params: list[torch.Tensor]):
    """The process group of the node's ranks that shard `params` (FSDP2 over a 1-D mesh), or None
    when no parameter is sharded."""
    meshes = {p.device_mesh for p in params if isinstance(p, DTensor)}
    if not meshes:
        return None
    if len(meshes) > 1 or next(iter(meshes)).ndim != 1:
        raise ValueError(
            f"{name} takes parameters sharded over one 1-D mesh of a node's ranks (FSDP2's fully_shard(mesh=...)), and an "
            "unsharded remainder; HSDP's 2-D mesh replicates across nodes itself, so train that with a torch optimizer"
        )
    return next(iter(meshes)).get_group()


class DataParallelOptimizer(OptimizerState, torch.optim.Optimizer):
    """Base of DataParallelAdam, OneBitAdam and ZeroOneAdam.

    Subclasses fill `self._buffers[i]` (name -> flat fp32 tensor of group i), `self._scalars[i]`
    (name -> float) and `self.schedule` (an object with state_dict/load_state_dict, or None), and
    implement `_step() -> StepRecord fields`. Given a `collective` factory (zoa_train.comm.protocol),
    `self.collective` is the one collective of all groups (one call per step whatever the number
    of groups; each group in its own layout, which its flat buffers take), and None without.
    """

    _local_buffers: frozenset[str] = frozenset()  # flat buffers that are each rank's own even when parameters agree (DiLoCo's inner moments)
    deepspeed_type: str | None = None  # DeepSpeed's optimizer of the same algorithm (zoa_train.optim.deepspeed_names), if any

    @classmethod
    def from_deepspeed(cls, params, process_group=None, **ds_params):
        """This optimizer from the parameter names of DeepSpeed's optimizer of the same algorithm (a
        DeepSpeed config's optimizer.params: ZeroOneAdam's for ZeroOneAdam, OnebitAdam's for OneBitAdam),
        so that a script that built DeepSpeed's optimizer changes one line. The names are mapped by
        zoa_train.optim.deepspeed_names (docs/from-deepspeed.md); cuda_aware, comm_backend_name,
        eps_inside_sqrt and bias_correction are accepted with no effect, as DeepSpeed ignores them too
        (it never corrects bias there); any other name DeepSpeed's class does not take is a UserError."""
        if cls.deepspeed_type is None:
            raise TypeError(f"{cls.__name__} has no DeepSpeed counterpart to take parameter names from")
        kwargs, _ = translate(cls.deepspeed_type, ds_params, f"{cls.__name__}.from_deepspeed")
        return cls(params, process_group=process_group, **kwargs)

    schedule = None  # an object with state_dict/load_state_dict (a subclass's), or None

    def __init__(
        self,
        params,
        defaults: dict,
        process_group=None,
        allreduce_dtype: torch.dtype | None = None,
        collective: CollectiveFactory | None = None,
        sync_delay: int = 0,
    ):
        self._constructed = False
        name = type(self).__name__
        check_hyperparameters(name, defaults["lr"], defaults["betas"], defaults["eps"], defaults["weight_decay"])
        if sync_delay not in (0, 1) or isinstance(sync_delay, bool):
            raise ValueError(f"{name}: sync_delay must be 0 (rounds land in their own step) or 1 (they land at the next step), not {sync_delay!r}")
        self.sync_delay = sync_delay
        super().__init__(params, defaults)
        self.process_group = process_group
        self.allreduce_dtype = allreduce_dtype
        seen: set[int] = set()
        for group in self.param_groups:
            unique = []
            for p in group["params"]:
                if p.dtype != torch.float32:
                    raise ValueError(f"{name} keeps fp32 master weights; got a {p.dtype} parameter")
                if id(p) not in seen:  # tied weights listed twice are updated once
                    seen.add(id(p))
                    unique.append(p)
            group["params"] = unique
        params = [p for group in self.param_groups for p in group["params"]]
        if not any(p.requires_grad and p.numel() for p in params):
            given = (
                f"none of the {len(params)} parameters it was given both requires a gradient and holds an element" if params else "it was given no parameters"
            )
            raise ValueError(f"{name} has nothing to train: {given}; pass the trainable ones, e.g. [p for p in model.parameters() if p.requires_grad]")
        self.shard_group = _shard_group(name, params)
        sizes = [[local_shard(p).numel() for p in group["params"]] for group in self.param_groups]
        self.ledger = CommLedger(num_params=sum(map(sum, sizes)))  # this rank's elements: its shard when sharded
        self._collective_factory = collective
        # Built before torch.distributed was initialised (a script that makes its optimizer before its
        # framework starts the group): bound to the default group at the first step, or by an
        # integration's set-up (bind()).
        self._bound = process_group is not None or dist.is_initialized()
        self.last_step: StepRecord | None = None
        self.step_count = 0
        self._averaged: list[torch.Tensor] = []  # see average_at_sync
        self._clip_norm: float | None = None  # clip_by_bucket's
        self._carried = None  # regroup's copy of the state, until it is laid out again
        self._lay_out()
        self._constructed = True

    def _lay_out(self, broadcast: bool = True) -> None:
        """Over the process group as it is now: check that every rank holds the same model, start every
        rank from rank 0's parameters (unless not `broadcast`), build the collective and lay the flat state
        out in its layouts."""
        self.world_size, self.rank = group_size_rank(self.process_group)
        self._check_same_model()
        sizes = [[local_shard(p).numel() for p in group["params"]] for group in self.param_groups]
        self.collective: Collective | None = None
        device = next((p.device for group in self.param_groups for p in group["params"]), torch.device("cpu"))
        # Delayed rounds run on a thread of their own, so their collective gets process groups of its own;
        # one rank has no round to hide, and its steps stay as they are.
        self._round_thread = None
        round_group = self.process_group
        if self.sync_delay and self.world_size > 1:
            round_group = duplicate_group(self.process_group)
            self._round_thread = CommThread(device, self.ledger)
            weakref.finalize(self, self._round_thread.close)
        self._round_group = round_group  # what a delayed round's own collectives run over (DiLoCo's full-precision average)
        self._in_flight = False  # a delayed round runs; its step is still open in the ledger
        self._landed = False  # a delayed round's result waits to be applied at the next step
        self._held: StepRecord | None = None
        if self._collective_factory is not None:
            self.collective = self._collective_factory(sizes, group=round_group, device=device, ledger=self.ledger)
            if self.sync_delay and buckets_of(self.collective) is not None and self.collective.overlap:
                raise ValueError(
                    f"{type(self).__name__}: a delayed sync starts its rounds in step() and lets them run behind the next step; "
                    "give it a collective that does not start rounds during backward (comm.overlap false)"
                )
        layouts = self.collective.layouts if self.collective is not None else [onebit_layout(s, 1) for s in sizes]
        self._flat = [FlatGroup(group["params"], layout) for group, layout in zip(self.param_groups, layouts)]
        self._lay_out_spans()
        if broadcast:
            self._broadcast_parameters()
        self._buffers: list[dict[str, torch.Tensor]] = [{} for _ in self._flat]
        self._scalars: list[dict[str, float]] = [{} for _ in self._flat]
        self._allocate_state()

    # ---- rounds, and starting them during backward ------------------------------------------------

    def _sum_over_shards(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` (squared norms of shards, BatchNorm statistics: a few values) over the node's ranks
        that shard the parameters with this rank. Counted in the totals, not in the step: it stays
        inside the node and makes no local step a round."""
        dist.all_reduce(tensor, group=self.shard_group)
        nbytes = ring_allreduce_bytes(tensor.numel(), tensor.element_size(), dist.get_world_size(self.shard_group))
        self.ledger.record("shard_sum", payload_bits=8 * tensor.element_size(), elements=tensor.numel(), bytes_sent=nbytes, in_step=False, link="intra")

    def _lay_out_spans(self) -> None:
        """The spans rounds start in (the collective's buckets, else one per group) and, when the
        collective overlaps, a hook on every trainable parameter that starts its bucket's round once
        the bucket's gradients are final (docs/algorithm.md, "Overlap")."""
        bucketed = buckets_of(self.collective) is not None
        if bucketed and self.shard_group is not None:
            self._check_buckets_agree_on_the_node()
        if bucketed:
            self._spans = [Span(b.index, b.group, tuple(b.tensors), b.start, b.stop) for b in self.collective.buckets]
        else:
            self._spans = [Span(g, g, tuple(range(len(f.params))), 0, f.size) for g, f in enumerate(self._flat)]
        self._bucketed = bucketed
        for handle in getattr(self, "_hooks", []):
            handle.remove()
        self._hooks = []
        self._span_of: dict[int, int] = {}
        self._needed = [0] * len(self._spans)
        # clip_by_bucket's limits: the square root of each span's share of the trainable elements (whole tensors when sharded)
        whole = [sum(self._flat[s.group].sources[i].numel() for i in s.tensors if self._flat[s.group].sources[i].requires_grad) for s in self._spans]
        self._clip_shares = [(n / max(1, sum(whole))) ** 0.5 for n in whole]
        for span in self._spans:
            for i in span.tensors:
                p = self._flat[span.group].sources[i]
                if p.requires_grad:
                    self._span_of[id(p)] = span.index
                    self._needed[span.index] += 1
        # Whether hooks start rounds during backward; an owner whose gradients change after backward
        # (clipping, loss-scale unscaling, a skipped step) turns it off.
        self.overlap = bucketed and self.collective.overlap and not self.sync_delay
        if self.overlap:
            # The parameters hold their hooks from C++, where the garbage collector cannot see a cycle:
            # a hook holds the optimizer weakly, so that dropping it frees its buffers and process groups.
            ready = weakref.WeakMethod(self._grad_ready)

            def hook(param: torch.Tensor) -> None:
                method = ready()
                if method is not None:
                    method(param)

            params = [self._flat[s.group].sources[i] for s in self._spans for i in s.tensors]
            self._hooks = [p.register_post_accumulate_grad_hook(hook) for p in params if p.requires_grad]
        self._accumulating = False
        self._whole: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._deferred: list | None = None  # the bucketed exchanges of a delayed round, started on its thread
        self._reset_rounds()

    def _check_buckets_agree_on_the_node(self) -> None:
        """Sharded, the node's ranks start their buckets from the same hooks and sum norms over their shards
        bucket by bucket (update_clip), collectives among them: they must cut the same buckets, which
        buckets cut by the shards' own sizes may not (FSDP2's shards of a tensor differ by a row)."""
        mine = [(b.group, list(b.tensors)) for b in buckets_of(self.collective)]
        every: list = [None] * dist.get_world_size(self.shard_group)
        dist.all_gather_object(every, mine, group=self.shard_group)
        if any(theirs != mine for theirs in every):
            raise ValueError(
                f"{type(self).__name__}: the node's ranks cut different buckets of their shards; cut them by whole tensors, "
                "BucketedCollective(..., order=gradient_order(model, param_groups)) (zoa_train.comm.sharding)"
            )

    def clip_by_bucket(self, max_norm: float | None) -> None:
        """Clip each bucket's gradients (each parameter group's, without buckets) once they are final, to a
        norm of at most max_norm * sqrt(the bucket's share of the trainable elements): this rank's norm,
        the node's when sharded. A clip that waits for no other bucket, so rounds still start during
        backward (train.grad_clip_rule bucket; docs/algorithm.md, "Clipping by bucket"); the same
        arithmetic in step() without overlap. None turns it off."""
        if max_norm is not None and not max_norm > 0:
            raise ValueError(f"{type(self).__name__}: clip_by_bucket takes a positive max_norm or None, not {max_norm!r}")
        self._clip_norm = max_norm

    def _clip_span(self, span: Span) -> None:
        flat = self._flat[span.group]
        grads = [g for g in (flat.grad(i) for i in span.tensors) if g is not None]
        square = torch.stack(torch._foreach_norm(grads)).square().sum() if grads else torch.zeros((), device=flat.device)
        if self.shard_group is not None:  # the bucket's norm over the node's shards (a collective: every rank, every bucket)
            self._sum_over_shards(square)
        if grads:
            limit = self._clip_norm * self._clip_shares[span.index]
            torch._foreach_mul_(grads, (limit / (square.sqrt() + 1e-6)).clamp(max=1.0))  # as clip_grad_norm_ does, per bucket

    def keep_rounds_in_step(self, reason: str) -> None:
        """Start every round in step() from now on (`reason`: what changes the gradients after
        backward, such as clipping), logging one line if rounds were started during backward."""
        if self.overlap:
            self.overlap = False
            log.warning("%s: %s changes the gradients after backward, so its rounds start in step() (bucketed, not overlapped)", type(self).__name__, reason)

    def _reset_rounds(self) -> None:
        self._grads: dict[int, torch.Tensor] = {}  # per group, this step's averaged gradient (_start_gradient_average)
        self._plan = _UNDECIDED
        self._next_span = 0  # spans whose share of the step is done and round started
        self._next_final = 0  # spans whose gradients are final (and clipped, with clip_by_bucket)
        self._ready = [0] * len(self._spans)
        self._fired: set[int] = set()

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside start no round: all micro-batches of a step but the last. Unlike
        DDP's, which is read at the forward, it must hold the backward."""
        accumulating, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = accumulating

    def _grad_ready(self, param: torch.Tensor) -> None:
        """A post-accumulate-grad hook: once every trainable tensor of the next bucket(s) has its
        final gradient, do their share of the step and start their rounds, in bucket order."""
        if self._accumulating or not self.overlap or not self._bound:
            return
        if self._plan is _UNDECIDED:
            self._plan = self._plan_step()
        if self._plan is None and self._clip_norm is None:  # a step that communicates nothing, or that starts all in step()
            return
        key, span = id(param), self._span_of[id(param)]
        if key in self._fired:
            if span < self._next_final:
                raise RuntimeError(
                    f"{type(self).__name__}: a gradient was accumulated again after its bucket's exchange had started (a second backward "
                    "before step(), or one after a zero_grad() without a step); run all but the last backward of a step under "
                    "optimizer.no_sync(), and step() after it"
                )
            return
        self._fired.add(key)
        self._ready[span] += 1
        with torch.no_grad():
            while self._next_final < len(self._spans) and self._ready[self._next_final] >= self._needed[self._next_final]:
                if self._clip_norm is not None:
                    self._clip_span(self._spans[self._next_final])
                self._next_final += 1
            while self._plan is not None and self._next_span < self._next_final:
                self._prepare(self._spans[self._next_span], self._plan)
                self._next_span += 1

    def _plan_step(self):
        """What the coming step does, as `_prepare` needs it, decided without advancing anything;
        None when it starts no round early (e.g. a local step)."""
        return None

    def _prepare(self, span: Span, plan) -> None:
        """Do `span`'s share of a step that `plan` describes and start its round (`_start_exchange`,
        `_start_allreduce`); in a hook (its gradients are final) or in step()."""
        raise NotImplementedError

    def _run_rounds(self, plan, delayed: bool = False) -> None:
        """Start the rounds of this step that no hook has started, in order, and wait for all; `delayed`:
        run them on the delayed rounds' thread and return (they land at the next step, `_land`)."""
        if self._plan is not _UNDECIDED and self._plan is not None and self._plan != plan:
            raise RuntimeError(
                f"{type(self).__name__}: the step changed between backward and step() (the lr or the schedule was changed after the "
                "rounds had started); set the lr before backward, as lr schedulers do"
            )
        if delayed:
            self._deferred = []
        for span in self._spans[self._next_span :]:
            self._prepare(span, plan)
        self._next_span = len(self._spans)
        if not delayed:
            return self._wait_rounds()
        deferred, self._deferred = self._deferred, None
        whole, self._whole = self._whole, {}

        def job() -> None:
            for start in deferred:
                start()
            self._wait_rounds(whole)

        self._in_flight = self._landed = True
        self._round_thread.submit(job)

    def _wait_in_flight(self) -> None:
        """Wait for a delayed round (not applying it) and close its step in the ledger: before anything
        else uses the collective or the state is saved."""
        if not self._in_flight:
            return
        self._in_flight = False
        if self._round_thread is not None:
            self._round_thread.wait()
        comm = self.ledger.end_step()
        self._held.bits_per_param, self._held.bytes_sent = comm.bits_per_param, comm.bytes_sent
        self._held = None

    def _land(self) -> None:
        """Apply a delayed round's result (first thing in the step after it started, or in synchronize):
        the subclass's `_apply_landed`, then the tensors averaged at syncs (outside any step: the round's
        step is closed)."""
        self._wait_in_flight()
        if self._landed:
            self._landed = False
            with torch.no_grad():
                self._apply_landed()
            self._average_tensors(in_step=False)

    def _apply_landed(self) -> None:
        """Apply a delayed round's result (the subclasses that delay)."""
        raise NotImplementedError

    def _start_gradient_average(self, span: Span) -> None:
        """Copy `span`'s gradients into its group's gradient buffer of this step (`self._grads`, zeros
        where a tensor has none) and start their full-precision average."""
        flat = self._flat[span.group]
        if span.group not in self._grads:
            self._grads[span.group] = flat.zeros()
        flat.flatten_into(self._grads[span.group], span)
        self._start_allreduce(span, self._grads[span.group])

    def _update_momentum(self, span: Span, m: torch.Tensor, beta1: float) -> None:
        """m <- b1*m + (1-b1)*g over `span`'s tensors, g this rank's gradient (0 where a tensor has none)."""
        flat = self._flat[span.group]
        views = flat.views(m)
        grads, with_grad, without = flat.split_by_grad([views[i] for i in span.tensors], span.tensors)
        if with_grad:
            torch._foreach_lerp_(with_grad, grads, 1 - beta1)
        if without:
            torch._foreach_mul_(without, beta1)

    def _start_exchange(self, span: Span, out: torch.Tensor, addend: torch.Tensor | None = None) -> None:
        """Start the 1-bit exchange of `span`: its accumulator (+ addend) averaged into `out` (both
        buffers of its group). Without buckets every group's exchange waits for one call over all."""
        if not self._bucketed:
            self._whole[span.group] = (out, addend)
        elif self._deferred is not None:  # a delayed round: started on its thread
            self._deferred.append(lambda: self.collective.start_exchange(span.index, out, addend))
        else:
            self.collective.start_exchange(span.index, out, addend)

    def _start_allreduce(self, span: Span, tensor: torch.Tensor) -> None:
        """Start the full-precision average of `span`'s slice of `tensor` (a buffer of its group), in place."""
        if self._bucketed:
            self.collective.start_allreduce(span.index, tensor, self.allreduce_dtype)
        else:
            self._allreduce(self._flat[span.group], tensor)

    def _wait_rounds(self, whole: dict | None = None) -> None:
        """Wait for the started rounds; without buckets, run the one exchange of every group (`whole`:
        what `_start_exchange` recorded, by default this step's)."""
        if whole is None:
            whole, self._whole = self._whole, {}
        if self._bucketed:
            self.collective.wait()
        elif whole:
            pairs = [whole[g] for g in range(len(self._flat))]
            addends = [a for _, a in pairs]
            self.collective.exchange([o for o, _ in pairs], addends if all(a is not None for a in addends) else None)

    def _allocate_state(self) -> None:
        """Fill `self._buffers` and `self._scalars` for the layout in `self._flat` (the parameters are rank 0's by now)."""

    def bind(self) -> None:
        """Join the default process group now, if this optimizer was built before torch.distributed was
        initialised (so over one rank): the same model checked on every rank, rank 0's parameters
        broadcast, the state laid out for the group, on the device the parameters are on now (a
        framework may have moved them since). Every rank must call it (step() does, at the first step;
        the integrations do when they set up). Nothing to do otherwise."""
        if self._bound or not dist.is_initialized():
            return
        if self.step_count:
            raise ValueError(
                f"{type(self).__name__} took {self.step_count} steps on one rank before torch.distributed was initialised; "
                "bind it (or build it) before its first step, so that every rank starts from the same state"
            )
        self._bound = True
        self._lay_out()

    def regroup(self, broadcast: bool = False) -> None:
        """Lay the state out again over the default process group as it is now, after ranks left or joined a
        running job (train.elastic live, zoa_train/train/live.py): this rank's buffers (momentum, variance,
        anchor, and what it accumulated since the last exchange: local updates, the worker's 1-bit error)
        carry over tensor by tensor into the new world size's layout; the server's 1-bit error starts at
        zero. The parameters stay this rank's own, or with `broadcast` become rank 0's (a rank joins: every
        rank then holds rank 0's, as at construction). Every rank of the new group calls it; a rank that
        joins builds its optimizer instead, which runs the same collectives. If a rank is lost during it,
        calling it again in the next group carries over the same state."""
        self._wait_in_flight()
        if self._carried is None:
            accumulators = self.collective.accumulators if self.collective is not None else [None] * len(self._flat)
            self._carried = [
                ({name: [v.clone() for v in flat.views(b)] for name, b in buffers.items()}, [v.clone() for v in flat.views(acc)] if acc is not None else None)
                for flat, buffers, acc in zip(self._flat, self._buffers, accumulators)
            ]
            self._carried_scalars = self._scalars
        self._lay_out(broadcast)
        accumulators = self.collective.accumulators if self.collective is not None else [None] * len(self._flat)
        for flat, buffers, acc, (kept, accumulated) in zip(self._flat, self._buffers, accumulators, self._carried):
            for name, views in kept.items():
                torch._foreach_copy_(flat.views(buffers[name]), views)
            if acc is not None and accumulated is not None:
                torch._foreach_copy_(flat.views(acc), accumulated)
        self._scalars, self._carried = self._carried_scalars, None

    def broadcast_state(self) -> None:
        """Every rank takes rank 0's state that a synchronised rank shares (its flat buffers, tensor by tensor,
        and its schedules, scalars and ledger): a rank that joins a running job (train.elastic live) after
        `regroup` laid it out. Its own state (1-bit errors, DiLoCo's inner moments) stays its own."""
        for buffers in self._some_buffers(shared=True):
            for name in sorted(buffers):
                dist.broadcast(buffers[name], src=0)
        small = [
            {
                "scalars": self._scalars,
                "schedule": self.schedule.state_dict() if self.schedule is not None else None,
                "ledger": self.ledger.state_dict(),
                "step_count": self.step_count,
            }
        ]
        dist.broadcast_object_list(small, src=0)
        self._scalars = [dict(s) for s in small[0]["scalars"]]
        if self.schedule is not None:
            self.schedule.load_state_dict(small[0]["schedule"])
        self.ledger.load_state_dict(small[0]["ledger"])
        self.step_count = small[0]["step_count"]

    def _check_same_model(self) -> None:
        """Refuse ranks whose parameter groups differ (another model, another grouping): a fingerprint of
        the shapes, one small all_gather at set-up (not a training step: not in the ledger). Parameters on
        the meta device are refused first: they hold no values to train or compare."""
        if any(p.is_meta for group in self.param_groups for p in group["params"]):
            raise ValueError(
                f"{type(self).__name__}: parameters on the meta device hold no values; build the model on a real device "
                "(e.g. module.to_empty(device='cpu'), then initialise it) before the optimizer"
            )
        if self.world_size == 1:
            return
        locals_ = [[local_shard(p) for p in group["params"]] for group in self.param_groups]  # a shard's shape when sharded
        shapes = [[tuple(p.shape) for p in group] for group in locals_]
        digest = int.from_bytes(hashlib.sha256(repr(shapes).encode()).digest()[:8], "little", signed=True)
        tensors, elements = sum(map(len, shapes)), sum(p.numel() for group in locals_ for p in group)
        device = next((p.device for group in locals_ for p in group), torch.device("cpu"))
        mine = torch.tensor([digest, len(shapes), tensors, elements], dtype=torch.int64, device=device)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine, group=self.process_group)
        other = next((r for r, fingerprint in enumerate(every) if not torch.equal(fingerprint, every[0])), None)
        if other is not None:
            first, theirs = every[0].tolist(), every[other].tolist()
            raise ValueError(
                f"{type(self).__name__}: the ranks were given different models: rank 0 has {first[1]} parameter groups of {first[2]} tensors "
                f"({first[3]:,} elements), rank {other} {theirs[1]} of {theirs[2]} ({theirs[3]:,} elements){'' if first[1:] != theirs[1:] else ' of other shapes'}; "
                "build the same model and parameter groups on every rank"
            )

    def average_at_sync(self, tensors: list[torch.Tensor]) -> None:
        """Average `tensors` (e.g. BatchNorm running statistics) over the ranks at every sync, in full
        precision, counted in that step's communication. Without DDP each rank updates its own
        running statistics from its own batches; averaging them whenever the parameters become
        identical keeps the model one model. They never enter a gradient, so this changes
        evaluation only, never the parameters' trajectory."""
        self._averaged = [t for t in tensors if t.is_floating_point()]

    def average_now(self) -> None:
        """Average the tensors of `average_at_sync` now (before an evaluation or a checkpoint),
        counted outside any step. Parameters are left alone: this never changes training."""
        self._average_tensors(in_step=False)

    def synchronize(self) -> None:
        """Make every rank's model identical now (e.g. at the end of training). Parameters already
        are, except inside 0/1 Adam's local-step periods, which its own synchronize ends."""
        self.average_now()

    def wait_for_rounds(self) -> None:
        """Wait for a delayed round still running (sync_delay), without applying it, and count it in the
        ledger: before reading final totals. Changes nothing in training."""
        self._wait_in_flight()

    @property
    def parameters_differ(self) -> bool:
        """Whether ranks hold different parameters now (pending local steps)."""
        return False

    @property
    def max_steps_apart(self) -> int:
        """The most optimizer steps one rank can be ahead of another (a step that communicates waits
        for every rank): what a stop at an agreed step must leave room for."""
        return 1

    def next_step_communicates(self) -> bool:
        """Whether the coming step() communicates (0/1 Adam's local steps do not). The caller may then
        piggyback a small collective on it, such as fp16's overflow check, without adding a round."""
        return True

    @property
    def variance_updates(self) -> int:
        """Steps so far that updated the variance."""
        raise NotImplementedError

    def _average_tensors(self, in_step: bool) -> None:
        if not self._averaged or (self.world_size == 1 and self.shard_group is None):
            return
        with torch.no_grad():
            flat = torch.cat([t.reshape(-1) for t in self._averaged])
            if self.shard_group is not None:  # sharded: the node's ranks ran batches of their own too
                self._sum_over_shards(flat)
                flat.div_(dist.get_world_size(self.shard_group))
            if self.world_size > 1:
                self._full_precision(flat, None, in_step)
            torch._foreach_copy_(self._averaged, [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in self._averaged]), self._averaged)])

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_constructed", False):
            raise RuntimeError(f"{type(self).__name__} lays out its state at construction: pass every parameter group then")
        super().add_param_group(param_group)

    def _broadcast_parameters(self) -> None:
        """Start every rank from rank 0's parameters (setup, not a training step: not in the ledger)."""
        if self.world_size == 1:
            return
        with torch.no_grad():
            for flat in self._flat:
                if flat.numel:
                    buffer = flat.flatten(flat.params)
                    dist.broadcast(buffer, src=dist.get_global_rank(self.process_group, 0) if self.process_group else 0, group=self.process_group)
                    torch._foreach_copy_(flat.params, flat.views(buffer))

    def _allreduce(self, flat: FlatGroup, tensor: torch.Tensor) -> torch.Tensor:
        """Average a flat buffer of `flat` in full precision (its padding is sent, not counted in bits/param)."""
        return self._full_precision(tensor, self.allreduce_dtype, True, flat.numel)

    def _full_precision(self, tensor: torch.Tensor, comm_dtype: torch.dtype | None, in_step: bool, elements: int | None = None) -> torch.Tensor:
        """A full-precision average over the ranks: through the 1-bit collective's topology where
        there is one (node-aware on several nodes), else a flat allreduce; never beside a delayed round."""
        self._wait_in_flight()
        if self.collective is not None:
            return self.collective.allreduce(tensor, comm_dtype=comm_dtype, elements=elements, in_step=in_step)
        return allreduce(tensor, group=self.process_group, ledger=self.ledger, comm_dtype=comm_dtype, elements=elements, in_step=in_step)

    @torch.no_grad()
    def step(self, closure=None):
        if not self._bound:
            self.bind()
        self._land()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            if self._clip_norm is not None:  # the spans no hook has clipped (all of them without overlap), in order
                with torch.no_grad():
                    for span in self._spans[self._next_final :]:
                        self._clip_span(span)
                self._next_final = len(self._spans)
            synced, variance_updated, interval = self._step()
        finally:
            self._reset_rounds()
        kind = self._kind(synced, variance_updated)
        if self._in_flight:  # a delayed round: the ranks differ until it lands; its counts are filled in then
            self.last_step = self._held = StepRecord(self.step_count, False, variance_updated, 0.0, 0, interval, kind)
        else:
            if synced:
                self._average_tensors(in_step=True)
            comm = self.ledger.end_step()
            self.last_step = StepRecord(self.step_count, synced, variance_updated, comm.bits_per_param, comm.bytes_sent, interval, kind)
        self.step_count += 1
        return loss

    def _step(self) -> tuple[bool, bool, int]:
        raise NotImplementedError

    def _kind(self, synced: bool, variance_updated: bool) -> str:
        return FULL if variance_updated else ONEBIT if synced else LOCAL

    @staticmethod
    def _denominator(v: torch.Tensor, eps: float, bias_correction2: float) -> torch.Tensor:
        """sqrt(v / bias_correction2) + eps as a new tensor, and +inf where v == 0.

        v == 0 means every averaged gradient so far was exactly zero. Adam would then divide a
        momentum by eps alone; with frozen or stale v, any local or compressed momentum there
        (noise from sign compression, a gradient that appears between variance updates) would
        become a step of size lr/eps. An infinite denominator makes those coordinates stay put
        and contribute nothing to what is compressed, on every rank alike.
        """
        denom = torch.sqrt(v)
        if bias_correction2 != 1.0:
            denom.div_(bias_correction2**0.5)
        return denom.add_(eps).masked_fill_(v == 0, float("inf"))
