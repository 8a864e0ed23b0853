"""What one optimizer step did, as one character: the alphabet of the `step_kinds` metric.

Written by the optimizers (StepRecord.kind) and the trainer, predicted by `plan`, drawn by `report`.
"""

VARIANCE, FULL, ONEBIT, LOCAL = "v", "f", "s", "l"
STEP_KINDS = {
    VARIANCE: "variance update (full precision)",  # 0/1 Adam
    FULL: "full-precision step",  # adam every step, 1-bit Adam during its warm-up
    ONEBIT: "1-bit sync",
    LOCAL: "local step (no communication)",  # 0/1 Adam
}
