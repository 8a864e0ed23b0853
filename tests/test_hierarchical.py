"""The node-aware 1-bit allreduce (zoa_train/comm/hierarchical.py) and how ranks find their nodes."""

import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_ranks
from reference import ExactAllReduce

from zoa_train.comm import ClusterCollective, CommLedger, HierarchicalOneBitAllReduce, OneBitAllReduce, TopologyChanged
from zoa_train.comm.hierarchical import shard_layout
from zoa_train.comm.onebit import onebit_layout
from zoa_train.comm.topology import choose, describe, node_groups, nodes_by_count, nodes_from_names
from zoa_train.errors import UserError

# Two buffers (an optimizer's two parameter groups), tensors of no round size, one of them small.
SIZES = [[5000, 300, 7, 2048], [4096, 1000]]
NUMEL = sum(map(sum, SIZES))


def _inputs(rank: int, call: int, collective) -> list[torch.Tensor]:
    """Each buffer in its layout with rank- and call-dependent values in its tensors, zero padding."""
    g = torch.Generator().manual_seed(1000 * call + rank)
    buffers = []
    for layout in collective.layouts:
        x = torch.zeros(layout.padded)
        for offset, size in zip(layout.offsets, layout.sizes):
            x[offset : offset + size] = torch.randn(size, generator=g) * (1 + offset % 7)
        buffers.append(x)
    return buffers


