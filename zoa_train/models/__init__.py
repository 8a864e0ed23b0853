"""Model families by name (zoa_train/models/registry.py) and their builders; nothing is downloaded."""

from zoa_train.models.builders import ModelInputs
from zoa_train.models.registry import ModelSpec, create, register

__all__ = ["ModelInputs", "ModelSpec", "create", "register"]
