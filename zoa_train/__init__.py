"""zoa-train: communication-efficient distributed training with 0/1 Adam."""

__version__ = "0.1.0"
