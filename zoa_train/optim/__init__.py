"""0/1 Adam, 1-bit Adam and the data-parallel Adam baseline, their schedules, and the table of optimizers a recipe can name (registry.py, its built-in entries in builtin.py)."""

from zoa_train.optim.adam import DataParallelAdam
from zoa_train.optim.base import DataParallelOptimizer, StepRecord
from zoa_train.optim.lr_schedules import LRSchedule
from zoa_train.optim.onebit_adam import OneBitAdam
from zoa_train.optim.schedules import ZeroOneSchedule, variance_update_bound
from zoa_train.optim.zero_one_adam import ZeroOneAdam

# The built-in optimizers' registry entries: the table (zoa_train/optim/registry.py) is full whenever the
# package is imported.
from zoa_train.optim import builtin  # noqa: E402,F401  isort: skip

__all__ = [
    "DataParallelAdam",
    "DataParallelOptimizer",
    "LRSchedule",
    "OneBitAdam",
    "StepRecord",
    "ZeroOneAdam",
    "ZeroOneSchedule",
    "variance_update_bound",
]
