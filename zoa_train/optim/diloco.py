"""DiLoCo (Douillard et al. 2023) and Streaming DiLoCo (Douillard et al. 2025) on torch.distributed.

Every rank takes inner AdamW steps on its own gradients, sending nothing; every `sync_every` (H) steps
the pseudo-gradient, the parameters at the last outer step minus the parameters now, is averaged over
the ranks in full precision (`allreduce_dtype`) and an outer SGD step with Nesterov momentum moves the
shared parameters from where they were at the last outer step (the paper's defaults: outer lr 0.7,
momentum 0.9). The inner optimizer's moments stay each rank's own, as in the paper. With outer lr 1
and no momentum an outer step sets every rank to the ranks' average: periodic model averaging (local
SGD, here local AdamW). With `fragments` F > 1 (Streaming DiLoCo) the parameters are cut into F
fragments of about equal size in model order, and fragment f has its outer step at the steps
t = floor(H (f + 1) / F) mod H of each period: the same bytes per period, in F smaller rounds.

With `outer_collective` (a collective factory, zoa_train/comm/protocol.py) the pseudo-gradient is
averaged by that collective instead: the 1-bit allreduce (flat or node-aware) or the top-k one
(zoa_train/comm/topk.py), each carrying its error feedback from one outer step to the next. The flat
state is then kept in the collective's layouts, and its error buffers are this rank's own state (in
the rank's checkpoint file); it averages the whole model at once, so fragments must be 1.

With `sync_delay` 1 (and more than one rank) a step with outer steps due computes their
pseudo-gradients and starts their average on a thread of its own, over a duplicate of the process
group, and returns: the average runs behind the next step's forward and backward (Streaming DiLoCo's
overlapped communication, with a delay of one step), and the next step() applies the outer steps
first, before its inner update, exactly as they would have been applied in their own step. The only
effect is that one inner gradient per outer step is taken at this rank's own parameters instead of
at the outer step's result (docs/optimizers.md).

Why not torchft's DiLoCo: it runs only under a torchft Manager, which needs a Lighthouse server
process beside the job and a quorum with it at every outer step, and its own reconfigurable process
groups; zoa-train's launchers (local spawn, torchrun, srun) start none of that, and its fault
tolerance (replica groups that leave and rejoin) is not what is compared here. The outer loop is a
few foreach operations and one allreduce on torch.distributed (docs/baselines.md).
"""

from dataclasses import dataclass, field

import torch

from zoa_train.comm import CollectiveFactory, allreduce
from zoa_train.optim.adam import apply_adamw
from zoa_train.optim.base import DataParallelOptimizer
from zoa_train.step_kinds import LOCAL, OUTER


