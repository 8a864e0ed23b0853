"""The top-k collective (zoa_train/comm/topk.py): its output, error buffer, wire bytes and ledger
against an element-by-element reference (tests/reference.py) on fixed inputs, at 2 and 3 ranks."""

import struct

import pytest
import torch
from distributed_harness import run_ranks
from reference import topk_allreduce_reference

from zoa_train.comm import CommLedger
from zoa_train.comm.topk import TopKAllReduce, pack_bits, topk_layout, topk_slots, topk_wire, unpack_bits

# Tensors of a chunk and more, a run of small ones with an empty one, and a last tensor of 3 elements:
# fewer than the k = 10 slots of a chunk, so its message holds padding too. Chunks of 100 elements
# take 7 index bits: slots of 9 bits, which straddle bytes.
SIZES = [300, 5, 7, 0, 64, 1000, 3]
CHUNK, DENSITY = 100, 0.1
CALLS = 3


def real_mask(layout) -> torch.Tensor:
    real = torch.zeros(layout.padded, dtype=torch.bool)
    for offset, size in zip(layout.offsets, layout.sizes):
        real[offset : offset + size] = True
    return real


def _input(decay: float, call: int, rank: int, real: torch.Tensor) -> torch.Tensor:
    x = torch.zeros(real.numel())
    g = torch.Generator().manual_seed(int(100 * decay) + 10 * call + rank)
    x[real] = torch.randn(int(real.sum()), generator=g) * (rank + 1)
    return x


def _calls(rank, world_size, decay):
    ledger = CommLedger(num_params=sum(SIZES))
    comm = TopKAllReduce(SIZES, ledger=ledger, density=DENSITY, chunk=CHUNK, error_decay=decay)
    real = real_mask(comm.layouts[0])
    calls = []
    for call in range(CALLS):
        out = comm.op(_input(decay, call, rank, real))
        ledger.end_step()
        calls.append({"out": out.clone(), "error": comm.accumulators[0].clone(), "message": comm._mine.clone(), "gathered": comm._gathered.clone()})
    return calls, ledger.summary(), dict(ledger.by_kind)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("decay", [1.0, 0.5])
def test_topk_allreduce_matches_the_reference_on_every_rank(world_size, decay):
    ranks = run_ranks(_calls, world_size, decay)
    layout = topk_layout(SIZES, CHUNK)
    real = real_mask(layout)
    k, chunks = topk_slots(DENSITY, CHUNK), layout.padded // CHUNK
    assert (k, chunks) == (10, 15)
    errors = [torch.zeros(layout.padded) for _ in range(world_size)]
    for call in range(CALLS):
        inputs = [_input(decay, call, r, real) for r in range(world_size)]
        expected, errors, messages = topk_allreduce_reference(inputs, errors, real, CHUNK, k, decay)
        for rank, (calls, _, _) in enumerate(ranks):
            got = calls[call]
            assert torch.equal(got["out"], ranks[0][0][call]["out"])  # every rank holds the same average
            assert torch.equal(got["gathered"], ranks[0][0][call]["gathered"])
            # The levels are means, summed here in fp32 and there in fp64: they may differ in their last bit.
            torch.testing.assert_close(got["out"], expected, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(got["error"], errors[rank], rtol=1e-6, atol=1e-6)
            assert not got["out"][~real].any() and not got["error"][~real].any()  # padding carries nothing
            levels, slots = messages[rank]
            message = got["message"]
            assert message.numel() == 8 * chunks + len(slots)
            sent_levels = struct.unpack(f"<{2 * chunks}f", bytes(message[: 8 * chunks].tolist()))
            assert sent_levels == pytest.approx([v for pair in levels for v in pair], rel=1e-6)
            assert bytes(message[8 * chunks :].tolist()) == slots  # indices and codes, bit for bit
            assert torch.equal(got["gathered"].view(world_size, -1)[rank], message)
    summary, by_kind = ranks[0][1], ranks[0][2]
    # Per call and rank: k slots of 7 index bits + 2 value bits in each chunk, and its two fp32 levels.
    bits = chunks * (k * (7 + 2) + 64)
    assert summary["bits_per_param"] == pytest.approx(bits / sum(SIZES))
    assert summary["rounds"] == CALLS and summary["bytes_sent"] == CALLS * (world_size - 1) * (8 * chunks + -(-chunks * k * 9 // 8))  # levels, then the slots
    assert by_kind["topk_allreduce"]["elements"] == CALLS * chunks * k and by_kind["topk_scales"]["elements"] == CALLS * 2 * chunks


def test_bits_pack_and_unpack_and_the_wire_is_counted_from_the_layout():
    # 0, 1 and 4095 in 12 bits each, least significant first: bit 12 set, then bits 24-35.
    assert pack_bits(torch.tensor([0, 1, 4095]), 12).tolist() == [0x00, 0x10, 0x00, 0xFF, 0x0F]
    values = torch.randint(0, 1 << 14, (101,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpack_bits(pack_bits(values, 14), 14, 101), values)
    # 1% of a 4,096-element chunk is 41 slots of 14 bits; a 100-element tensor is a chunk of its own.
    wire = topk_wire([4096 * 3, 100], 0.01)
    assert (wire.chunks, wire.k, wire.index_bits) == (4, 41, 12)
    assert wire.payload_bits == 4 * (41 * 14 + 64) and wire.message_bytes == 4 * 8 + -(-4 * 41 * 14 // 8)


def test_one_rank_returns_its_input_and_bad_settings_are_refused():
    comm = TopKAllReduce([10, 3], density=0.5, chunk=8)
    x = torch.randn(13)
    assert torch.equal(comm.op(x.clone()), x)
    for kwargs, message in [({"density": 0.0}, "density must be in"), ({"chunk": 0}, "chunk must be"), ({"error_decay": 1.5}, "error_decay must be")]:
        with pytest.raises(ValueError, match=message):
            TopKAllReduce([10], **kwargs)