def _exact_mean(buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    means = [b.clone() for b in buffers]
    for m in means:
        dist.all_reduce(m)
        m /= dist.get_world_size()
    return means


def _calls(collective, rank: int, calls: int) -> list[list[torch.Tensor]]:
    outs = []
    for call in range(calls):
        x = _inputs(rank, call, collective)
        outs.append([t.clone() for t in collective.op(x)])
    return outs


def _cases(rank, world):
    ledger = lambda: CommLedger(num_params=NUMEL)  # noqa: E731
    two_by_two = node_groups(nodes_by_count(world, 2))
    results = {}

    # 2 nodes x 2 ranks, the default 1-bit collective between nodes.
    hier = HierarchicalOneBitAllReduce(SIZES, nodes=two_by_two, ledger=ledger())
    results["2x2"] = _calls(hier, rank, 3)
    results["2x2 exact"] = [_exact_mean(_inputs(rank, call, hier)) for call in range(3)]
    results["2x2 ledger"] = hier.ledger.by_kind, hier.bytes_per_call, hier.intra_bytes_per_call
    flat = OneBitAllReduce(SIZES, ledger=ledger())
    results["flat bytes"] = flat.bytes_per_call

    # The same ranks in another order: nodes {0, 2} and {1, 3} (srun's cyclic distribution).
    cyclic = HierarchicalOneBitAllReduce(SIZES, nodes=node_groups([[0, 2], [1, 3]]), ledger=ledger())
    results["cyclic"] = _calls(cyclic, rank, 1)

    # One rank per node: the flat allreduce, bit for bit, error buffers included.
    one_per_node = HierarchicalOneBitAllReduce(SIZES, nodes=node_groups(nodes_by_count(world, 1)), ledger=ledger())
    results["4x1"] = _calls(one_per_node, rank, 3), one_per_node.state_dicts()
    results["flat"] = _calls(flat, rank, 3), flat.state_dicts()

    # One node: the exact average.
    one_node = HierarchicalOneBitAllReduce(SIZES, nodes=node_groups(nodes_by_count(world, world)), ledger=ledger())
    results["1x4"] = _calls(one_node, rank, 2)

    # An exact collective between nodes: the composition alone is the exact average.
    exact_inter = HierarchicalOneBitAllReduce(SIZES, nodes=two_by_two, ledger=ledger(), inter=ExactAllReduce)
    results["2x2 exact inter"] = _calls(exact_inter, rank, 2)

    # bf16 inside the node: the shard owners' values reach every rank unchanged.
    bf16 = HierarchicalOneBitAllReduce(SIZES, nodes=two_by_two, ledger=ledger(), intra_dtype=torch.bfloat16)
    results["2x2 bf16"] = _calls(bf16, rank, 1)

    # Tensors of just the buffers' elements (packed) are averaged as their laid-out buffers are.
    laid_out, packed = (HierarchicalOneBitAllReduce(SIZES, nodes=two_by_two, ledger=ledger()) for _ in range(2))
    x = _inputs(rank, 0, laid_out)
    packed_x = [torch.cat([b[o : o + n] for o, n in zip(l.offsets, l.sizes)]) for b, l in zip(x, laid_out.layouts)]
    out = laid_out.op([b.clone() for b in x])
    results["packed"] = [torch.cat([b[o : o + n] for o, n in zip(l.offsets, l.sizes)]) for b, l in zip(out, laid_out.layouts)], packed.op(packed_x)

    # Error feedback: the running mean of many calls on a fixed input approaches its exact mean.
    fixed = HierarchicalOneBitAllReduce(SIZES, nodes=two_by_two, ledger=ledger())
    x = _inputs(rank, 0, fixed)
    running, rel = [torch.zeros_like(t) for t in x], []
    exact = torch.cat(_exact_mean(x))
    for k in range(1, 61):
        out = fixed.op([t.clone() for t in x])
        for r, o in zip(running, out):
            r.add_(o)
        mean = torch.cat(running) / k
        rel.append((torch.linalg.vector_norm(mean - exact) / torch.linalg.vector_norm(exact)).item())
    results["feedback"] = rel

    # Resume: a collective restored from another's state continues exactly as the original does.
    original = HierarchicalOneBitAllReduce(SIZES, nodes=two_by_two, ledger=ledger())
    _calls(original, rank, 2)
    for acc in original.accumulators:  # something added since the last call is part of the state too
        acc[:10] += 0.5
    restored = HierarchicalOneBitAllReduce(SIZES, nodes=two_by_two, ledger=ledger())
    restored.load_state_dicts(original.state_dicts())
    results["resume"] = [t.clone() for t in original.op(_inputs(rank, 5, original))], [t.clone() for t in restored.op(_inputs(rank, 5, restored))]
    try:
        flat.load_state_dicts(original.state_dicts())
        results["flat refuses"] = None
    except TopologyChanged as e:
        results["flat refuses"] = str(e)
    try:
        cyclic.load_state_dicts(original.state_dicts())  # the same shape, other ranks on each node
        results["regrouped refuses"] = None
    except TopologyChanged as e:
        results["regrouped refuses"] = str(e)
    try:
        one_node.load_state_dicts(original.state_dicts())
        results["other shape refuses"] = None
    except TopologyChanged as e:
        results["other shape refuses"] = str(e)

    # Full-precision rounds, node-aware (fp32 and bf16 on the wire) and flat, on a tensor of odd length.
    g = torch.Generator().manual_seed(rank)
    values = torch.randn(1001, generator=g) * (rank + 1)
    fp = {}
    for name, collective, dtype in (("node-aware", HierarchicalOneBitAllReduce(SIZES, nodes=two_by_two, ledger=ledger()), None),
                                    ("node-aware bf16", HierarchicalOneBitAllReduce(SIZES, nodes=two_by_two, ledger=ledger()), torch.bfloat16),
                                    ("flat", OneBitAllReduce(SIZES, ledger=ledger()), None)):  # fmt: skip
        out = collective.allreduce(values.clone(), comm_dtype=dtype, elements=1000)
        step = collective.ledger.end_step()
        fp[name] = out, (step.bits_per_param, step.bytes_sent, step.intra_bits_per_param, step.intra_bytes_sent)
    results["fp"] = fp, _exact_mean([values])[0]

    # ClusterCollective: nodes by recipe override; auto picks hierarchical on 2 x 2.
    factory = ClusterCollective("auto", ranks_per_node=2)
    built = factory(SIZES, group=None, device=torch.device("cpu"), ledger=ledger())
    results["factory"] = type(built).__name__, factory.chosen
    flat_factory = ClusterCollective("flat", ranks_per_node=2)
    results["factory flat"] = type(flat_factory(SIZES, group=None, device=torch.device("cpu"), ledger=ledger())).__name__
    return results


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_cases, 4)


def _identical(ranks, key):
    for r in range(1, 4):
        for call_r, call_0 in zip(ranks[r][key], ranks[0][key]):
            for a, b in zip(call_r, call_0):
                assert torch.equal(a, b), f"{key}: rank {r} differs from rank 0"


def _relative_error(outs, exact) -> float:
    return (torch.linalg.vector_norm(torch.cat(outs) - torch.cat(exact)) / torch.linalg.vector_norm(torch.cat(exact))).item()


@pytest.mark.slow
def test_every_rank_ends_with_the_same_average_close_to_the_exact_one(ranks):
    for key in ("2x2", "cyclic", "2x2 bf16"):
        _identical(ranks, key)
    # A first call of random buffers loses about as much as the flat call on the same ranks (two
    # compressions each; 0.89 here); a shard left unaveraged or put in the wrong place loses far more.
    flat = _relative_error(ranks[0]["flat"][0][0], ranks[0]["2x2 exact"][0])
    for key in ("2x2", "cyclic", "2x2 bf16"):
        error = _relative_error(ranks[0][key][0], ranks[0]["2x2 exact"][0])
        assert error < 1.1 * flat, f"{key}: relative error {error:.3f}, flat {flat:.3f}"


