"""The collectives used directly (zoa_train/comm, as the README shows) refuse what would abort a process or
average nothing, in one sentence (a ValueError), as the optimizers do: ranks that built a collective
differently (Gloo used to abort the process with SIGABRT at its first call), a misspelt topology (it
built the flat sync), buffers on the meta device, and buffers of another size given to `exchange`."""

import functools

import pytest
import torch
from distributed_harness import run_ranks

from zoa_train.comm import ClusterCollective, HierarchicalOneBitAllReduce, OneBitAllReduce, TopKAllReduce, allreduce
from zoa_train.comm.buckets import BucketedCollective

SAME = "; build it with the same sizes on every rank"
SETTINGS = "; build it with the same settings on every rank"
# case: (what rank 0 builds, what rank 1 builds) as arguments of build(), and the sentence both ranks raise
DIFFERENT_RANKS = {
    "sizes": (  # wire segments of 8 and 3,164 bytes: Gloo aborted both processes at the first call
        ("flat", 16),
        ("flat", 50000),
        "OneBitAllReduce: the ranks were given different sizes: rank 0 has 1 buffers of 1 tensors (16 elements), rank 1 1 of 1 (50,000 elements)" + SAME,
    ),
    "a buffer more": (
        ("flat", [[16], [4]]),
        ("flat", [[16]]),
        "OneBitAllReduce: the ranks were given different sizes: rank 0 has 2 buffers of 2 tensors (20 elements), rank 1 1 of 1 (16 elements)" + SAME,
    ),
    "the same counts in other sizes": (
        ("flat", [4, 12]),
        ("flat", [12, 4]),
        "OneBitAllReduce: the ranks were given different sizes: rank 0 has 1 buffers of 2 tensors (16 elements), rank 1 1 of 2 (16 elements) of other sizes"
        + SAME,
    ),
    "scale rows": (
        ("flat", 5000, {"scale_row": 4096}),
        ("flat", 5000, {"scale_row": 1024}),
        "OneBitAllReduce: the ranks were built with different scale_row: 4096 on rank 0 and 1024 on rank 1" + SETTINGS,
    ),
    "node-aware sizes": (
        ("node-aware", 16),
        ("node-aware", 50000),
        "HierarchicalOneBitAllReduce: the ranks were given different sizes: rank 0 has 1 buffers of 1 tensors (16 elements), rank 1 1 of 1 (50,000 elements)"
        + SAME,
    ),
    "node-aware intra dtype": (
        ("one node", 16, {"intra_dtype": torch.float32}),
        ("one node", 16, {"intra_dtype": torch.bfloat16}),
        "HierarchicalOneBitAllReduce: the ranks were built with different intra_dtype: float32 on rank 0 and bfloat16 on rank 1" + SETTINGS,
    ),
    "top-k sizes": (
        ("topk", [16, 4]),
        ("topk", [16]),
        "TopKAllReduce: the ranks were given different sizes: rank 0 has 1 buffers of 2 tensors (20 elements), rank 1 1 of 1 (16 elements)" + SAME,
    ),
    "top-k density": (
        ("topk", 64, {"density": 0.01}),
        ("topk", 64, {"density": 0.5}),
        "TopKAllReduce: the ranks were built with different density: 0.01 on rank 0 and 0.5 on rank 1" + SETTINGS,
    ),
    "bucket sizes": (
        ("buckets", [[16], [4]]),
        ("buckets", [[16]]),
        "BucketedCollective: the ranks were given different sizes: rank 0 has 2 buffers of 2 tensors (20 elements), rank 1 1 of 1 (16 elements)" + SAME,
    ),
    "bucket caps": (
        ("buckets", [1000, 1000], {"bucket_cap_mb": 1.0}),
        ("buckets", [1000, 1000], {"bucket_cap_mb": 0.004}),
        "BucketedCollective: the ranks were built with different bucket_cap_mb: 1.0 on rank 0 and 0.004 on rank 1" + SETTINGS,
    ),
    "cluster sizes": (
        ("cluster", 16),
        ("cluster", 20),
        "ClusterCollective: the ranks were given different sizes: rank 0 has 1 buffers of 1 tensors (16 elements), rank 1 1 of 1 (20 elements)" + SAME,
    ),
    # rank 0 would have found one node and built the flat sync, rank 1 two nodes and the node-aware one
    "cluster nodes": (
        ("cluster", 16, {"ranks_per_node": 2}),
        ("cluster", 16, {"ranks_per_node": 1}),
        "ClusterCollective: the ranks were built with different ranks_per_node: 2 on rank 0 and 1 on rank 1" + SETTINGS,
    ),
    "cluster overlap": (
        ("cluster", 16, {"overlap": False, "bucket_cap_mb": 1.0}),
        ("cluster", 16, {"overlap": True, "bucket_cap_mb": 1.0}),
        "ClusterCollective: the ranks were built with different overlap: False on rank 0 and True on rank 1" + SETTINGS,
    ),
}


