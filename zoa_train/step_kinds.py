"""What one optimizer step did, as one character: the alphabet of the `step_kinds` metric.

Written by the optimizers (StepRecord.kind) and the trainer, predicted by `plan`, drawn by `report`.
"""

VARIANCE, FULL, ONEBIT, LOCAL, LOW_RANK, OUTER = "v", "f", "s", "l", "r", "o"
STEP_KINDS = {
    VARIANCE: "variance update (full precision)",  # 0/1 Adam
    FULL: "full-precision step",  # adam every step, 1-bit Adam during its warm-up
    ONEBIT: "1-bit sync",
    LOCAL: "local step (no communication)",  # 0/1 Adam, DiLoCo's inner steps
    LOW_RANK: "low-rank sync (PowerSGD)",
    OUTER: "outer step (averaged pseudo-gradient)",  # DiLoCo
}
