import pytest
import torch
from distributed_harness import run_ranks
from reference import onebit_allreduce_reference

from zoa_train.comm import CommLedger, OneBitAllReduce, allreduce, onebit_layout, pack_signs, unpack_signs
from zoa_train.comm.onebit import SCALE_ROW, onebit_buffers

# (name, tensor sizes, dtype, zeros)
CASES = [
    ("length-1", [1], torch.float32, False),
    ("odd-length", [8 * 4 * 3 + 5], torch.float32, False),
    ("multi-block", [1000], torch.float32, False),
    ("all-zero", [77], torch.float32, True),
    ("bf16", [515], torch.bfloat16, False),
    # large tensors on their own rows, runs of small ones packed, an empty one
    ("tensors", [300, 5, 7, 0, 64, 1000, 3, 40], torch.float32, False),
]


def real_mask(layout) -> torch.Tensor:
    """True at the elements of the layout's tensors, False at padding."""
    real = torch.zeros(layout.padded, dtype=torch.bool)
    for offset, size in zip(layout.offsets, layout.sizes):
        real[offset : offset + size] = True
    return real


def _input(case: int, call: int, rank: int, layout, dtype, zeros: bool) -> torch.Tensor:
    """A buffer in the layout: random tensors (scaled by rank), zero padding."""
    x = torch.zeros(layout.padded)
    if not zeros:
        g = torch.Generator().manual_seed(1000 * case + 10 * call + rank)
        x[real_mask(layout)] = torch.randn(layout.numel, generator=g) * (rank + 1)
    return x.to(dtype)


# (scale_row, block_size): rows of 32 processed two at a time make every buffer span several
# rows and blocks; the defaults give one row per chunk for these sizes.
LAYOUTS = [(32, 64), (SCALE_ROW, None)]


def _run_cases(rank, world_size, kernels):
    results = []
    for case, (_, sizes, dtype, zeros) in enumerate(CASES):
        for scale_row, block_size in LAYOUTS:
            comm = OneBitAllReduce(sizes, block_size=block_size, scale_row=scale_row, ledger=CommLedger(num_params=sum(sizes)), kernels=kernels)
            calls = []
            for call in range(3):
                x = _input(case, call, rank, comm.layout, dtype, zeros)
                out = comm.op(x.clone())
                calls.append({"out": out, "worker_error": comm.worker_error, "server_error": comm.server_error})
            results.append(calls)
    return results


@pytest.mark.parametrize("world_size, kernels", [(3, "torch"), (2, "native"), (3, "native"), (4, "native"), (3, "triton")])
def test_onebit_allreduce_matches_reference_and_is_identical_on_all_ranks(world_size, kernels, monkeypatch):
    if kernels == "triton":  # Triton's interpreter runs the GPU kernels on CPU tensors (the spawned ranks inherit it)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    ranks = run_ranks(_run_cases, world_size, kernels)
    n = world_size
    for case, (name, sizes, dtype, zeros) in enumerate(CASES):
        for index, (scale_row, _) in enumerate(LAYOUTS):
            result = case * len(LAYOUTS) + index
            layout = onebit_layout(sizes, n, scale_row)
            real = real_mask(layout)
            worker_errors = [torch.zeros(layout.padded) for _ in range(n)]
            server_errors = [torch.zeros(layout.chunk) for _ in range(n)]
            for call in range(3):
                inputs = [_input(case, call, r, layout, dtype, zeros) for r in range(n)]
                ref, worker_errors, server_errors = onebit_allreduce_reference(inputs, worker_errors, server_errors, real, layout.row)
                for r in range(n):
                    got = ranks[r][result][call]
                    assert got["out"].dtype == dtype, name
                    assert torch.equal(got["out"], ranks[0][result][call]["out"]), f"{name}: rank {r} differs from rank 0"
                    assert not got["out"][~real].any(), f"{name}: padding of the output is not zero"
                    torch.testing.assert_close(got["out"].float(), ref.to(dtype).float(), rtol=1e-5, atol=1e-5)
                    torch.testing.assert_close(got["worker_error"], worker_errors[r], rtol=1e-5, atol=1e-5)
                    torch.testing.assert_close(got["server_error"], server_errors[r], rtol=1e-5, atol=1e-5)
            if zeros:
                assert all(torch.count_nonzero(ranks[r][result][2]["out"]) == 0 for r in range(n))


def test_layout_rows_cover_the_buffer_with_little_padding():
    for numel, n, scale_row in [(1, 2, 64), (1000, 3, 64), (10**6, 8, SCALE_ROW), (3 * SCALE_ROW + 1, 2, SCALE_ROW), (3 * 512 + 1, 2, 1024)]:
        layout = onebit_layout(numel, n, scale_row)
        assert layout.offsets == (0,)
        assert layout.padded == n * layout.chunk == n * layout.rows * layout.row >= numel
        assert layout.row % 32 == 0 and layout.row <= max(32, scale_row)
        assert layout.padded - numel < n * layout.rows * 32  # under 32 elements of padding per row
        assert layout.segment == layout.chunk // 8 + 4 * layout.rows