def fragment_of(numels: list[int], fragments: int) -> list[int]:
    """The fragment of each parameter (their element counts in model order): the one its first
    element falls in when the elements are cut into `fragments` runs of equal length."""
    total, before, where = sum(numels), 0, []
    for n in numels:
        where.append(min(fragments - 1, before * fragments // max(total, 1)))
        before += n
    return where


@dataclass
class OuterSchedule:
    """Which fragments take their outer step at which step, and how many steps each has gone without."""

    sync_every: int
    fragments: int = 1
    since: list[int] = field(default_factory=list)  # steps since each fragment's last outer step

    def __post_init__(self):
        if self.sync_every < 1:
            raise ValueError(f"sync_every must be at least 1, got {self.sync_every}")
        if not 1 <= self.fragments <= self.sync_every:
            raise ValueError(f"fragments must be between 1 and sync_every ({self.sync_every}), got {self.fragments}")
        self.since = self.since or [0] * self.fragments

    def offset(self, fragment: int) -> int:
        """The step of each period (step number mod H) at which `fragment` takes its outer step."""
        return (self.sync_every * (fragment + 1) // self.fragments) % self.sync_every

    def due(self, step_number: int) -> list[int]:
        """The fragments whose outer step is at step `step_number` (counted from 1)."""
        return [f for f in range(self.fragments) if step_number % self.sync_every == self.offset(f)]

    def state_dict(self) -> dict:
        return {"since": list(self.since)}

    def load_state_dict(self, state: dict) -> None:
        if len(state["since"]) != self.fragments:
            raise ValueError(f"the DiLoCo state has {len(state['since'])} fragments and this run {self.fragments}")
        self.since = list(state["since"])


class DiLoCo(DataParallelOptimizer):
    """DiLoCo: inner AdamW steps on each rank's own gradients, every `sync_every` steps an outer
    Nesterov SGD step on the pseudo-gradient averaged over the ranks (optionally by fragments).

    Use it without DDP: `step()` communicates at outer steps only. Parameters: lr=1e-3 (the inner
    AdamW's, which an lr schedule sets), betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0 (decoupled,
    matrices only as the recipes group them), bias_correction=True (the shared knobs of every
    optimizer); sync_every=500 (H, the paper's), outer_lr=0.7, outer_momentum=0.9, outer_nesterov=True
    (the paper's), fragments=1 (Streaming DiLoCo above 1); process_group, allreduce_dtype (the
    pseudo-gradient's on the wire); outer_collective=None (a full-precision allreduce; else the
    collective factory that averages the pseudo-gradient, with fragments 1); sync_delay=0 (1: each
    outer step's average runs behind the next inner step and is applied at the next step(), before
    its inner update; it acts between ranks only).
    State: per group flat fp32 inner m and v (each rank's own), the anchor (the parameters at the last
    outer step) and the outer momentum: 4 fp32 copies of the model, and between outer steps each
    rank's own parameters (the trainer saves them in the rank's checkpoint file). With an outer
    collective, also a pseudo-gradient buffer and the collective's error buffers.
    """

    _local_buffers = frozenset({"exp_avg", "exp_avg_sq"})  # the inner moments: never averaged
    _buffer_words = {**DataParallelOptimizer._buffer_words, "exp_avg": "inner momentum", "exp_avg_sq": "inner variance"}

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        sync_every: int = 500,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        outer_nesterov: bool = True,
        fragments: int = 1,
        process_group=None,
        allreduce_dtype: torch.dtype | None = None,
        outer_collective: CollectiveFactory | None = None,
        sync_delay: int = 0,
    ):
        if outer_collective is not None and fragments != 1:
            raise ValueError(f"an outer collective averages the whole model at once, so fragments must be 1, got {fragments}")
        if not outer_lr > 0:
            raise ValueError(f"outer_lr must be positive, got {outer_lr}")
        if not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
        self.schedule = OuterSchedule(sync_every, fragments)
        self.outer_lr, self.outer_momentum, self.outer_nesterov = outer_lr, outer_momentum, outer_nesterov
        self._pending: list[tuple[int, list[torch.Tensor]]] = []  # delayed outer steps: (fragment, its averaged pseudo-gradient's buffers)
        super().__init__(params, defaults, process_group, allreduce_dtype, outer_collective, sync_delay)

    def _allocate_state(self) -> None:
        for flat, buffers in zip(self._flat, self._buffers):
            buffers["exp_avg"] = flat.keep(flat.zeros())
            buffers["exp_avg_sq"] = flat.keep(flat.zeros())
            buffers["anchor"] = flat.keep(flat.flatten([p.detach() for p in flat.params]))
            buffers["outer_momentum"] = flat.keep(flat.zeros())
        self._fragments = self._cut(self.schedule.fragments)
        if self.collective is not None:  # the pseudo-gradient in the collective's layouts (padding stays zero)
            self._pseudo_gradients = [flat.keep(flat.zeros()) for flat in self._flat]
            self._pseudo_gradient_views = [v for flat, g in zip(self._flat, self._pseudo_gradients) if flat.numel for v in flat.views(g)]

    def _cut(self, fragments: int) -> list[dict[str, list[torch.Tensor]]]:
        """Per fragment, the views of its parameters, anchor and outer momentum: consecutive parameters
        (model order, across groups) of about numel/F elements each."""
        entries = []
        for flat, buffers in zip(self._flat, self._buffers):
            if flat.numel:
                entries += zip(flat.params, flat.views(buffers["anchor"]), flat.views(buffers["outer_momentum"]))
        cut = [{"params": [], "anchor": [], "momentum": []} for _ in range(fragments)]
        for f, (p, anchor, momentum) in zip(fragment_of([p.numel() for p, _, _ in entries], fragments), entries):
            for name, tensor in zip(("params", "anchor", "momentum"), (p, anchor, momentum)):
                cut[f][name].append(tensor)
        empty = [f for f, fragment in enumerate(cut) if not fragment["params"]]
        if empty:
            raise ValueError(f"{fragments} fragments leave fragment {empty[0]} without a parameter: use fewer")
        return cut

    @property
    def variance_updates(self) -> int:
        return self.step_count  # the inner AdamW updates its own v every step

    @property
    def parameters_differ(self) -> bool:
        # a fragment whose outer step is pending keeps its steps since the last one until it is applied
        return any(self.schedule.since) or self._in_flight or self._landed

    @property
    def max_steps_apart(self) -> int:
        # a rank may take a whole period ahead, and one more step before a delayed outer step lands
        return self.schedule.sync_every + self.sync_delay

    def next_step_communicates(self) -> bool:
        return bool(self.schedule.due(self.step_count + 1))

    def _kind(self, synced: bool, variance_updated: bool) -> str:
        return OUTER if synced else LOCAL

    def synchronize(self) -> None:
        """An outer step now for every fragment with inner steps since its last (before a final
        evaluation), counted as a step of its own; a delayed outer step is applied first."""
        self._land()
        pending = [f for f, since in enumerate(self.schedule.since) if since]
        if not pending:
            return super().synchronize()
        with torch.no_grad():
            for f in pending:
                self._outer_step(f)
        self._average_tensors(in_step=True)
        self.ledger.end_step()

    def _step(self) -> tuple[bool, bool, int]:
        t = self.step_count
        for group, flat, buffers in zip(self.param_groups, self._flat, self._buffers):
            if flat.numel:
                self._inner_step(group, flat, buffers, t)
        self.schedule.since = [since + 1 for since in self.schedule.since]
        due = self.schedule.due(t + 1)
        if due and self._round_thread is not None:  # sync_delay 1, several ranks
            self._start_delayed(due)
        else:
            for f in due:
                self._outer_step(f)
        return bool(due), True, self.schedule.sync_every

    def _inner_step(self, group: dict, flat, buffers: dict, t: int) -> None:
        """AdamW on this rank's own gradients (the math of DataParallelAdam, nothing sent)."""
        beta1, beta2 = group["betas"]
        m, v = buffers["exp_avg"], buffers["exp_avg_sq"]
        grads, m_with, m_without = flat.split_by_grad(flat.views(m))
        _, v_with, v_without = flat.split_by_grad(flat.views(v))
        torch._foreach_lerp_(m_with, grads, 1 - beta1)
        torch._foreach_mul_(v_with, beta2)
        torch._foreach_addcmul_(v_with, grads, grads, value=1 - beta2)
        if m_without:  # no gradient counts as a zero gradient
            torch._foreach_mul_(m_without, beta1)
            torch._foreach_mul_(v_without, beta2)
        apply_adamw(group, flat, m, v, t)

    def _outer_step(self, f: int) -> None:
        """Average fragment f's pseudo-gradient (anchor - parameters) and take the outer SGD step from the
        anchor; every rank ends on the same parameters of the fragment, which become its anchor."""
        flats = self._pseudo_gradient(f)
        self._average(flats, self.process_group)
        self._apply_outer_step(f, flats)

    def _start_delayed(self, due: list[int]) -> None:
        """Start the average of the due fragments' pseudo-gradients on the delayed rounds' thread (over
        the duplicate group) and return; the next step() applies their outer steps (`_apply_landed`).
        The buffers are the thread's until it is waited for: nothing else writes them before."""
        work = [(f, self._pseudo_gradient(f)) for f in due]
        group = self._round_group

        def job() -> None:
            for _, flats in work:
                self._average(flats, group)

        self._pending = work
        self._in_flight = self._landed = True
        self._round_thread.submit(job)

    def _apply_landed(self) -> None:
        """A delayed outer round lands: each pending fragment's outer step from its averaged
        pseudo-gradient (its anchor, outer momentum and parameters untouched since: the step that lands
        it has taken no inner step yet)."""
        pending, self._pending = self._pending, []
        for f, flats in pending:
            self._apply_outer_step(f, flats)

    def _pseudo_gradient(self, f: int) -> list[torch.Tensor]:
        """Fragment f's anchor - parameters in flat buffers: one new buffer of the fragment's tensors
        back to back (full precision), or the outer collective's per-group buffers (every parameter:
        fragments is 1 then)."""
        fragment = self._fragments[f]
        params, anchor = fragment["params"], fragment["anchor"]
        if self.collective is None:
            deltas = torch._foreach_sub(anchor, params)
            return [torch.cat([d.reshape(-1) for d in deltas])]
        deltas = self._pseudo_gradient_views
        torch._foreach_copy_(deltas, anchor)
        torch._foreach_sub_(deltas, params)
        return self._pseudo_gradients

    def _average(self, flats: list[torch.Tensor], group) -> None:
        """Average a pseudo-gradient's flat buffers over the ranks in place: in full precision
        (allreduce_dtype) over `group`, or by the outer collective (over the group it was built on; the
        compression error stays in it)."""
        if self.collective is None:
            allreduce(flats[0], group=group, ledger=self.ledger, comm_dtype=self.allreduce_dtype)
        else:
            self.collective.op(flats)

    def _apply_outer_step(self, f: int, flats: list[torch.Tensor]) -> None:
        """The outer SGD step of fragment f from its averaged pseudo-gradient (`flats`, as
        `_pseudo_gradient` made them): outer momentum, the anchor, the parameters set to the anchor."""
        fragment = self._fragments[f]
        params, anchor, momentum = fragment["params"], fragment["anchor"], fragment["momentum"]
        if self.collective is None:
            deltas = [d.view_as(p) for d, p in zip(flats[0].split([p.numel() for p in params]), params)]
        else:
            deltas = self._pseudo_gradient_views  # views of `flats`, which are self._pseudo_gradients
        update = deltas
        if self.outer_momentum:
            torch._foreach_mul_(momentum, self.outer_momentum)
            torch._foreach_add_(momentum, deltas)
            update = torch._foreach_add(deltas, momentum, alpha=self.outer_momentum) if self.outer_nesterov else momentum
        torch._foreach_add_(anchor, update, alpha=-self.outer_lr)
        torch._foreach_copy_(params, anchor)
        self.schedule.since[f] = 0

    def _outer_sync(self) -> str:
        """What averages the pseudo-gradient, as a checkpoint records it."""
        return "a full-precision allreduce" if self.collective is None else type(self.collective).__name__

    def shared_state_dict(self) -> dict:
        state = super().shared_state_dict()  # waits for a delayed round: saved landed
        state["zoa"]["pending_outer_steps"] = [f for f, _ in self._pending]  # their outer steps are applied at the next step
        state["zoa"]["outer_sync"] = self._outer_sync()
        return state

    def rank_state_dict(self) -> dict:
        state = super().rank_state_dict()
        # the averaged pseudo-gradients of the pending outer steps (the same on every rank)
        state["zoa_rank"]["pending_pseudo_gradients"] = [flats for _, flats in self._pending]
        return state

    def load_state_dicts(self, shared: dict, rank: dict) -> None:
        saved = shared.get("zoa") or {}
        outer_sync = saved.get("outer_sync", "a full-precision allreduce")  # what a state saved before outer collectives used
        if saved.get("optimizer") == type(self).__name__ and outer_sync != self._outer_sync():
            raise ValueError(
                f"the DiLoCo state was saved with its outer sync through {outer_sync} and this run's goes through "
                f"{self._outer_sync()}; resume with the same optimizer.outer_collective"
            )
        super().load_state_dicts(shared, rank)
        fragments, flats = saved.get("pending_outer_steps", []), (rank.get("zoa_rank") or {}).get("pending_pseudo_gradients", [])
        if len(fragments) != len(flats) or bool(fragments) != self._landed:
            raise ValueError("the DiLoCo state's pending outer steps and their averaged pseudo-gradients do not match; it was not saved whole")
        self._pending = [(f, self._restored(f, saved_flats)) for f, saved_flats in zip(fragments, flats)]

    def _restored(self, f: int, saved: list[torch.Tensor]) -> list[torch.Tensor]:
        """A pending outer step's saved averaged pseudo-gradient, in buffers of this run as `_pseudo_gradient` makes them."""
        if self.collective is None:
            params = self._fragments[f]["params"]
            fresh = [torch.empty(sum(p.numel() for p in params), dtype=torch.float32, device=params[0].device)]
        else:
            fresh = self._pseudo_gradients
        if [t.shape for t in saved] != [t.shape for t in fresh]:
            raise ValueError(f"the DiLoCo state's pending outer step of fragment {f} is not of this run's fragment sizes")
        for target, tensor in zip(fresh, saved):
            target.copy_(tensor)
        return fresh
