"""Precision names as recipes write them (fp32, bf16, fp16), their torch dtypes, and autocast."""

import contextlib

import torch

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device):
    """torch.autocast for a recipe's precision, or a null context for fp32."""
    dtype = DTYPES[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