@pytest.mark.parametrize("world_size", [2, 8])
def test_layout_rows_never_mix_a_tensor_of_a_row_or_more_with_another(world_size):
    g = torch.Generator().manual_seed(world_size)
    sizes = [int(s) for s in torch.randint(0, 3 * SCALE_ROW, (40,), generator=g)]
    sizes[5:12] = [3, 700, 11, 0, 128, 1, 4096]  # a run of small tensors, an empty one, one of exactly a row
    layout = onebit_layout(sizes, world_size)
    row = layout.row
    assert row == SCALE_ROW
    owner = torch.full((layout.padded,), -1)
    for index, (offset, size) in enumerate(zip(layout.offsets, layout.sizes)):
        assert (owner[offset : offset + size] == -1).all(), "tensors overlap"
        owner[offset : offset + size] = index
        if size >= row:
            assert offset % row == 0, "a tensor of a row or more starts on a row boundary"
    assert list(layout.offsets) == sorted(layout.offsets)
    for r in range(layout.padded // row):
        tensors = set(owner[r * row : (r + 1) * row].tolist()) - {-1}
        assert len(tensors) <= 1 or all(sizes[t] < row for t in tensors), f"row {r} mixes {tensors}"
    assert layout.padded == world_size * layout.chunk
    runs = 1 + sum(1 for a, b in zip(sizes, sizes[1:]) if not (a < row and b < row))
    assert layout.padded - layout.numel < (runs + world_size) * row
    assert torch.equal(layout.row_lengths(), (owner.view(-1, row) >= 0).sum(dim=1))


def _error_feedback(rank, world_size, numel, calls, kernels_list):
    """Per kernels: this rank's fixed input and the running means of `calls` calls on it."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(numel, generator=g) + 0.5 * rank
    means = {}
    for kernels in kernels_list:
        comm = OneBitAllReduce(numel, ledger=CommLedger(num_params=numel), kernels=kernels)
        assert comm.layout.padded == numel  # no padding here: x is a buffer in the layout
        total = torch.zeros(numel)
        means[kernels] = {}
        for k in range(1, calls + 1):
            total += comm.op(x.clone())
            means[kernels][k] = total / k
    return x, means


def test_error_feedback_running_mean_converges_like_one_over_k(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the spawned ranks run the Triton kernels through the interpreter
    rels = {}
    ranks = run_ranks(_error_feedback, 2, 4096, 100, ("torch", "native", "triton"))
    exact = (ranks[0][0] + ranks[1][0]) / 2
    for kernels in ("torch", "native", "triton"):

        def rel(k, kernels=kernels):
            return (torch.linalg.vector_norm(ranks[0][1][kernels][k] - exact) / torch.linalg.vector_norm(exact)).item()

        assert rel(1) > 0.5  # one call really is lossy
        assert rel(100) < rel(1) / 12
        assert rel(100) < rel(25) / 2.5  # 1/K would give 4: the carried error stays bounded
        rels[kernels] = [rel(k) for k in (1, 25, 100)]
    # The fused kernels carry the same error: their running means track the torch path's call by call
    for kernels in ("native", "triton"):
        for fused, unfused in zip(rels[kernels], rels["torch"]):
            assert abs(fused - unfused) <= 0.02 * unfused, rels


LAYERS = [3000, 5000, 1000, 4000, 2000, 6000]  # sizes that are no multiple of any row


def _layered_call_errors(rank, world_size, scale_rows):
    """One call's relative error in each of six layers whose magnitudes span 1e-3..1e2, passed
    as one tensor (rows cut across layers) or as six (rows follow them)."""
    g = torch.Generator().manual_seed(rank)
    layers = [torch.randn(size, generator=g) * 10.0**k for size, k in zip(LAYERS, range(-3, 3))]
    errors = {}
    for sizes in ([sum(LAYERS)], LAYERS):
        for scale_row in scale_rows:
            comm = OneBitAllReduce(sizes, scale_row=scale_row, ledger=CommLedger(num_params=sum(LAYERS)))
            x = torch.zeros(comm.layout.padded)
            views = [x[o : o + s] for o, s in zip(comm.layout.offsets, LAYERS)] if len(sizes) > 1 else list(x[: sum(LAYERS)].split(LAYERS))
            torch._foreach_copy_(views, layers)
            exact = x.clone()
            torch.distributed.all_reduce(exact)
            exact /= world_size
            comm.op(x)
            errors[len(sizes), scale_row] = [
                (torch.linalg.vector_norm(o - e) / torch.linalg.vector_norm(e)).item()
                for o, e in zip(views, (exact[v.storage_offset() : v.storage_offset() + v.numel()] for v in views))
            ]
    return errors


def test_row_scales_follow_the_tensors():
    errors = run_ranks(_layered_call_errors, 2, [1024, 1 << 20])[0]
    # one scale per chunk: its small layers drown in its large ones
    assert max(errors[1, 1 << 20]) > 20
    # rows that follow the tensors give every layer about one call's usual error (~0.93)...
    assert max(errors[len(LAYERS), 1024]) < 1.5
    # ...whereas rows of the same length cut across layer boundaries do not
    assert max(errors[1, 1024]) > 3  # (measured 4.8: a row straddling two layers gives the smaller one a larger scale)


def _ledger_sequence(rank, world_size):
    ledger = CommLedger(num_params=1000)
    comm = OneBitAllReduce(1000, ledger=ledger)
    comm.op(torch.ones(comm.layout.padded))
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
    assert summary == {"steps": 3, "bits_per_param": (1 + 0 + 40) / 3, "rounds": 2, "bytes_sent": 136 + 5000, "collective_calls": 4,
        "intra_bits_per_param": 0.0, "intra_bytes_sent": 0}  # fmt: skip


def _allocated(rank, world_size, numel, kernels_list):
    """What a OneBitAllReduce with each of `kernels_list` holds, in bytes (and that onebit_buffers says so)."""
    helds = []
    for kernels in kernels_list:
        comm = OneBitAllReduce(numel, ledger=CommLedger(num_params=numel), kernels=kernels)
        held = {name: tensor.numel() * tensor.element_size() for name, tensor in comm.held_buffers().items()}
        assert held == {name: size * dtype.itemsize for name, (size, dtype) in onebit_buffers(numel, world_size, kernels=kernels).items()}
        helds.append(held)
    return helds


@pytest.mark.parametrize("world_size", [1, 2])
def test_buffer_sizes_follow_the_layout(world_size):
    # bench optim counts memory from onebit_buffers: what an instance holds, in bytes.
    numel = 3 * SCALE_ROW + 1001
    kernels_list = ("torch", "native")
    helds = run_ranks(_allocated, world_size, numel, kernels_list)[0] if world_size > 1 else _allocated(0, 1, numel, kernels_list)
    for kernels, held in zip(kernels_list, helds):
        _check_held(held, world_size, numel, kernels)


def _check_held(held, world_size, numel, kernels):
    if world_size == 1:  # inactive: the accumulator only
        assert held["_worker"] == 4 * numel and all(size == 0 for name, size in held.items() if name != "_worker")
        return
    layout = onebit_layout(numel, world_size)
    per_rank = -(-numel // 2)  # 1.6 rows of SCALE_ROW: two equal rows, rounded up to 32, pad least
    assert (layout.rows, layout.row) == (2, -(-per_rank // 64) * 32)
    assert held["_worker"] == 4 * layout.padded and held["_server"] == 4 * layout.chunk
    assert held["_send"] == held["_recv"] == held["_gathered"] == 2 * held["_mine"] == 2 * (layout.chunk // 8 + 4 * 2)
    if kernels == "torch":  # the torch path's per-block scratch
        assert held["_flags"] == 4 * 2 * layout.row and held["_server_coef"] == 4 * 3 * 2  # both rows in one CPU block
    else:  # fused passes need none
        assert set(held) == {"_worker", "_server", "_send", "_recv", "_gathered", "_mine"}


def test_world_size_one_returns_input_unchanged():
    x = torch.randn(37)
    before = x.clone()
    comm = OneBitAllReduce(37)
    assert comm.op(x) is x
    assert torch.equal(x, before)  # one rank: the average is the input itself, not its 1-bit image
    assert not comm.layout.active and comm.layout.padded == 37


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


def _tiny_gradient_variance_step(rank, world_size, dtype):
    from zoa_train.optim import ZeroOneAdam

    x = torch.nn.Parameter(torch.zeros(4096))
    opt = ZeroOneAdam([x], lr=1e-3, var_freeze_step=10, allreduce_dtype=dtype)
    x.grad = torch.full((4096,), 1e-8) * torch.linspace(0.5, 1.5, 4096)
    x.grad[0] = 1.0  # one large coordinate: the rest are 1e-8 of it, far below fp16's range without a scale
    opt.step()
    assert opt.last_step.variance_updated
    state = opt.state_dict()["zoa"]["buffers"][0]
    return state["exp_avg"][:4096].clone(), state["exp_avg_sq"][:4096].clone()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gradients_of_1e_8_survive_a_16_bit_variance_step(dtype):
    m, v = run_ranks(_tiny_gradient_variance_step, 2, dtype)[0]
    expected = torch.full((4096,), 1e-8) * torch.linspace(0.5, 1.5, 4096)
    assert (v[1:] > 0).all()  # no coordinate frozen at v = 0 for ever
    assert torch.allclose(m[1:], 0.1 * expected[1:], rtol=1e-2)


ODD = 12_345  # not a multiple of the rows or of 8 * ranks: the layout pads it


def _any_length(rank, world_size):
    """The same three calls through a tensor of `numel` elements and through one already in the layout."""
    packed, laid = (OneBitAllReduce(ODD, ledger=CommLedger(num_params=ODD)) for _ in range(2))
    assert laid.layout.padded > ODD
    out = []
    for call in range(3):
        x = torch.randn(ODD, generator=torch.Generator().manual_seed(10 * rank + call))
        buffer = torch.zeros(laid.layout.padded)
        buffer[:ODD] = x  # one tensor: it starts at offset 0
        y = x.clone()
        assert packed.op(y) is y and y.shape == (ODD,)
        laid.op(buffer)
        out.append((y, buffer[:ODD].clone(), buffer[ODD:].clone()))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_op_takes_a_tensor_of_any_length(world_size):
    ranks = run_ranks(_any_length, world_size)
    for calls in ranks:
        for y, in_layout, padding in calls:
            assert torch.equal(y, in_layout) and not padding.any()
    for r in range(1, world_size):  # every rank holds the same average
        assert all(torch.equal(a[0], b[0]) for a, b in zip(ranks[0], ranks[r]))


def _non_finite(rank, world_size):
    poisoned, clean = (OneBitAllReduce(ODD, ledger=CommLedger(num_params=ODD)) for _ in range(2))
    x = torch.randn(ODD, generator=torch.Generator().manual_seed(rank))
    bad = x.clone()
    if rank == 0:
        bad[100] = float("nan")
        bad[7000] = float("inf")
    first = poisoned.op(bad.clone())
    clean.op(x.clone())
    z = torch.randn(ODD, generator=torch.Generator().manual_seed(50 + rank))
    return first, poisoned.op(z.clone()), clean.op(z.clone()), poisoned.layout.row


def test_a_non_finite_input_stays_in_its_rows_and_leaves_later_calls_finite():
    ranks = run_ranks(_non_finite, 2)
    first, after, clean_after, row = ranks[0]
    hit = torch.zeros(ODD, dtype=torch.bool)
    for index in (100, 7000):
        hit[index // row * row : (index // row + 1) * row] = True
    for r in range(2):  # the rows a NaN or inf fell in are non-finite on every rank, the others finite
        assert not torch.isfinite(ranks[r][0][hit]).any() and torch.isfinite(ranks[r][0][~hit]).all()
    assert torch.isfinite(after).all()  # the error buffers did not keep it
    assert torch.equal(after[~hit], clean_after[~hit])  # rows away from it: as if it had never been
    assert torch.equal(ranks[1][1], after)


@pytest.mark.parametrize("kernels", ["torch", "auto"])  # the torch path's per-block scratch; the fused kernels' none
@pytest.mark.parametrize("device", ["cpu", "cuda"])  # sizing only: no GPU is needed to count what one would hold
@pytest.mark.parametrize("numel, world_sizes", [(1_050_000, (2, 8)), (25_000_000, (2, 8, 64)), (117_000_000, (2, 8, 64))])
def test_the_1bit_call_holds_at_most_a_quarter_copy_beyond_its_errors(kernels, device, numel, world_sizes):
    """0/1 Adam holds 4 + 1/n fp32 copies (m, v, anchor, worker error, server error); what the 1-bit call
    adds (wire buffers, per-block scratch, the layout's padding in the four full-size buffers) stays
    under 0.25 copies, on a CPU and an accelerator alike (on the latter the torch path's blocks were
    the whole buffer up to 128M elements: 2.2 copies for GPT-2 117M). The gpt2_tiny size is the
    smallest recipe. The fused kernels hold no scratch: the wire buffers, (3 + 1/n)/32 copies, and padding."""
    for n in world_sizes:
        layout = onebit_layout(numel, n)
        buffers = onebit_buffers(numel, n, device, kernels=kernels)
        extra = sum(size * dtype.itemsize for name, (size, dtype) in buffers.items() if name not in ("_worker", "_server"))
        extra += 4 * 4 * (layout.padded - numel)
        assert extra / (4 * numel) <= 0.25, (n, extra / (4 * numel))
        if kernels == "auto":  # the fused kernels: the wire buffers and nothing more
            assert set(buffers) == {"_worker", "_server", "_send", "_recv", "_gathered", "_mine"}
