"""Evaluation of trained models: `zoa-train eval ...` (ImageNet top-1/top-5)."""
