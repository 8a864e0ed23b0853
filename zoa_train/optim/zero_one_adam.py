"""ZeroOneAdam: 0/1 Adam (Lu et al., ICLR 2023, Algorithm 1; docs/algorithm.md).

Per step t with lr gamma (divided by 1 - b1^(t+1) when bias_correction is on) and the shared
denominator d = sqrt(v)+eps (identical on every rank: v only changes on full-precision steps):
  variance step (t in T_v): g_bar = full-precision allreduce of the gradients;
      v <- b2*v + (1-b2)*g_bar^2; m <- b1*m + (1-b1)*g_bar; x <- x - gamma*m/d.
      Using g_bar for the momentum too (as the authors' implementation does) makes the step a
      sync without a 1-bit round: m, v and x are identical on all ranks afterwards.
      var_update_weighting "steps" weighs g_bar^2 by the k steps since the previous variance update
      (v <- b2^k*v + (1-b2^k)*g_bar^2) and corrects v's bias over steps (1 - b2^(t+1)), not over
      updates (1 - b2^|T_v|, the default "updates"): the frozen v is then a time average of the
      squared gradients, as Adam's and 1-bit Adam's are, rather than one weighted to the early
      steps where T_v is dense (llama_tiny, three seeds: 0.4% above Adam's loss instead of 1.4%,
      docs/results/convergence.md). The momentum and its bias correction (1 - b1^(t+1)) do not depend on it.
  every other step (Algorithm 1 as written; a sync interval of 1 before the freeze):
      m <- b1*m + (1-b1)*g (local);  a local step: x <- x - gamma*m/d, nothing more (two passes,
      as cheap as a fused AdamW step);
      at a sync step: w = (x_anchor - x) + gamma*m/d (the period's displacement);
      w_bar = 1-bit allreduce of w;  x <- decay*x_anchor - w_bar;
      m <- w_bar*d / sum(gamma since the last sync);  w <- 0.
      The weight decay of a local-step period reaches the parameters at its sync (decay).
With an exact allreduce this is Algorithm 1 to the last bit of rounding (tests check it).
What the 1-bit compressor sees is w = sum of gamma*m/d: a momentum (identical on all ranks but for
the last (1-b1)*g terms), in Adam's normalised units. That is what makes 1 bit enough:
- the momentum changes slowly, so its signs and row scales do too and the compression error is
  small next to it (1-bit Adam compresses the momentum for the same reason). Compressing the noisy
  gradient g/d on the steps before the freeze instead (the authors' implementation) ended 9%
  above Adam on gpt2_tiny stretched to 1,200 steps where this form ends within 1% (docs/results/convergence.md);
- dividing by d first gives every coordinate Adam's O(gamma) step size: compressing the raw
  gradient gives a rarely active coordinate (small v) noise of the row's average size, which the
  division by its small d turns into a large step (16x lr in a test; divergence on gpt2_tiny).
update_clip (default 1.0; None turns it off): before var_freeze_step, on the steps that are not
variance steps, each tensor's m/d is scaled down to an RMS of at most update_clip (Adafactor's update
clipping) before it is applied and accumulated. On gpt2_tiny, seed 1 stayed on the unigram plateau
without it (val 4.970 vs Adam's 4.429); with it the three seeds end within 1% of Adam (docs/results/convergence.md).
x_anchor (x after the last sync), w_bar, g_bar and d are identical on every rank, so x and m are
bit-identical after every sync. Weight decay is decoupled: it never enters u, w or m (but for the
rounding of x_anchor - x); a local-step period applies the product of its (1 - lr*wd) factors at the sync.
w lives in the 1-bit allreduce's own error buffer (its accumulator), so the persistent state is
m, v, x_anchor, the worker buffer and the server chunk: 4 + 1/n fp32 copies of the model, laid
out as the 1-bit allreduce lays out the group (each tensor on its own scale rows).
Parameters whose variance is exactly zero (zero gradient at every variance step) do not move and
add nothing to what is compressed (infinite denominator, see DataParallelOptimizer._denominator).
Once no variance update can come (t >= var_freeze_step) v is replaced in place by d.
"""

