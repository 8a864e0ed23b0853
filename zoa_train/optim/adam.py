"""DataParallelAdam: the full-precision baseline on the same code path as the 1-bit optimizers.

Every step: average the flat gradient through the ledgered allreduce, then AdamW (decoupled weight
decay) with the same bias-correction setting as the others, so comparisons isolate compression.
The trainer's `adam` is DDP with torch.optim.AdamW on top, or, without bias correction (which
torch's AdamW always applies), DDP with this class over a one-rank group for the math.
"""

import torch

from zoa_train.optim.base import DataParallelOptimizer


def apply_adamw(group: dict, flat, m: torch.Tensor, v: torch.Tensor, t: int) -> None:
    """The AdamW step of step index t from the updated moments m and v of `flat`'s parameters (flat
    tensors), with the group's lr, eps, weight decay and bias-correction setting."""
    (beta1, beta2), lr = group["betas"], group["lr"]
    corrected = group["bias_correction"]
    step_size = lr / (1 - beta1 ** (t + 1)) if corrected else lr
    root_bc2 = (1 - beta2 ** (t + 1)) ** 0.5 if corrected else 1.0
    # m / (sqrt(v)/root_bc2 + eps) = root_bc2 * m / (sqrt(v) + eps*root_bc2): two passes for the
    # denominator, as torch's AdamW. No infinite denominators here: where v == 0 every gradient
    # so far was zero, so m is zero too and the step is zero anyway.
    denom = torch.sqrt(v).add_(group["eps"] * root_bc2)
    if group["weight_decay"]:
        torch._foreach_mul_(flat.params, 1 - lr * group["weight_decay"])
    torch._foreach_addcdiv_(flat.params, flat.views(m), flat.views(denom), value=-step_size * root_bc2)


class DataParallelAdam(DataParallelOptimizer):
    """Adam (AdamW's decoupled weight decay) whose `step()` first averages the gradients over the
    ranks in full precision (one allreduce per group, `allreduce_dtype`, fp32 by default): the
    uncompressed reference for the 1-bit optimizers, with the same flat state, ledger and
    bias-correction setting, so that a comparison isolates compression. Use it without DDP, or under
    DDP over a one-rank `process_group` for the math alone (the `adam` recipe without bias correction).

    Parameters: lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, bias_correction=True,
    process_group (default: the world), allreduce_dtype=None.
    State (`state_dict()`): per group flat fp32 m and v and the ledger: 2 fp32 copies of the model.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        process_group=None,
        allreduce_dtype: torch.dtype | None = None,
    ):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
        super().__init__(params, defaults, process_group, allreduce_dtype)

    def _allocate_state(self) -> None:
        for flat, buffers in zip(self._flat, self._buffers):
            buffers["exp_avg"] = flat.keep(flat.zeros())
            buffers["exp_avg_sq"] = flat.keep(flat.zeros())

    @property
    def variance_updates(self) -> int:
        return self.step_count

    def _step(self) -> tuple[bool, bool, int]:
        t = self.step_count
        for group, flat, buffers in zip(self.param_groups, self._flat, self._buffers):
            if not flat.numel:
                continue
            beta1, beta2 = group["betas"]
            m, v = buffers["exp_avg"], buffers["exp_avg_sq"]
            grad = self._allreduce(flat, flat.flat_grad())
            m.lerp_(grad, 1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            apply_adamw(group, flat, m, v, t)
        return True, True, 1
