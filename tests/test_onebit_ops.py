"""Launch efficiency of the 1-bit allreduce (issue 13, item 6): a call is a fixed number of tensor
ops whatever the number of scale segments (on the torch path plus one per rank; with fused kernels
one per pass and buffer), and an optimizer makes one call per step for all its parameter groups,
with exactly the results of one call per group."""

import functools

import pytest
import torch
from distributed_harness import run_ranks

from zoa_train.bench.comm import count_ops
from zoa_train.comm import CommLedger, OneBitAllReduce
from zoa_train.optim import OneBitAdam, ZeroOneAdam

WHOLE = 1 << 24  # a block holds the whole buffer, as on an accelerator
ROW = 1024
FEW = [48_000 + 7] * 4  # 4 tensors of 47 rows each
MANY = [3_000 + 7] * 64  # 64 tensors of 3 rows each: 16 times the tensor boundaries, the same total


def _ops_per_call(rank, world_size, cases):
    """The ops of one call for each (sizes, kernels) of `cases`."""
    counted = []
    for sizes, kernels in cases:
        comm = OneBitAllReduce(sizes, block_size=WHOLE, scale_row=ROW, ledger=CommLedger(num_params=sum(sizes)), kernels=kernels)
        x = torch.randn(comm.layout.padded)
        comm.op(x)  # warm-up
        counted.append(count_ops(lambda comm=comm, x=x: comm.op(x)))
    return counted


CASES = [(sizes, kernels) for kernels in ("torch", "native") for sizes in (FEW, MANY)]


@pytest.fixture(scope="module")
def ops():
    """{(ranks, case): ops} for CASES on 2 ranks and on 3."""
    return {(n, case): counted for n in (2, 3) for case, counted in enumerate(run_ranks(_ops_per_call, n, CASES)[0])}


@pytest.mark.slow
def test_ops_per_call_do_not_grow_with_scale_segments_or_ranks(ops):
    few, many = sum(ops[2, 0].values()), sum(ops[2, 1].values())  # the torch path
    assert few == many, (few, many)
    assert few < 50  # a few dozen ops per call, the two collectives included
    # The server sums the ranks' terms in order, one op per rank; nothing else depends on n.
    assert sum(ops[3, 1].values()) == many + 1 and sum(ops[3, 0].values()) == few + 1


@pytest.mark.slow
def test_fused_kernels_make_one_pass_each_and_the_two_collectives(ops):
    passes = {"zoa::onebit_worker": 1, "zoa::onebit_server": 1, "zoa::onebit_output": 1}
    for n, case in ((2, 2), (2, 3), (3, 2), (3, 3)):
        assert {name: count for name, count in ops[n, case].items() if name.startswith("zoa::")} == passes
        assert sum(ops[n, case].values()) == 3 + 2, ops[n, case]  # and the all_to_all and the all_gather


ROWS_OF_64 = functools.partial(OneBitAllReduce, scale_row=64)  # rows short enough for these small tensors


def _train(rank, world_size, name, per_group):
    torch.manual_seed(0)
    emb, lin, norm = torch.nn.Embedding(300, 40), torch.nn.Linear(40, 37), torch.nn.LayerNorm(40)
    groups = [
        {"params": [emb.weight, lin.weight], "weight_decay": 0.01},
        {"params": [lin.bias, norm.weight, norm.bias], "weight_decay": 0.0, "lr": 0.02},
    ]
    if name == "zero_one":
        make = lambda g: ZeroOneAdam(g, lr=0.01, var_freeze_step=10, var_update_scaler=2, local_steps="fixed", local_step_interval=3, collective=ROWS_OF_64)  # noqa: E731
    else:
        make = lambda g: OneBitAdam(g, lr=0.01, freeze_step=5, collective=ROWS_OF_64)  # noqa: E731
    optimizers = [make([group]) for group in groups] if per_group else [make(groups)]
    calls = []
    for t in range(20):
        g = torch.Generator().manual_seed(100 * rank + t)
        tokens = torch.randint(0, 200, (16,), generator=g)
        loss = torch.nn.functional.cross_entropy(lin(norm(emb(tokens))), torch.randint(0, 37, (16,), generator=g))
        for opt in optimizers:
            opt.zero_grad()
        loss.backward()
        before = [opt.ledger.by_kind.get("onebit_allreduce", {}).get("calls", 0) for opt in optimizers]
        for opt in optimizers:
            opt.step()
        after = [opt.ledger.by_kind.get("onebit_allreduce", {}).get("calls", 0) for opt in optimizers]
        calls.append(sum(after) - sum(before))  # collective calls: two per 1-bit call
    params = [p.detach().clone() for group in groups for p in group["params"]]
    momenta = [b["exp_avg"].clone() for opt in optimizers for b in opt._buffers]
    errors = [s["worker_error"] for opt in optimizers for s in opt.rank_state_dict()["zoa_rank"]["comms"]]
    return params, momenta, errors, calls


@pytest.mark.slow
def test_one_onebit_call_per_step_for_all_groups_with_the_results_of_one_call_per_group():
    for name in ("zero_one", "onebit"):
        joined = run_ranks(_train, 2, name, False)
        split = run_ranks(_train, 2, name, True)
        for (params, momenta, errors, calls), (params1, momenta1, errors1, calls1) in zip(joined, split):
            assert all(torch.equal(a, b) for a, b in zip(params + momenta + errors, params1 + momenta1 + errors1)), name
            assert sum(calls) > 0 and set(calls) <= {0, 2}, (name, calls)  # one 1-bit call (two passes) or none
            assert calls1 == [2 * c for c in calls], name  # where one call per group makes two


@pytest.mark.slow  # starts 2 ranks: about 10 s
def test_a_successful_bench_ops_prints_no_error_line():
    """On a machine without CUDA, a CUDA build's profiler logged "ERROR: ... gpuGetDeviceCount failed" in a
    run that succeeded (issue 49). The smallest run bench ops takes: one element per tensor, one call."""
    import json
    import os

    from conftest import zoa

    env = {key: value for key, value in os.environ.items() if key != "KINETO_LOG_LEVEL"}
    done = zoa("bench", "ops", "--scale", "31254528", "--calls", "1", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ERROR" not in done.stdout + done.stderr, done.stderr[-3000:]
    assert json.loads(done.stdout)["ops_per_step"] > 0