import copy

import torch

from zoa_train.comm import CollectiveFactory, OneBitAllReduce
from zoa_train.comm.kernels import fused_sync_finish
from zoa_train.optim.base import DataParallelOptimizer
from zoa_train.optim.schedules import ZeroOneSchedule
from zoa_train.step_kinds import VARIANCE

VAR_UPDATE_WEIGHTINGS = ("updates", "steps")


def finish_sync(m, anchor, denom, decay: float, lr_sum: float, params, anchor_views) -> None:
    """The end of a sync in torch ops, m holding w_bar: m <- w_bar*denom (0 where not finite), the
    anchor and the parameters (`anchor_views`: the anchor's slices shaped as `params`) <- decay*anchor
    - w_bar, m <- m / lr_sum. Where a fused kernel runs (zoa_train.comm.kernels.fused_sync_finish:
    native on CPUs) it does the same in one pass over memory, to the same bits."""
    # Where v == 0 (denom = inf) w_bar is compression noise only: w_bar*denom is +-inf or nan
    # there, and zeroing non-finite values keeps those coordinates still without building a mask.
    m.mul_(denom).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    # The new point, decay*anchor - w_bar (w_bar*denom/denom: 0 where denom = inf), is computed in
    # the anchor and then copied once into the parameters.
    if decay != 1.0:
        anchor.mul_(decay)
    anchor.addcdiv_(m, denom, value=-1.0)
    torch._foreach_copy_(list(params), list(anchor_views))
    if lr_sum > 0:
        m.div_(lr_sum)