@pytest.mark.slow
def test_packed_tensors_are_averaged_as_their_laid_out_buffers(ranks):
    for rank in ranks:
        for a, b in zip(*rank["packed"]):
            assert torch.equal(a, b)


@pytest.mark.slow
def test_the_output_padding_is_zero(ranks):
    for out, layout in zip(ranks[0]["2x2"][0], [onebit_layout(s, 4) for s in SIZES]):
        real = torch.zeros(layout.padded, dtype=torch.bool)
        for offset, size in zip(layout.offsets, layout.sizes):
            real[offset : offset + size] = True
        assert not out[~real].any()
        assert out[real].all()


@pytest.mark.slow
def test_one_rank_per_node_is_the_flat_allreduce_bit_for_bit(ranks):
    for rank in ranks:
        (hier_calls, hier_state), (flat_calls, flat_state) = rank["4x1"], rank["flat"]
        for hier, flat in zip(hier_calls, flat_calls):
            for a, b in zip(hier, flat):
                assert torch.equal(a, b)
        for h, f in zip(hier_state, flat_state):
            assert torch.equal(h["shard"]["worker_error"], f["worker_error"])
            assert torch.equal(h["shard"]["server_error"], f["server_error"])


@pytest.mark.slow
def test_one_node_is_the_exact_average(ranks):
    _identical(ranks, "1x4")
    for call in range(2):
        for got, exact in zip(ranks[0]["1x4"][call], ranks[0]["2x2 exact"][call]):
            torch.testing.assert_close(got, exact, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_with_an_exact_collective_between_nodes_it_is_the_exact_average(ranks):
    _identical(ranks, "2x2 exact inter")
    for call in range(2):
        for got, exact in zip(ranks[0]["2x2 exact inter"][call], ranks[0]["2x2 exact"][call]):
            torch.testing.assert_close(got, exact, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_error_feedback_running_mean_converges(ranks):
    rel = ranks[0]["feedback"]
    assert rel[0] > 0.3  # one call really is lossy
    assert rel[59] < rel[0] / 10
    assert rel[59] < rel[14] / 2  # the carried error stays bounded: the running mean's error falls like 1/K


@pytest.mark.slow
def test_a_restored_collective_continues_exactly_and_another_topology_is_refused(ranks):
    for rank in ranks:
        original, restored = rank["resume"]
        for a, b in zip(original, restored):
            assert torch.equal(a, b)
        assert "node-aware 1-bit sync over 2 nodes x 2 ranks" in rank["flat refuses"] and "--reshard" in rank["flat refuses"]
        assert "1 nodes x 4 ranks" in rank["other shape refuses"]
        assert "nodes [[0, 1], [2, 3]]" in rank["regrouped refuses"] and "nodes [[0, 2], [1, 3]]" in rank["regrouped refuses"]


@pytest.mark.slow
def test_between_nodes_a_rank_sends_a_node_share_of_the_flat_bytes(ranks):
    by_kind, inter_bytes, intra_bytes = ranks[0]["2x2 ledger"]
    flat_bytes = ranks[0]["flat bytes"]
    # flat: 2 passes x 3 peers x a quarter of the buffer; node-aware: 2 passes x 1 peer x a quarter.
    assert inter_bytes * 3 == pytest.approx(flat_bytes, rel=0.02)
    assert by_kind["onebit_allreduce"]["calls"] == 2 * 3 and by_kind["onebit_allreduce"]["bytes_sent"] == 3 * inter_bytes
    assert by_kind["intra_allreduce_float32"]["bytes_sent"] == 3 * intra_bytes and by_kind["intra_allreduce_float32"]["calls"] == 2 * 3
    # each of a node's ranks compresses its shard: together the whole buffer, in each of the 3 calls
    assert sum(ranks[r]["2x2 ledger"][0]["onebit_allreduce"]["elements"] for r in (0, 1)) == 3 * NUMEL


@pytest.mark.slow
def test_full_precision_rounds_are_node_aware_exact_and_the_same_on_every_rank(ranks):
    exact = ranks[0]["fp"][1]
    for name, tolerance in (("node-aware", 1e-6), ("node-aware bf16", 1e-2), ("flat", 1e-6)):
        outs = [r["fp"][0][name][0] for r in ranks]
        assert all(torch.equal(out, outs[0]) for out in outs), f"{name}: the ranks differ"
        torch.testing.assert_close(outs[0], exact, rtol=tolerance, atol=tolerance)
    # Over the slow link a node-aware round sends each rank's half of the buffer to the other node:
    # 32 bits per parameter for half the parameters, and a ring of 2 ranks' bytes on the shard; the
    # flat ring of 4 ranks sends 32 bits per parameter and 2*3/4 of the buffer, part of it off the node.
    shard = -(-1001 // 2)
    for r, rank in enumerate(ranks):
        bits, sent, intra_bits, intra_sent = rank["fp"][0]["node-aware"][1]
        owned = shard if r % 2 == 0 else 1001 - shard
        assert bits == pytest.approx(32 * (1000 * owned // 1001) / NUMEL) and sent == 2 * 1 * shard * 4 // 2
        assert intra_bits == pytest.approx(32 * 1000 / NUMEL) and intra_sent == shard * (4 + 4)
        assert rank["fp"][0]["node-aware bf16"][1][1] == 2 * 1 * shard * 2 // 2  # bf16 between nodes
        assert rank["fp"][0]["flat"][1][:2] == (pytest.approx(32 * 1000 / NUMEL), 2 * 3 * 1001 * 4 // 4)


@pytest.mark.slow
def test_cluster_collective_builds_what_the_recipe_says(ranks):
    assert ranks[0]["factory"] == ("HierarchicalOneBitAllReduce", "hierarchical 1-bit sync, 2 nodes x 2 ranks")
    assert ranks[0]["factory flat"] == "OneBitAllReduce"


def test_ledger_keeps_the_links_apart():
    ledger = CommLedger(num_params=100)
    ledger.record("onebit_allreduce", payload_bits=1, elements=50, bytes_sent=20, calls=2)
    ledger.record("intra_all_gather_float32", payload_bits=32, elements=100, bytes_sent=200, link="intra")
    step = ledger.end_step()
    assert (step.bits_per_param, step.bytes_sent, step.intra_bits_per_param, step.intra_bytes_sent, step.calls) == (0.5, 20, 32.0, 200, 3)
    summary = ledger.summary()
    assert summary["bits_per_param"] == 0.5 and summary["intra_bits_per_param"] == 32.0 and summary["intra_bytes_sent"] == 200
    restored = CommLedger()
    restored.load_state_dict(ledger.state_dict())
    assert restored.summary() == summary
    with pytest.raises(ValueError, match="link"):
        ledger.record("x", 1, 1, 1, link="nvlink")


def test_shards_are_whole_chunks_that_keep_the_rows():
    layout = onebit_layout([5000, 300, 7, 2048], 4)
    halves = [shard_layout(layout, index, 2) for index in range(2)]
    assert all(h.padded == 2 * layout.chunk and h.rows == layout.rows and h.row == layout.row for h in halves)
    assert sum(h.numel for h in halves) == layout.numel
    lengths = torch.cat([h.row_lengths() for h in halves])
    assert torch.equal(lengths, layout.row_lengths())


def test_nodes_are_found_from_names_and_uneven_layouts_are_handled():
    assert nodes_from_names(["a", "b", "a", "b"]) == [[0, 2], [1, 3]]
    assert nodes_by_count(6, 3) == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(UserError, match="not a whole number"):
        nodes_by_count(6, 4)
    assert choose("auto", [[0, 1], [2, 3]]) == "hierarchical"
    assert choose("auto", [[0], [1]]) == "flat"  # one rank per node: nothing to average inside
    assert choose("auto", [[0, 1, 2, 3]]) == "flat"  # one node
    assert choose("auto", [[0, 1, 2], [3]]) == "flat"  # uneven: auto falls back
    assert choose("flat", [[0, 1], [2, 3]]) == "flat"
    with pytest.raises(UserError, match="unequal numbers of ranks"):
        choose("hierarchical", [[0, 1, 2], [3]])
    assert describe([[0, 1, 2], [3]]) == "2 nodes x 1/3 ranks"


def test_one_process_gets_the_flat_allreduce_whatever_the_topology():
    # without torch.distributed: nothing to send, so no node groups to build
    for topology in ("auto", "flat", "hierarchical"):
        built = ClusterCollective(topology)(SIZES, group=None, device=torch.device("cpu"), ledger=CommLedger(num_params=NUMEL))
        assert type(built) is OneBitAllReduce
        x = [torch.randn(layout.padded) for layout in built.layouts]
        assert all(torch.equal(a, b) for a, b in zip(built.op([t.clone() for t in x]), x))
