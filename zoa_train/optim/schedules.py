"""The two schedules of 0/1 Adam (docs/algorithm.md, "Schedules"), shared by the optimizer and `plan`.

T_v (variance updates): k_0 = 0, k_{j+1} - k_j = 2^floor(j / kappa), none at or after var_freeze_step.
T_u (syncs): interval 1 before the freeze; after it, by policy:
  "lr"     min(H, 2^floor(log2(lr_max / lr_t))): doubles each time the lr halves (the paper's rule)
  "steps"  min(H, 2^floor((t - freeze) / local_step_scaler)): DeepSpeed's rule
  "fixed"  local_step_interval
A sync happens once `interval` steps have been taken since the previous one. A variance update only
happens on a step whose interval is 1, so no variance update falls inside a local-step period.
"""

import math
from dataclasses import asdict, dataclass

LOCAL_STEP_POLICIES = ("lr", "steps", "fixed")


@dataclass
class StepDecision:
    """What the schedule decided for one step."""

    step: int
    variance_update: bool
    sync: bool
    interval: int


@dataclass
class ZeroOneSchedule:
    """Decides, step by step, which steps update the variance and which synchronise. Its state is
    part of the optimizer state, so a resumed run makes the same decisions."""

    # The one place these knobs' defaults are defined (ZeroOneAdam and the recipe schema read them):
    # the authors' DeepSpeed defaults, 32,678 included (their configs' value, not 2^15).
    var_freeze_step: int = 100_000
    var_update_scaler: int = 16
    local_steps: str = "lr"
    local_step_clip: int = 16
    local_step_scaler: int = 32_678
    local_step_interval: int = 1
    # progress
    step: int = 0
    next_variance_step: int = 0
    variance_gaps_taken: int = 0
    variance_updates: int = 0
    steps_since_sync: int = 0
    max_lr: float = 0.0

    def __post_init__(self):
        if self.local_steps not in LOCAL_STEP_POLICIES:
            raise ValueError(f"local_steps must be one of {', '.join(LOCAL_STEP_POLICIES)}, not {self.local_steps!r}")
        for name in ("var_update_scaler", "local_step_clip", "local_step_scaler", "local_step_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.var_freeze_step < 1:  # step 0 must update v, or every denominator stays infinite
            raise ValueError(f"var_freeze_step must be at least 1, got {self.var_freeze_step}")

    @property
    def max_interval(self) -> int:
        """The longest sync interval this schedule can give: local steps between two syncs, plus one."""
        return self.local_step_interval if self.local_steps == "fixed" else self.local_step_clip

    def interval(self, lr: float) -> int:
        """Sync interval at the current step for learning rate `lr` (does not advance)."""
        t = self.step
        if t < self.var_freeze_step:
            return 1
        if self.local_steps == "fixed":
            return self.local_step_interval
        if self.local_steps == "steps":
            doublings = (t - self.var_freeze_step) // self.local_step_scaler
        else:
            max_lr = max(self.max_lr, lr)
            doublings = math.floor(math.log2(max_lr) - math.log2(lr)) if lr > 0 else 64  # max_lr / lr may overflow
        return min(self.local_step_clip, 2 ** min(doublings, 62))

    def advance(self, lr: float) -> StepDecision:
        """Decide the current step given its learning rate, then move to the next step."""
        interval = self.interval(lr)
        self.max_lr = max(self.max_lr, lr)
        variance_update = self.step == self.next_variance_step and self.step < self.var_freeze_step and interval == 1 and self.steps_since_sync == 0
        if variance_update:
            self.variance_updates += 1
            self.next_variance_step += 2 ** (self.variance_gaps_taken // self.var_update_scaler)
            self.variance_gaps_taken += 1
        # A variance step averages the gradient in full precision on every rank: it is a sync too.
        self.steps_since_sync += 1
        sync = variance_update or self.steps_since_sync >= interval
        if sync:
            self.steps_since_sync = 0
        decision = StepDecision(self.step, variance_update, sync, interval)
        self.step += 1
        return decision

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        """The progress only: the knobs stay the constructor's, so a run resumed with other knobs (its
        recipe's) continues from the saved step under them."""
        for key in PROGRESS:
            setattr(self, key, state[key])


PROGRESS = ("step", "next_variance_step", "variance_gaps_taken", "variance_updates", "steps_since_sync", "max_lr")


def variance_update_bound(beta1: float, beta2: float) -> float:
    """The paper's bound on |T_v|: log(1 - beta1) / log(beta2) (about 2,301 for 0.9 / 0.999)."""
    return math.log(1 - beta1) / math.log(beta2)
