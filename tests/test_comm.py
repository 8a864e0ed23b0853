import math

import pytest
import torch

from distributed_harness import run_ranks
from reference import onebit_allreduce_reference
from zoa_train.comm import CommLedger, OneBitAllReduce, allreduce, pack_signs, unpack_signs

# (name, numel, dtype, zeros)
CASES = [
    ("length-1", 1, torch.float32, False),
    ("odd-length", 8 * 4 * 3 + 5, torch.float32, False),
    ("multi-block", 1000, torch.float32, False),
    ("all-zero", 77, torch.float32, True),
    ("bf16", 515, torch.bfloat16, False),
]


def _input(case: int, call: int, rank: int, numel: int, dtype, zeros: bool) -> torch.Tensor:
    if zeros:
        return torch.zeros(numel, dtype=dtype)
    g = torch.Generator().manual_seed(1000 * case + 10 * call + rank)
    return (torch.randn(numel, generator=g) * (rank + 1)).to(dtype)


def _run_cases(rank, world_size):
    results = []
    for case, (_, numel, dtype, zeros) in enumerate(CASES):
        # A small block size makes every buffer span several blocks.
        comm = OneBitAllReduce(numel, block_size=64, ledger=CommLedger(num_params=numel))
        calls = []
        for call in range(3):
            x = _input(case, call, rank, numel, dtype, zeros)
            out = comm.op(x.clone())
            calls.append({"out": out, "worker_error": comm.worker_error.clone(), "server_error": comm.server_error.clone()})
        results.append(calls)
    return results


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_onebit_allreduce_matches_reference_and_is_identical_on_all_ranks(world_size):
    ranks = run_ranks(_run_cases, world_size)
    for case, (name, numel, dtype, zeros) in enumerate(CASES):
        n = world_size
        padded = math.ceil(numel / (8 * n)) * 8 * n
        worker_errors = [torch.zeros(padded) for _ in range(n)]
        server_errors = [torch.zeros(padded // n) for _ in range(n)]
        for call in range(3):
            inputs = [_input(case, call, r, numel, dtype, zeros) for r in range(n)]
            ref, worker_errors, server_errors = onebit_allreduce_reference(inputs, worker_errors, server_errors, numel)
            for r in range(n):
                got = ranks[r][case][call]
                assert got["out"].dtype == dtype, name
                assert torch.equal(got["out"], ranks[0][case][call]["out"]), f"{name}: rank {r} differs from rank 0"
                torch.testing.assert_close(got["out"].float(), ref.to(dtype).float(), rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(got["worker_error"], worker_errors[r], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(got["server_error"], server_errors[r], rtol=1e-5, atol=1e-5)
        if zeros:
            assert all(torch.count_nonzero(ranks[r][case][2]["out"]) == 0 for r in range(n))


def _error_feedback(rank, world_size, numel, calls):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(numel, generator=g) + 0.5 * rank
    comm = OneBitAllReduce(numel, ledger=CommLedger(num_params=numel))
    total = torch.zeros(numel)
    errors = {}
    for k in range(1, calls + 1):
        total += comm.op(x.clone())
        errors[k] = total / k
    return x, errors


def test_error_feedback_running_mean_converges_like_one_over_k():
    ranks = run_ranks(_error_feedback, 2, 4096, 100)
    exact = (ranks[0][0] + ranks[1][0]) / 2

    def rel(k):
        return (torch.linalg.vector_norm(ranks[0][1][k] - exact) / torch.linalg.vector_norm(exact)).item()

    assert rel(1) > 0.5  # one call really is lossy
    assert rel(100) < rel(1) / 12
    assert rel(100) < rel(25) / 2.5  # 1/K would give 4: the carried error stays bounded


def _ledger_sequence(rank, world_size):
    ledger = CommLedger(num_params=1000)
    comm = OneBitAllReduce(1000, ledger=ledger)
    comm.op(torch.ones(1000))
    step1 = ledger.end_step()
    step2 = ledger.end_step()  # a local step: nothing sent
    allreduce(torch.ones(1000), ledger=ledger)
    allreduce(torch.ones(500), ledger=ledger, comm_dtype=torch.bfloat16)
    step3 = ledger.end_step()
    return step1, step2, step3, ledger.summary(), comm.bytes_per_call


def test_ledger_totals_for_a_known_sequence():
    step1, step2, step3, summary, onebit_bytes = run_ranks(_ledger_sequence, 2)[0]
    # 1000 elements on 2 ranks: chunks of 504 -> 63 bytes of signs + 4 of scale, one segment per pass.
    assert onebit_bytes == 2 * (63 + 4)
    assert (step1.bits_per_param, step1.round, step1.bytes_sent, step1.calls) == (1.0, True, 134, 2)
    assert (step2.bits_per_param, step2.round, step2.bytes_sent, step2.calls) == (0.0, False, 0, 0)
    assert step3.bits_per_param == 32 + 16 * 0.5
    assert step3.bytes_sent == 1000 * 4 + 500 * 2  # ring allreduce on 2 ranks sends N*size bytes
    assert summary == {"steps": 3, "bits_per_param": (1 + 0 + 40) / 3, "rounds": 2, "bytes_sent": 134 + 5000, "collective_calls": 4}


def test_world_size_one_returns_input_unchanged():
    x = torch.randn(37)
    comm = OneBitAllReduce(37)
    assert comm.op(x) is x
    assert torch.equal(x, x.clone())
    assert comm.padded_numel == 0


@pytest.mark.parametrize("n", [1, 7, 8, 9, 64, 1001])
def test_pack_unpack_round_trip(n):
    x = torch.randn(n)
    x[::5] = 0.0
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == (n + 7) // 8
    expected = torch.where(x >= 0, 1.0, -1.0)
    assert torch.equal(unpack_signs(packed, n), expected)
    assert torch.equal(unpack_signs(packed, n, scale=2.5), 2.5 * expected)


def test_pack_bit_order_and_zero_is_positive():
    x = torch.tensor([-1.0, 0.0, -0.0, -3.0, 2.0, -1.0, -1.0, 5.0, -2.0])
    packed = pack_signs(x)
    # element 8*i+k is bit k of byte i, set when >= 0 (zero and negative zero count as +1)
    assert packed.tolist() == [0b10010110, 0b11111110]


def test_unpack_into_bf16_output():
    x = torch.randn(20)
    out = torch.empty(20, dtype=torch.bfloat16)
    unpack_signs(pack_signs(x), 20, out=out)
    assert torch.equal(out, torch.where(x >= 0, 1.0, -1.0).bfloat16())
