"""OneBitAdam (Tang et al. 2021), the 1-bit baseline (docs/algorithm.md, "1-bit Adam").

Full-precision data-parallel Adam for `freeze_step` steps; then the variance is frozen and the
local momentum m = b1*m + (1-b1)*g is averaged through the error-compensated 1-bit allreduce
every step. Every rank unpacks the same average, so parameters stay identical without a rollback.
Parameters whose variance is exactly zero (gradient zero at every full-precision step) are not
moved (infinite denominator, see DataParallelOptimizer._denominator): sign compression would
otherwise turn their zero momentum into noise.
"""

import torch

from zoa_train.comm import CollectiveFactory, OneBitAllReduce
from zoa_train.optim.base import DataParallelOptimizer


class OneBitAdam(DataParallelOptimizer):
    """1-bit Adam: data-parallel Adam in full precision for `freeze_step` steps, then with the
    variance frozen and the momentum averaged by a 1-bit error-compensated allreduce every step.

    Use it without DDP: `step()` communicates. During the warm-up it averages the gradients in full
    precision (`allreduce_dtype`, fp32 by default) and updates m and v from them; afterwards each rank
    updates m from its own gradient and one call of `collective` (two collectives) gives every rank
    the same averaged m, so the parameters stay identical on all ranks. A parameter whose gradient
    was zero at every warm-up step has v = 0 and does not move.

    Parameters: lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0 (decoupled),
    bias_correction=True (torch.optim.Adam's; DeepSpeed's OnebitAdam never corrects bias: from_deepspeed
    sets False), freeze_step=100_000 (at least 1), process_group (default: the world),
    allreduce_dtype=None (the parameters' fp32), collective (default OneBitAllReduce).

    State (`state_dict()`): per group flat fp32 m and v (then the denominator) in the collective's
    layout, the ledger, and this rank's 1-bit error buffers: about 3 + 1/n fp32 copies of the model.
    """

    deepspeed_type = "onebitadam"  # from_deepspeed takes DeepSpeed's OnebitAdam parameter names

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        freeze_step: int = 100_000,
        process_group=None,
        allreduce_dtype: torch.dtype | None = None,
        collective: CollectiveFactory = OneBitAllReduce,
    ):
        if freeze_step < 1:  # at least one full-precision step, or v stays zero and nothing moves
            raise ValueError(f"freeze_step must be at least 1, got {freeze_step}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
        self.freeze_step = freeze_step
        super().__init__(params, defaults, process_group, allreduce_dtype, collective)

    def _allocate_state(self) -> None:
        for flat, buffers, scalars in zip(self._flat, self._buffers, self._scalars):
            buffers["exp_avg"] = flat.keep(flat.zeros())
            # Holds v during warm-up and, once frozen, its final denominator sqrt(v/bc2)+eps.
            buffers["exp_avg_sq"] = flat.keep(flat.zeros())
            scalars.update(variance_updates=0, frozen=0)

    @property
    def variance_updates(self) -> int:
        return min(self.step_count, self.freeze_step)

    def _plan_step(self) -> str:
        return "warmup" if self.step_count < self.freeze_step else "onebit"

    def _prepare(self, span, plan: str) -> None:
        """A warm-up step: the span's gradients into the group's gradient buffer, averaged in full
        precision. After it: the span's momentum updated from this rank's gradients, then averaged
        by the 1-bit exchange in place."""
        flat, m = self._flat[span.group], self._buffers[span.group]["exp_avg"]
        if plan == "warmup":
            if flat.numel:
                self._start_gradient_average(span)
            return
        if flat.numel:
            self._update_momentum(span, m, self.param_groups[span.group]["betas"][0])
        self._start_exchange(span, m, m)

    def _step(self) -> tuple[bool, bool, int]:
        t = self.step_count
        warmup = t < self.freeze_step
        self._run_rounds(self._plan_step())
        denominators = {}
        for index, (group, flat, buffers, scalars) in enumerate(zip(self.param_groups, self._flat, self._buffers, self._scalars)):
            if not flat.numel:
                continue
            (beta1, beta2), eps = group["betas"], group["eps"]
            corrected = group["bias_correction"]
            m, v = buffers["exp_avg"], buffers["exp_avg_sq"]
            if warmup:
                grad = self._grads.pop(index)
                m.lerp_(grad, 1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                scalars["variance_updates"] += 1
                denominators[index] = self._denominator(v, eps, 1 - beta2 ** scalars["variance_updates"] if corrected else 1.0)
            else:
                if not scalars["frozen"]:
                    v.copy_(self._denominator(v, eps, 1 - beta2 ** scalars["variance_updates"] if corrected else 1.0))
                    scalars["frozen"] = 1
                denominators[index] = v
        for index, denom in denominators.items():
            group, flat = self.param_groups[index], self._flat[index]
            beta1, lr = group["betas"][0], group["lr"]
            step_size = lr / (1 - beta1 ** (t + 1)) if group["bias_correction"] else lr
            if group["weight_decay"]:
                torch._foreach_mul_(flat.params, 1 - lr * group["weight_decay"])
            torch._foreach_addcdiv_(flat.params, flat.views(self._buffers[index]["exp_avg"]), flat.views(denom), value=-step_size)
        return True, warmup, 1
