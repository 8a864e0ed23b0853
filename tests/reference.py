"""Single-process references of the project's math, written plainly for tests to compare against."""

import math

import torch


def sign(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0, 1.0, -1.0)


def onebit_allreduce_reference(inputs, worker_errors, server_errors, numel):
    """Emulate one OneBitAllReduce call on n ranks. Returns (output, new worker errors, new server errors)."""
    n = len(inputs)
    padded = math.ceil(numel / (8 * n)) * 8 * n
    chunk = padded // n
    ys, signs, new_we = [], [], []
    scales = []
    for x, e in zip(inputs, worker_errors):
        y = e.clone()
        y[:numel] += x.float().reshape(-1)
        s = torch.linalg.vector_norm(y) / math.sqrt(numel)
        sg = sign(y)
        err = y - s * sg
        err[numel:] = 0
        scales.append(s)
        signs.append(sg)
        new_we.append(err)
    out = torch.empty(padded)
    new_se = []
    for j in range(n):
        c = server_errors[j].clone()
        for i in range(n):
            c += (scales[i] / n) * signs[i][j * chunk : (j + 1) * chunk]
        valid = min(max(numel - j * chunk, 0), chunk)
        c[valid:] = 0
        ss = torch.linalg.vector_norm(c) / math.sqrt(max(valid, 1))
        sc = sign(c)
        e = c - ss * sc
        e[valid:] = 0
        new_se.append(e)
        out[j * chunk : (j + 1) * chunk] = ss * sc
    return out[:numel], new_we, new_se