def _refused_on_two_ranks(rank, world_size):
    """Every case of DIFFERENT_RANKS, each rank building its side, then the local refusals on both ranks,
    then one collective built alike, which must still average: the ranks stayed in step throughout."""
    from zoa_train.comm.topology import node_groups

    nodes = {"node-aware": node_groups([[0], [1]]), "one node": node_groups([[0, 1]])}

    def build(kind, sizes, settings=None):
        settings = settings or {}
        if kind == "flat":
            return OneBitAllReduce(sizes, **settings)
        if kind in nodes:
            return HierarchicalOneBitAllReduce(sizes, nodes=nodes[kind], **settings)
        if kind == "topk":
            return TopKAllReduce(sizes, **settings)
        if kind == "buckets":
            return BucketedCollective(sizes, inner=OneBitAllReduce, **{"bucket_cap_mb": 1.0, **settings})
        return ClusterCollective(**{"topology": "auto", "ranks_per_node": 1, **settings})(sizes)

    said = {}
    for case, (first, second, _) in DIFFERENT_RANKS.items():
        try:
            build(*(first if rank == 0 else second))
            said[case] = None
        except ValueError as error:
            said[case] = str(error)
    for case, call in {
        "meta": lambda: OneBitAllReduce(16, device="meta"),
        "exchange of another size": lambda: OneBitAllReduce(16).exchange(torch.zeros(20)),
        "node-aware exchange of another size": lambda: HierarchicalOneBitAllReduce(16, nodes=nodes["node-aware"]).exchange(torch.zeros(20)),
        "top-k exchange of another size": lambda: TopKAllReduce(16).exchange([torch.zeros(16)]),
        "bucketed exchange of another size": lambda: build("buckets", [16]).exchange(torch.zeros(20)),
    }.items():
        try:
            call()
            said[case] = None
        except ValueError as error:
            said[case] = str(error)
    x = torch.full((16,), float(rank + 1))
    return said, OneBitAllReduce(16).op(x)


@pytest.mark.slow  # one launch of 2 ranks, about 10 s on 2 cores
def test_ranks_that_built_a_collective_differently_are_refused_on_every_rank_and_none_aborts():
    first, second = run_ranks(_refused_on_two_ranks, 2)  # raises if a rank exited with a signal or an error
    assert first[0] == second[0]  # the same sentence on every rank
    said = first[0]
    for case, (_, _, expected) in DIFFERENT_RANKS.items():
        assert said[case] == expected, case
    assert said["meta"].startswith("OneBitAllReduce cannot keep its buffers on the meta device, which holds no values")
    assert said["exchange of another size"] == "OneBitAllReduce.exchange takes contiguous buffers in its layout (64 elements), got a tensor of 20"
    assert (
        said["node-aware exchange of another size"]
        == "HierarchicalOneBitAllReduce.exchange takes contiguous buffers in its layout (64 elements), got a tensor of 20"
    )
    assert said["top-k exchange of another size"] == "TopKAllReduce.exchange takes contiguous buffers in its layout (4096 elements), got a tensor of 16"
    assert said["bucketed exchange of another size"] == "BucketedCollective.exchange takes contiguous buffers in its layout (64 elements), got a tensor of 20"
    # after all of that the ranks still average together: 1.0 and 2.0, to the 1-bit call's 1.5 everywhere
    assert torch.equal(first[1], second[1]) and torch.allclose(first[1], torch.full((16,), 1.5))


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"topology": "hierachical"}, "ClusterCollective: topology must be one of auto, flat, hierarchical, not 'hierachical'"),
        ({"topology": "Flat"}, "ClusterCollective: topology must be one of auto, flat, hierarchical, not 'Flat'"),
        ({"ranks_per_node": -2}, "ClusterCollective: ranks_per_node must be a whole number >= 0 (0: nodes found by hostname), not -2"),
        ({"intra_dtype": torch.float16}, "ClusterCollective: intra_dtype must be torch.float32 or torch.bfloat16, not torch.float16"),
        ({"kernels": "fast"}, "ClusterCollective: kernels must be one of auto, torch, native, triton, not 'fast'"),
        ({"bucket_cap_mb": float("nan")}, "ClusterCollective: bucket_cap_mb must be a finite number of MB >= 0 (0: no buckets), not nan"),
        ({"bucket_cap_mb": -1.0}, "ClusterCollective: bucket_cap_mb must be a finite number of MB >= 0 (0: no buckets), not -1.0"),
    ],
)
def test_a_cluster_collective_of_settings_a_recipe_could_not_hold_is_refused_when_made(settings, message):
    with pytest.raises(ValueError) as refused:
        ClusterCollective(**settings)
    assert str(refused.value) == message


