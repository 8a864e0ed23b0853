"""fp16 training: a dynamic loss scaler whose skip decision all ranks share."""

import torch
import torch.distributed as dist

from zoa_train.comm import ring_allreduce_bytes


class LossScaler:
    """Dynamic loss scaling for fp16, each rank with its own scale (saved in its rank file).

    On a step that communicates anyway the overflow flag is max-reduced (counted in the ledger), so when
    any rank overflows every rank skips the step together and no optimizer state is touched. A step that
    does not communicate (0/1 Adam's local steps) stays communication-free: each rank checks only its
    own gradients, and a rank that overflowed takes the step with zero gradients, so the ranks' schedules
    stay in step (its momentum still moves its parameters, as on any local step)."""

    def __init__(self, enabled: bool, device: torch.device | str = "cpu", init_scale: float = 2.0**16, growth_interval: int = 2000):
        self.enabled = enabled
        self.device = torch.device(device)  # of the overflow flag: NCCL reduces device tensors only
        self.scale = init_scale if enabled else 1.0
        self.growth_interval = growth_interval
        self.good_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def unscale_and_check(self, params: list[torch.Tensor], collective: bool = True, ledger=None) -> bool:
        """Unscale the gradients in place; True on an overflow: with `collective`, on some rank (every
        rank skips the step), else on this rank (the caller zeroes its gradients)."""
        if not self.enabled:
            return False
        grads = [p.grad for p in params if p.grad is not None]
        found = torch.zeros(1, device=self.device)
        if grads:
            inv = torch.full((1,), 1.0 / self.scale, device=found.device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        world = dist.get_world_size() if dist.is_initialized() else 1
        if collective and world > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
            if ledger is not None:
                ledger.record("overflow_check", payload_bits=32, elements=1, bytes_sent=ring_allreduce_bytes(1, 4, world))
        overflow = bool(found.item())
        if overflow:
            self.scale /= 2
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= 2
        return overflow

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = state["scale"], state["good_steps"]
