import pytest
import torch

from distributed_harness import run_ranks
from reference import onebit_allreduce_reference
from zoa_train.comm import CommLedger, OneBitAllReduce, allreduce, onebit_layout, pack_signs, unpack_signs
from zoa_train.comm.onebit import SCALE_ROW, onebit_buffers

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


# (scale_row, block_size): rows of 32 processed two at a time make every buffer span several
# rows and blocks; the defaults give one row per chunk for these sizes.
LAYOUTS = [(32, 64), (SCALE_ROW, None)]


def _run_cases(rank, world_size):
    results = []
    for case, (_, numel, dtype, zeros) in enumerate(CASES):
        for scale_row, block_size in LAYOUTS:
            comm = OneBitAllReduce(numel, block_size=block_size, scale_row=scale_row, ledger=CommLedger(num_params=numel))
            calls = []
            for call in range(3):
                x = _input(case, call, rank, numel, dtype, zeros)
                out = comm.op(x.clone())
                calls.append({"out": out, "worker_error": comm.worker_error, "server_error": comm.server_error})
            results.append(calls)
    return results


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_onebit_allreduce_matches_reference_and_is_identical_on_all_ranks(world_size):
    ranks = run_ranks(_run_cases, world_size)
    n = world_size
    for case, (name, numel, dtype, zeros) in enumerate(CASES):
        for index, (scale_row, _) in enumerate(LAYOUTS):
            result = case * len(LAYOUTS) + index
            layout = onebit_layout(numel, n, scale_row)
            worker_errors = [torch.zeros(layout.padded) for _ in range(n)]
            server_errors = [torch.zeros(layout.chunk) for _ in range(n)]
            for call in range(3):
                inputs = [_input(case, call, r, numel, dtype, zeros) for r in range(n)]
                ref, worker_errors, server_errors = onebit_allreduce_reference(inputs, worker_errors, server_errors, numel, scale_row)
                for r in range(n):
                    got = ranks[r][result][call]
                    assert got["out"].dtype == dtype, name
                    assert torch.equal(got["out"], ranks[0][result][call]["out"]), f"{name}: rank {r} differs from rank 0"
                    torch.testing.assert_close(got["out"].float(), ref.to(dtype).float(), rtol=1e-5, atol=1e-5)
                    torch.testing.assert_close(got["worker_error"], worker_errors[r], rtol=1e-5, atol=1e-5)
                    torch.testing.assert_close(got["server_error"], server_errors[r], rtol=1e-5, atol=1e-5)
            if zeros:
                assert all(torch.count_nonzero(ranks[r][result][2]["out"]) == 0 for r in range(n))


def test_layout_rows_cover_the_buffer_with_little_padding():
    for numel, n, scale_row in [(1, 2, 64), (1000, 3, 64), (10**6, 8, SCALE_ROW), (3 * SCALE_ROW + 1, 1 + 1, SCALE_ROW)]:
        layout = onebit_layout(numel, n, scale_row)
        assert layout.padded == n * layout.chunk == n * layout.rows * layout.row >= numel
        assert layout.row % 32 == 0 and layout.row <= max(32, scale_row)
        assert layout.padded - numel < n * layout.rows * 32  # under 32 elements of padding per row
        assert layout.segment == layout.chunk // 8 + 4 * layout.rows


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


def _layered_call_errors(rank, world_size, scale_rows):
    """One call's relative error in each of six "layers" of 4096 elements whose magnitudes span 1e-3..1e2."""
    g = torch.Generator().manual_seed(rank)
    x = torch.cat([torch.randn(4096, generator=g) * 10.0**k for k in range(-3, 3)])
    exact = x.clone()
    torch.distributed.all_reduce(exact)
    exact /= world_size
    errors = {}
    for scale_row in scale_rows:
        out = OneBitAllReduce(x.numel(), scale_row=scale_row, ledger=CommLedger(num_params=x.numel())).op(x.clone())
        layer_errors = torch.linalg.vector_norm((out - exact).view(6, -1), dim=1) / torch.linalg.vector_norm(exact.view(6, -1), dim=1)
        errors[scale_row] = layer_errors.tolist()
    return errors


def test_row_scales_follow_the_magnitude_of_each_part_of_the_buffer():
    # rows of 4096 match the layers; rows of 1M give one scale per chunk
    errors = run_ranks(_layered_call_errors, 2, [4096, 1 << 20])[0]
    assert max(errors[4096]) < 1.5  # every layer gets about one call's usual error (~0.93)
    assert max(errors[1 << 20]) > 20  # one scale per chunk: its small layers drown in its large ones


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
    # 1000 elements on 2 ranks: chunks of 512 (one row, a multiple of 32) -> 64 bytes of signs
    # + 4 of scale, one segment per pass.
    assert onebit_bytes == 2 * (64 + 4)
    assert (step1.bits_per_param, step1.round, step1.bytes_sent, step1.calls) == (1.0, True, 136, 2)
    assert (step2.bits_per_param, step2.round, step2.bytes_sent, step2.calls) == (0.0, False, 0, 0)
    assert step3.bits_per_param == 32 + 16 * 0.5
    assert step3.bytes_sent == 1000 * 4 + 500 * 2  # ring allreduce on 2 ranks sends N*size bytes
    assert summary == {"steps": 3, "bits_per_param": (1 + 0 + 40) / 3, "rounds": 2, "bytes_sent": 136 + 5000, "collective_calls": 4}


def _allocated(rank, world_size, numel):
    comm = OneBitAllReduce(numel, ledger=CommLedger(num_params=numel))
    return {name: getattr(comm, name).numel() * getattr(comm, name).element_size() for name in onebit_buffers(numel, world_size)}


@pytest.mark.parametrize("world_size", [1, 2])
def test_buffer_sizes_follow_the_layout(world_size):
    # bench optim counts memory from onebit_buffers: what an instance holds, in bytes.
    numel = 3 * SCALE_ROW + 1001
    held = run_ranks(_allocated, world_size, numel)[0] if world_size > 1 else _allocated(0, 1, numel)
    if world_size == 1:  # inactive: the accumulator only
        assert held["_worker"] == 4 * numel and all(size == 0 for name, size in held.items() if name != "_worker")
        return
    layout = onebit_layout(numel, world_size)
    per_rank = -(-numel // 2)  # 1.5 rows of SCALE_ROW: two equal rows, rounded up to 32
    assert (layout.rows, layout.row) == (2, -(-per_rank // 64) * 32)
    assert held["_worker"] == 4 * layout.padded and held["_server"] == 4 * layout.chunk
    assert held["_send"] == held["_recv"] == held["_gathered"] == 2 * held["_mine"] == 2 * (layout.chunk // 8 + 4 * 2)
    assert held["_flags"] == 4 * layout.row and held["_server_coef"] == 4 * 3 * 2  # one row per CPU block


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