META = "cannot keep its buffers on the meta device, which holds no values; build the model on a real device (e.g. module.to_empty(device='cpu'), then initialise it) before the optimizer"


@pytest.mark.parametrize(
    "name, build",
    [
        ("OneBitAllReduce", lambda: OneBitAllReduce(16, device="meta")),
        ("TopKAllReduce", lambda: TopKAllReduce(16, device="meta")),
        ("BucketedCollective", lambda: BucketedCollective([16], device="meta", inner=OneBitAllReduce)),
        ("ClusterCollective", lambda: ClusterCollective("flat")([16], device=torch.device("meta"))),
    ],
)
def test_a_collective_on_the_meta_device_is_refused(name, build):
    with pytest.raises(ValueError) as refused:
        build()
    assert str(refused.value) == f"{name} {META}"


def test_meta_tensors_are_refused_by_every_entry_point():
    from zoa_train.optim import ZeroOneAdam

    meta = torch.zeros(16, device="meta")
    with pytest.raises(
        ValueError, match=r"^a full-precision allreduce cannot average a tensor on the meta device, which holds no values; pass a tensor on the CPU or a GPU$"
    ):
        allreduce(meta)
    for comm in (OneBitAllReduce(16), TopKAllReduce(16)):
        for call in (comm.op, comm.exchange):
            with pytest.raises(ValueError, match=rf"^{type(comm).__name__}'s buffers are on cpu, got a tensor on meta$"):
                call(meta)
    with pytest.raises(ValueError, match="^ZeroOneAdam: parameters on the meta device hold no values"):  # before its collective
        ZeroOneAdam([torch.nn.Parameter(meta)], lr=0.1)


def one_process_collectives():
    from zoa_train.comm.topology import NodeGroups

    nodes = NodeGroups(1, 1, 0, 0, None, None, None)
    return [
        OneBitAllReduce([16, 4]),
        TopKAllReduce([16, 4]),
        HierarchicalOneBitAllReduce([16, 4], nodes=nodes),
        BucketedCollective([16, 4], inner=OneBitAllReduce),
        BucketedCollective([16, 4], inner=functools.partial(HierarchicalOneBitAllReduce, nodes=nodes)),
    ]


@pytest.mark.parametrize("comm", one_process_collectives(), ids=lambda c: type(c).__name__)
def test_exchange_refuses_buffers_not_in_its_layout(comm):
    """`exchange` writes whole rows: a buffer of another size (or a strided one) is refused before anything
    moves, as `op` refuses it (it used to reach a raw torch error, or a bucket's slice of the wrong size)."""
    padded = comm.layouts[0].padded
    name = type(comm).__name__
    for wrong in (torch.zeros(padded + 3), torch.zeros(padded - 1), torch.zeros(2 * padded)[::2]):
        with pytest.raises(ValueError) as refused:
            comm.exchange(wrong)
        assert str(refused.value) == f"{name}.exchange takes contiguous buffers in its layout ({padded} elements), got a tensor of {wrong.numel()}"
        with pytest.raises(ValueError) as refused:
            comm.exchange(torch.zeros(padded), addend=wrong)
        assert str(refused.value).startswith(f"{name}.exchange takes contiguous buffers in its layout")
    out = comm.exchange(torch.zeros(padded), addend=torch.ones(padded))  # the right size still works: one rank, the input itself
    assert torch.equal(out, torch.ones(padded))


@pytest.mark.parametrize("name", ["ZeroOneAdam", "OneBitAdam", "DataParallelAdam"])
def test_an_optimizer_over_meta_parameters_is_refused_in_one_sentence(name):
    """Before its collective or its check of the ranks' models (which would compare meta tensors) runs."""
    from zoa_train import optim

    parameter = torch.nn.Parameter(torch.empty(4, 4, device="meta"))
    with pytest.raises(ValueError, match=rf"^{name}: parameters on the meta device hold no values; build the model on a real device"):
        getattr(optim, name)([parameter])
