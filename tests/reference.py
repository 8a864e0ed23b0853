"""Single-process references of the project's math, written plainly for tests to compare against."""

import math

import torch


def sign(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0, 1.0, -1.0)


def onebit_allreduce_reference(inputs, worker_errors, server_errors, numel, scale_row):
    """Emulate one OneBitAllReduce call on n ranks with one scale per row of `scale_row` elements
    (each chunk cut into equal rows, a multiple of 32). Returns (output, new worker errors, new
    server errors)."""
    n = len(inputs)
    need = math.ceil(numel / n)
    rows = math.ceil(need / max(32, scale_row))
    row = math.ceil(need / (rows * 32)) * 32
    chunk = rows * row
    padded = n * chunk

    def compress(y, first):
        """Per row: scale = RMS over its real elements, the scaled signs, the error."""
        scaled = torch.zeros_like(y)
        for r in range(0, y.numel(), row):
            real = min(max(numel - (first + r), 0), row)
            part = y[r : r + row]
            s = torch.linalg.vector_norm(part) / math.sqrt(max(real, 1))
            scaled[r : r + row] = s * sign(part)
        error = y - scaled
        error[max(numel - first, 0) :] = 0
        return scaled, error

    sent, new_we = [], []
    for x, e in zip(inputs, worker_errors):
        y = e.clone()
        y[:numel] += x.float().reshape(-1)
        scaled, error = compress(y, 0)
        sent.append(scaled)
        new_we.append(error)
    out = torch.empty(padded)
    new_se = []
    for j in range(n):
        c = server_errors[j].clone()
        for i in range(n):
            c += sent[i][j * chunk : (j + 1) * chunk] / n
        c[max(numel - j * chunk, 0) :] = 0
        scaled, error = compress(c, j * chunk)
        new_se.append(error)
        out[j * chunk : (j + 1) * chunk] = scaled
    return out[:numel], new_we, new_se


def zero_one_adam_reference(x0, grad_fn, world_size, steps, lr_fn, schedule, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
    """0/1 Adam (Algorithm 1) on `world_size` emulated ranks with an exact average in place of the
    1-bit allreduce. grad_fn(rank, step, x) gives each rank's gradient. Returns (xs, ms) per rank."""
    b1, b2 = betas
    n = world_size
    xs = [x0.clone() for _ in range(n)]
    ms = [torch.zeros_like(x0) for _ in range(n)]
    us = [torch.zeros_like(x0) for _ in range(n)]
    v = torch.zeros_like(x0)
    anchor, lr_sum, decay = x0.clone(), 0.0, 1.0
    for t in range(steps):
        lr = lr_fn(t)
        decision = schedule.advance(lr)
        grads = [grad_fn(r, t, xs[r]) for r in range(n)]
        if decision.variance_update:
            g = sum(grads) / n
            v = b2 * v + (1 - b2) * g * g
            m = b1 * ms[0] + (1 - b1) * g
            x = xs[0] * (1 - lr * weight_decay) - lr * m / (v.sqrt() + eps)
            xs, ms = [x.clone() for _ in range(n)], [m.clone() for _ in range(n)]
            anchor, lr_sum, decay = x.clone(), 0.0, 1.0
            continue
        denom = v.sqrt() + eps
        for r in range(n):
            ms[r] = b1 * ms[r] + (1 - b1) * grads[r]
            us[r] = us[r] + lr * ms[r]
        lr_sum += lr
        decay *= 1 - lr * weight_decay
        if decision.sync:
            u_bar = sum(us) / n
            u_bar[v == 0] = 0
            x = anchor * decay - u_bar / denom
            m = u_bar / lr_sum
            xs, ms, us = [x.clone() for _ in range(n)], [m.clone() for _ in range(n)], [torch.zeros_like(x0) for _ in range(n)]
            anchor, lr_sum, decay = x.clone(), 0.0, 1.0
        else:
            xs = [xs[r] * (1 - lr * weight_decay) - lr * ms[r] / denom for r in range(n)]
    return xs, ms
