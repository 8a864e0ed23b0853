"""The trainer: distributed set-up, the training loop, checkpoints and logging."""