class ZeroOneAdam(DataParallelOptimizer):
    """0/1 Adam: Adam whose variance is frozen on a sparse schedule and whose ranks take local steps
    between 1-bit syncs, so that on average well under one bit per parameter crosses the network.

    Use it without DDP: it does the data-parallel communication itself, in `step()`:
      - a variance step (ZeroOneSchedule's T_v, until `var_freeze_step`): the gradients averaged in
        full precision (`allreduce_dtype`, fp32 by default), v and m updated from that average;
      - a sync step (every step until the freeze, then every `interval` steps): the displacement
        since the last sync averaged by one 1-bit call of `collective` (two collectives), which
        puts every rank on the same parameters and momentum;
      - a local step: Adam's step with the frozen denominator; nothing is sent.
    The sync interval follows `local_steps`: "lr" doubles it each time the lr halves from its peak
    (the paper; a constant lr never takes a local step), "steps" every `local_step_scaler` steps
    after the freeze (DeepSpeed's rule), "fixed" is `local_step_interval`; at most `local_step_clip`.

    Parameters (defaults are the authors' DeepSpeed ones but bias_correction, docs/algorithm.md "Defaults"):
      lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0 (decoupled, never in the momentum),
      bias_correction=True (torch.optim.Adam's; DeepSpeed's never corrects bias: from_deepspeed sets False);
      var_freeze_step=100_000, var_update_scaler=16 (kappa: the gaps between
      variance updates double every kappa updates), local_steps="lr", local_step_clip=16,
      local_step_scaler=32_678, local_step_interval=1; update_clip=1.0 (before the freeze, each
      tensor's m/d is scaled to an RMS of at most this on steps with a stale variance; None: off);
      var_update_weighting="updates" (each variance update one step of the average, as the paper;
      "steps": each weighs the steps since the previous one);
      process_group (default: the world), collective (default OneBitAllReduce; see
      zoa_train/comm/protocol.py); sync_delay=0 (1: a sync's 1-bit round runs on a thread of its own
      behind the next step's forward and backward and is applied at the next step(), before its update:
      docs/algorithm.md "Delayed sync"; one rank has nothing to delay).

    State (`state_dict()`): per group, flat fp32 m, v (then the denominator) and the anchor (the
    parameters at the last sync) in the collective's layout; the schedule and the ledger; this rank's
    1-bit error buffers, and inside a local-step period its own m. About 4 + 1/n fp32 copies of the
    model. `last_step` says what the last step did; `synchronize()` ends a local-step period (before
    evaluating or saving); `average_at_sync(tensors)` averages buffers such as BatchNorm statistics
    at every sync.
    """

    deepspeed_type = "zerooneadam"  # from_deepspeed takes DeepSpeed's ZeroOneAdam parameter names

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        var_freeze_step: int = ZeroOneSchedule.var_freeze_step,
        var_update_scaler: int = ZeroOneSchedule.var_update_scaler,
        local_steps: str = ZeroOneSchedule.local_steps,
        local_step_clip: int = ZeroOneSchedule.local_step_clip,
        local_step_scaler: int = ZeroOneSchedule.local_step_scaler,
        local_step_interval: int = ZeroOneSchedule.local_step_interval,
        process_group=None,
        allreduce_dtype: torch.dtype | None = None,
        collective: CollectiveFactory = OneBitAllReduce,
        update_clip: float | None = 1.0,
        var_update_weighting: str = "updates",
        sync_delay: int = 0,
    ):
        if update_clip is not None and not update_clip > 0:
            raise ValueError(f"update_clip must be positive or None, got {update_clip}")
        if var_update_weighting not in VAR_UPDATE_WEIGHTINGS:
            raise ValueError(f"var_update_weighting must be one of {', '.join(VAR_UPDATE_WEIGHTINGS)}, not {var_update_weighting!r}")
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            update_clip=update_clip,
            var_update_weighting=var_update_weighting,
        )
        self.schedule = ZeroOneSchedule(
            var_freeze_step=var_freeze_step,
            var_update_scaler=var_update_scaler,
            local_steps=local_steps,
            local_step_clip=local_step_clip,
            local_step_scaler=local_step_scaler,
            local_step_interval=local_step_interval,
        )
        super().__init__(params, defaults, process_group, allreduce_dtype, collective, sync_delay)

    def _allocate_state(self) -> None:
        for flat, buffers, scalars in zip(self._flat, self._buffers, self._scalars):
            buffers["exp_avg"] = flat.keep(flat.zeros())
            # Holds v until the freeze and then its final denominator sqrt(v/bc2)+eps.
            buffers["exp_avg_sq"] = flat.keep(flat.zeros())
            buffers["anchor"] = flat.keep(flat.flatten([p.detach() for p in flat.params]))
            # variance_steps: the steps v stands for, its weights summing to 1 - b2^variance_steps.
            scalars.update(lr_sum=0.0, decay=1.0, frozen=0, variance_steps=0)
        self._root_numels: dict[tuple[int, int], torch.Tensor] = {}  # per span: sqrt(numel) of each tensor, for _clipped
        self._denominators: dict[int, torch.Tensor] = {}  # per group, this step's (see _step_denominator)
        self._fused_finishers: dict[int, object] = {}  # per group (see _fused_finish)

    def load_state_dicts(self, shared: dict, rank: dict) -> None:
        super().load_state_dicts(shared, rank)
        for scalars in self._scalars:  # a state saved before var_update_weighting: v held one step per update
            scalars.setdefault("variance_steps", self.schedule.variance_updates)

    def synchronize(self) -> None:
        """Sync now if local steps are pending (e.g. before an evaluation), so all ranks agree; the
        extra 1-bit round is counted as a step of its own."""
        self._land()
        if not self.schedule.steps_since_sync:
            return super().synchronize()
        with torch.no_grad():
            for span in self._spans:
                self._start_sync(span, local_steps_taken=True)
            self._wait_rounds()
            self._finish_syncs()
            self._denominators.clear()
        self.schedule.steps_since_sync = 0
        self._average_tensors(in_step=True)
        self.ledger.end_step()

    @property
    def parameters_differ(self) -> bool:
        return self.schedule.steps_since_sync > 0 or self._in_flight or self._landed

    @property
    def max_steps_apart(self) -> int:
        # a rank may take a whole period of local steps ahead, and one more step before a delayed round lands
        return max(1, self.schedule.max_interval) + self.sync_delay

    def next_step_communicates(self) -> bool:
        return copy.copy(self.schedule).advance(self._lead_lr()).sync  # decided on a copy: nothing advances

    def _lead_lr(self) -> float:
        """The lr the schedule follows: the first group that has parameters."""
        return next((g for g, f in zip(self.param_groups, self._flat) if f.numel), self.param_groups[0])["lr"]

    @property
    def variance_updates(self) -> int:
        return self.schedule.variance_updates

    def _kind(self, synced: bool, variance_updated: bool) -> str:
        return VARIANCE if variance_updated else super()._kind(synced, variance_updated)

    def _plan_step(self):
        """The coming step's decision, taken on a copy of the schedule (None for a local step)."""
        schedule = copy.copy(self.schedule)
        decision = schedule.advance(self._lead_lr())
        return (decision, self.schedule.steps_since_sync > 0) if decision.sync else None

    def _prepare(self, span, plan) -> None:
        """A variance step: the span's gradients averaged in full precision. A sync step: the span's
        momentum updated from this rank's gradients, this step's displacement (and the period's)
        accumulated, and its 1-bit exchange started."""
        decision, local_steps_taken = plan
        index, flat = span.group, self._flat[span.group]
        if decision.variance_update:
            if flat.numel:
                self._start_gradient_average(span)
            return
        own_step = None
        if flat.numel:
            group, m = self.param_groups[index], self._buffers[index]["exp_avg"]
            beta1, t = group["betas"][0], decision.step
            step_size = group["lr"] / (1 - beta1 ** (t + 1)) if group["bias_correction"] else group["lr"]
            self._update_momentum(span, m, beta1)
            denom = self._step_denominator(index, t + 1)
            numerator = m[span.start : span.stop]  # this step's displacement is step_size * numerator / denom
            if group["update_clip"] and t < self.schedule.var_freeze_step:
                numerator = self._clipped(index, span, m, denom, group["update_clip"])
            denom = denom[span.start : span.stop]
            self.collective.accumulators[index][span.start : span.stop].addcdiv_(numerator, denom, value=step_size)
            if self._deferred is not None:  # delayed: this rank steps on its own until the round lands
                own_step = (numerator, denom, step_size)
        self._start_sync(span, local_steps_taken, own_step)

    def _start_sync(self, span, local_steps_taken: bool, own_step: tuple | None = None) -> None:
        """After local steps, their displacement anchor - x joins w first (local steps do not
        accumulate it, which keeps them one pass over x and one over m, as cheap as a fused AdamW
        step); then the span's w is averaged by the 1-bit exchange into m (m <- w_bar). A delayed
        sync (`own_step`: this step's numerator, denominator and step size over the span) first moves
        the parameters by this step as a local step would, for the next forward to start from; the
        landing replaces them."""
        flat, buffers = self._flat[span.group], self._buffers[span.group]
        params = [flat.params[i] for i in span.tensors]
        if local_steps_taken and flat.numel:
            anchors, accumulators = flat.views(buffers["anchor"]), flat.views(self.collective.accumulators[span.group])
            displacement = torch._foreach_sub([anchors[i] for i in span.tensors], params)
            torch._foreach_add_([accumulators[i] for i in span.tensors], displacement)
        if own_step is not None:
            numerator, denom, step_size = own_step
            places = [(flat.offsets[i] - span.start, p) for i, p in zip(span.tensors, params)]
            cut = lambda flat_part: [flat_part[o : o + p.numel()].view_as(p) for o, p in places]  # noqa: E731
            torch._foreach_addcdiv_(params, cut(numerator), cut(denom), value=-step_size)
        self._start_exchange(span, buffers["exp_avg"])

    def _step(self) -> tuple[bool, bool, int]:
        plan = self._plan_step()
        decision = self.schedule.advance(self._lead_lr())
        t = decision.step
        # sync_delay 1 on several ranks: a round that closes a local-step period runs behind the next
        # (local) step; syncs every step (before the freeze, in the lr warm-up) stay in step, as delaying
        # them cost 0.9% of gpt2_tiny's loss (docs/results/delayed-sync.md)
        delayed = decision.sync and not decision.variance_update and decision.interval > 1 and self._round_thread is not None
        if decision.sync:
            self._run_rounds(plan, delayed)
        for index, (group, flat, buffers, scalars) in enumerate(zip(self.param_groups, self._flat, self._buffers, self._scalars)):
            if not flat.numel:
                continue
            (beta1, beta2), lr, wd = group["betas"], group["lr"], group["weight_decay"]
            step_size = lr / (1 - beta1 ** (t + 1)) if group["bias_correction"] else lr
            m, v = buffers["exp_avg"], buffers["exp_avg_sq"]
            params, m_views = flat.params, flat.views(m)

            if decision.variance_update:  # a sync: every rank gets the same averaged gradient
                grad = self._grads.pop(index)
                # "updates": each update is one step of Adam's average; "steps": g_bar^2 stands for
                # every step since the previous update (t + 1 - variance_steps of them).
                gap = t + 1 - scalars["variance_steps"] if group["var_update_weighting"] == "steps" else 1
                scalars["variance_steps"] += gap
                decay2 = beta2**gap
                v.mul_(decay2).addcmul_(grad, grad, value=1 - decay2)
                m.lerp_(grad, 1 - beta1)
                if wd:
                    torch._foreach_mul_(params, 1 - lr * wd)
                torch._foreach_addcdiv_(params, m_views, flat.views(self._step_denominator(index, t + 1)), value=-step_size)
                torch._foreach_copy_(flat.views(buffers["anchor"]), params)
                scalars.update(lr_sum=0.0, decay=1.0)
                continue
            scalars["lr_sum"] += step_size
            scalars["decay"] *= 1 - lr * wd
            if decision.sync:  # the displacement went into w in _prepare
                continue
            # a local step: Adam's step with the frozen d; the sync applies the weight decay
            grads, with_grad, without = flat.split_by_grad(m_views)
            if with_grad:
                torch._foreach_lerp_(with_grad, grads, 1 - beta1)
            if without:
                torch._foreach_mul_(without, beta1)
            denom = self._step_denominator(index, t + 1)
            numerator = m
            if group["update_clip"] and t < self.schedule.var_freeze_step:
                numerator = self._clipped(index, None, m, denom, group["update_clip"])
            torch._foreach_addcdiv_(params, flat.views(numerator), flat.views(denom), value=-step_size)
        if decision.sync and not decision.variance_update and not delayed:
            self._finish_syncs()
        self._denominators.clear()
        return decision.sync, decision.variance_update, decision.interval

    def _apply_landed(self) -> None:
        """A delayed sync lands: the finish of its sync step, from the same w_bar, anchor, denominator
        and scalars (nothing has changed them since: the step that lands it has taken no step yet)."""
        self._finish_syncs()
        self._denominators.clear()

    def _clipped(self, index: int, span, m: torch.Tensor, denom: torch.Tensor, limit: float) -> torch.Tensor:
        """A copy of m (of `span`'s slice of it, or all of it for None) scaled per tensor so that the
        RMS of each tensor's m/d is at most `limit` (Adafactor's update clipping). Used before the
        variance freeze on the steps between variance updates: v does not hold their gradients, and
        early in training a gradient that outgrows the last v gives steps of unbounded size, which
        the 1-bit error feedback then replays. After the freeze v is the final preconditioner (as in
        1-bit Adam) and a persistent m/d above 1 is wanted. The copies are made only here, so steps
        after the freeze allocate nothing. Per tensor, so a bucket's share is the same as the group's."""
        flat = self._flat[index]
        start, stop, tensors = (0, flat.size, range(len(flat.params))) if span is None else (span.start, span.stop, span.tensors)
        ratio = m[start:stop] / denom[start:stop]
        clipped = m[start:stop].clone()
        places = [(flat.offsets[i] - start, flat.params[i]) for i in tensors]
        ratios = [ratio[o : o + p.numel()] for o, p in places]
        key = (index, start)
        if key not in self._root_numels:  # of whole tensors, when each rank holds a shard
            self._root_numels[key] = torch.tensor([flat.sources[i].numel() ** 0.5 for i in tensors], device=m.device)
        norms = torch.stack(torch._foreach_norm(ratios))
        if self.shard_group is not None:  # a tensor's norm over its shards on the node's ranks
            self._sum_over_shards(norms.square_())
            norms.sqrt_()
        rms = norms.div_(self._root_numels[key])
        torch._foreach_mul_([clipped[o : o + p.numel()] for o, p in places], list(rms.div_(limit).clamp_(min=1.0).reciprocal_().unbind()))
        return clipped

    def _finish_syncs(self) -> None:
        """x <- decay*anchor - w_bar and m <- w_bar*denom/lr_sum in every group, once every exchange
        has put w_bar (identical on every rank) into m."""
        for index, flat in enumerate(self._flat):
            if flat.numel:
                self._finish_sync(index)

    def _finish_sync(self, index: int) -> None:
        flat, buffers, scalars = self._flat[index], self._buffers[index], self._scalars[index]
        m, anchor = buffers["exp_avg"], buffers["anchor"]  # m holds w_bar
        denom = self._step_denominator(index, self.schedule.step)
        fused = self._fused_finish(index)
        if fused is not None:
            fused(m, anchor, denom, scalars["decay"], scalars["lr_sum"])
        else:
            finish_sync(m, anchor, denom, scalars["decay"], scalars["lr_sum"], flat.params, flat.views(anchor))
        scalars.update(lr_sum=0.0, decay=1.0)

    def _fused_finish(self, index: int):
        """_finish_sync's one-pass kernel for group `index` (zoa_train.comm.kernels.fused_sync_finish:
        native on CPUs) bound to its parameters in layout order, or None where there is none or a
        parameter is not a contiguous fp32 tensor; decided once per group."""
        if index not in self._fused_finishers:
            flat = self._flat[index]
            kernel, finish = fused_sync_finish(flat.device), None
            if kernel is not None and all(p.dtype == torch.float32 and p.is_contiguous() for p in flat.params):
                order = sorted(range(len(flat.params)), key=flat.offsets.__getitem__)
                params, offsets = [flat.params[i] for i in order], [flat.offsets[i] for i in order]

                def finish(m, anchor, denom, decay, lr_sum):
                    kernel(m, anchor, denom, decay, lr_sum, params, offsets)

            self._fused_finishers[index] = finish
        return self._fused_finishers[index]

    def _step_denominator(self, index: int, steps_after: int) -> torch.Tensor:
        """sqrt(v / bc2) + eps for the step that leaves the schedule at `steps_after` steps (v as it
        is now), computed once per step (kept until the step ends); once no variance update can
        follow it replaces v in place."""
        if index in self._denominators:
            return self._denominators[index]
        v, scalars, group = self._buffers[index]["exp_avg_sq"], self._scalars[index], self.param_groups[index]
        if scalars["frozen"]:
            return v
        beta2, covered = group["betas"][1], scalars["variance_steps"]
        bias_correction2 = 1 - beta2**covered if group["bias_correction"] and covered else 1.0
        denom = self._denominator(v, group["eps"], bias_correction2)
        if steps_after >= self.schedule.var_freeze_step:  # no variance update can follow
            v.copy_(denom)
            scalars["frozen"] = 1
            denom = v
        self._denominators[index] = denom
        return denom
