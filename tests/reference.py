"""Single-process references of the project's math, written plainly for tests to compare against."""

import math

import torch
import torch.distributed as dist

from zoa_train.comm import allreduce, onebit_layout


def sign(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0, 1.0, -1.0)


def onebit_allreduce_reference(inputs, worker_errors, server_errors, real, row):
    """Emulate one OneBitAllReduce call on n ranks. `inputs` are buffers in the layout, `real`
    marks their non-padding elements, `row` is the layout's row length; each rank's chunk is
    1/n of the buffer. Per row: scale = RMS over the row's real elements, padding counts as zero
    and keeps no error. Returns (output, new worker errors, new server errors)."""
    n = len(inputs)
    padded = real.numel()
    chunk = padded // n

    def compress(y, first):
        y = torch.where(real[first : first + y.numel()], y, 0.0)
        scaled = torch.zeros_like(y)
        for r in range(0, y.numel(), row):
            count = int(real[first + r : first + r + row].sum())
            s = torch.linalg.vector_norm(y[r : r + row]) / math.sqrt(max(count, 1))
            scaled[r : r + row] = s * sign(y[r : r + row])
        error = torch.where(real[first : first + y.numel()], y - scaled, 0.0)
        return scaled, error

    sent, new_we = [], []
    for x, e in zip(inputs, worker_errors):
        scaled, error = compress(e + x.float(), 0)
        sent.append(scaled)
        new_we.append(error)
    out = torch.empty(padded)
    new_se = []
    for j in range(n):
        c = server_errors[j] + sum(s[j * chunk : (j + 1) * chunk] for s in sent) / n
        scaled, error = compress(c, j * chunk)
        new_se.append(error)
        out[j * chunk : (j + 1) * chunk] = scaled
    return torch.where(real, out, 0.0), new_we, new_se


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
            xs = [xs[r] - lr * ms[r] / denom for r in range(n)]  # the period's weight decay comes at its sync
    return xs, ms


class ExactAllReduce:
    """A collective (zoa_train.comm.protocol) that averages exactly, in fp32, with the tensors back to
    back: passed as an optimizer's `collective`, it leaves the optimizer's own algebra to be checked
    against Algorithm 1 without compression noise (and as the node-aware sync's `inter`, given its
    shards' `layouts`, that sync's composition)."""

    def __init__(self, sizes, *, group=None, device=None, ledger=None, layouts=None):
        self.group, self.ledger = group, ledger
        self.layouts = layouts if layouts is not None else [onebit_layout(s, 1) for s in sizes]
        self.accumulators = [torch.zeros(l.padded, device=device) for l in self.layouts]

    def exchange(self, out, addend=None):
        for o, acc, a in zip(out, self.accumulators, addend if addend is not None else [None] * len(out)):
            torch.add(acc, a, out=o) if a is not None else o.copy_(acc)
            dist.all_reduce(o, group=self.group)
            o.div_(dist.get_world_size(self.group))
            acc.zero_()
        return out

    def op(self, tensors):
        for t, acc in zip(tensors, self.accumulators):
            acc.copy_(t)
        return self.exchange(tensors)

    def allreduce(self, tensor, comm_dtype=None, elements=None, in_step=True):  # the flat full-precision round
        return allreduce(tensor, group=self.group, ledger=self.ledger, comm_dtype=comm_dtype, elements=elements, in_step=in_step)

    def state_dicts(self):
        return [{"accumulator": acc.clone()} for acc in self.accumulators]

    def load_state_dicts(self, states):
        for acc, state in zip(self.accumulators, states):
            acc.copy_(state["accumulator"])

    def layout_state(self):
        return [{"offsets": list(l.offsets), "padded": l.padded} for l in self.layouts]

    def relayout(self, flat, index, saved):
        return flat.clone()  # back to back at any world size


def zero_one_counts_reference(steps, lr, var_freeze_step, kappa, policy, clip=16, scaler=32_678, fixed=1):
    """0/1 Adam's communication over a run, counted from docs/algorithm.md's definitions alone (not
    through ZeroOneSchedule): T_v = {k_0 = 0, k_{j+1} = k_j + 2^floor(j / kappa)} below the freeze;
    every step syncs until the freeze, then once `interval` steps have passed since the last sync."""
    variance, k, j = set(), 0, 0
    while k < var_freeze_step:
        variance.add(k)
        k, j = k + 2 ** (j // kappa), j + 1
    syncs, since, peak = 0, 0, 0.0
    for t in range(steps):
        peak = max(peak, lr(t))
        if t < var_freeze_step:
            interval = 1
        elif policy == "fixed":
            interval = fixed
        elif policy == "steps":
            interval = min(clip, 2 ** ((t - var_freeze_step) // scaler))
        else:  # "lr": doubles each time the lr halves from its peak so far
            interval = min(clip, 2 ** math.floor(math.log2(peak / lr(t))))
        since += 1
        if t in variance or since >= interval:
            syncs, since = syncs + 1, 0
    updates = sum(1 for k in variance if k < steps)
    return {"variance_updates": updates, "onebit_allreduces": syncs - updates, "rounds": syncs}


def topk_allreduce_reference(inputs, errors, real, chunk, k, decay):
    """Emulate one TopKAllReduce call on n ranks, element by element (zoa_train/comm/topk.py's module
    docstring is the specification). `inputs` and `errors` are each rank's fp32 buffers in the layout,
    `real` marks their non-padding elements, chunks are consecutive runs of `chunk` elements. Returns
    (average, new errors, each rank's message as (levels: a list of (lo, hi) per chunk, slot bytes))."""
    width = max(1, (chunk - 1).bit_length()) + 2
    decoded, messages, new_errors = [], [], []
    for x, e in zip(inputs, errors):
        y = e + x
        mine = torch.zeros_like(y)
        levels, bits = [], []
        for start in range(0, y.numel(), chunk):
            here = range(start, start + chunk)
            ranked = sorted(here, key=lambda i: (0, -abs(float(y[i])), i) if real[i] else (1, 0.0, i))
            chosen = sorted(ranked[:k])
            size = {i: abs(float(y[i])) if real[i] else 0.0 for i in chosen}
            counted = [i for i in chosen if real[i]]
            mean = sum(size[i] for i in counted) / max(len(counted), 1)
            big = {i: size[i] >= mean for i in chosen}
            small_ones, big_ones = [i for i in counted if not big[i]], [i for i in counted if big[i]]
            lo = sum(size[i] for i in small_ones) / max(len(small_ones), 1)
            hi = sum(size[i] for i in big_ones) / max(len(big_ones), 1)
            lo, hi = float(torch.tensor(lo, dtype=torch.float32)), float(torch.tensor(hi, dtype=torch.float32))  # sent as fp32
            levels.append((lo, hi))
            for i in chosen:
                negative = float(y[i]) < 0
                slot = (i - start) | ((2 * negative + big[i]) << (width - 2))
                bits += [(slot >> b) & 1 for b in range(width)]
                if real[i]:
                    mine[i] = (-1.0 if negative else 1.0) * (hi if big[i] else lo)
        bits += [0] * (-len(bits) % 8)
        slot_bytes = bytes(sum(bits[j + b] << b for b in range(8)) for j in range(0, len(bits), 8))
        messages.append((levels, slot_bytes))
        decoded.append(mine)
        new_errors.append((y - mine) * decay)
    total = decoded[0].clone()
    for d in decoded[1:]:
        total += d
    return total / len(inputs), new_errors, messages
