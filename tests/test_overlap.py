"""The 1-bit rounds in buckets, started during backward (zoa_train/comm/buckets.py): the overlapped
path equals the same buckets run in step(), bit for bit, for 1-bit Adam and 0/1 Adam (variance,
sync and local steps), on 2 and 3 ranks and 2 x 2 nodes, with gradient accumulation, unused
parameters and an exact resume; ranks identical after every sync."""

import contextlib
import functools
import time

import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_ranks

from zoa_train.comm import ClusterCollective, OneBitAllReduce, TopologyChanged
from zoa_train.comm.buckets import BucketedCollective, TensorOrder, listing_order, plan_buckets
from zoa_train.comm.ledger import CommLedger
from zoa_train.comm.sharding import gradient_order
from zoa_train.optim import OneBitAdam, ZeroOneAdam
from zoa_train.optim.diloco import DiLoCo

CAP_MB = 4096 * 4 / 2**20  # buckets of at most 4,096 elements: several per group in the model below


def test_buckets_hold_whole_tensors_of_one_group_in_reverse_order():
    sizes = [[3000, 10, 5000, 2000], [10, 10]]
    buckets = plan_buckets(sizes, 2, 4096, 1024)
    assert [(b.group, b.tensors) for b in buckets] == [(1, [1, 0]), (0, [3]), (0, [2]), (0, [1, 0])]
    for g, group in enumerate(sizes):  # every tensor once, the group's buckets back to back
        mine = [b for b in buckets if b.group == g]
        assert sorted(i for b in mine for i in b.tensors) == list(range(len(group)))
        assert [b.start for b in mine] == [0] + [b.stop for b in mine[:-1]]
    assert buckets[2].layout.numel == 5000  # larger than the cap: alone
    # on one rank (no process group) a group's buffer is its buckets back to back, averaged exactly
    one = BucketedCollective([[300, 500], [7]], inner=OneBitAllReduce, bucket_cap_mb=2000 * 4 / 2**20)
    assert [layout.offsets for layout in one.layouts] == [(500, 0), (0,)] and [layout.padded for layout in one.layouts] == [800, 7]
    buffers = [torch.randn(800), torch.randn(7)]
    assert all(torch.equal(a, b) for a, b in zip(one.op([b.clone() for b in buffers]), buffers))


def test_an_order_cuts_buckets_by_its_sizes_and_starts_them_when_their_last_tensor_is_ready():
    sizes = [[3000, 10, 5000, 2000], [10, 10]]
    # three units: tensors (0, 3) and (1, 1) ready first, then (0, 1) and (0, 2), then (0, 0) and (1, 0)
    order = TensorOrder(sizes, [[2, 1, 1, 0], [2, 0]])
    buckets = plan_buckets(sizes, 2, 4096, 1024, order)
    assert [(b.group, b.tensors) for b in buckets] == [(0, [3]), (0, [2]), (1, [1, 0]), (0, [1, 0])]
    # the cap counts the order's sizes (a whole tensor's, twice a shard's here); the layouts the tensors' own
    doubled = TensorOrder([[2 * n for n in group] for group in sizes], [[0] * len(group) for group in sizes])
    buckets = plan_buckets(sizes, 2, 4096, 1024, doubled)
    assert [(b.group, b.tensors) for b in buckets] == [(1, [1, 0]), (0, [3]), (0, [2]), (0, [1]), (0, [0])]
    assert buckets[-1].layout.numel == 3000
    with pytest.raises(ValueError, match="every tensor of every group"):
        plan_buckets(sizes, 2, 4096, 1024, TensorOrder(sizes, [[0], [0]]))


def test_gradient_order_puts_the_last_block_first_and_the_model_s_own_tensors_last():
    model = Net()
    groups = [{"params": [p for p in model.parameters() if p.dim() == 2]}, {"params": [p for p in model.parameters() if p.dim() < 2]}]
    order = gradient_order(model, groups)
    assert order.sizes == [[p.numel() for p in g["params"]] for g in groups]
    # embed, hidden.0-2, extra, head weights; then their biases with the norm's weight and bias
    assert order.ready == [[3, 2, 1, 0, 3, 3], [3, 2, 1, 0, 3, 3, 3, 3]]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(16, 64)
        self.hidden = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(3))
        self.norm = torch.nn.LayerNorm(64)
        self.extra = torch.nn.Linear(64, 64)  # unused on some steps of some ranks
        self.head = torch.nn.Linear(64, 4)

    def forward(self, x, use_extra=True):
        h = torch.tanh(self.embed(x))
        for layer in self.hidden:
            h = h + torch.tanh(layer(h))
        if use_extra:
            h = h + self.extra(h)
        return self.head(self.norm(h))


def test_listing_order_interleaves_the_groups_as_backward_finishes_the_layers():
    model = Net()
    groups = _optimizer("onebit_adam", model, None).param_groups
    sizes = [[p.numel() for p in g["params"]] for g in groups]
    by_group = plan_buckets(sizes, 2, 4096, 1024)  # the groups one after the other: every bias and norm first
    by_layer = plan_buckets(sizes, 2, 4096, 1024, listing_order(model, groups))
    assert by_group[0].group == 1 and len(by_group[0].tensors) == len(groups[1]["params"])
    # decay group: embed, hidden.0-2, extra, head; the rest: their biases and the norm's two tensors
    assert [(b.group, b.tensors) for b in by_layer] == [(0, [5]), (0, [4]), (0, [3]), (0, [2]), (0, [1]), (1, [7, 6, 5, 4, 3, 2, 1, 0]), (0, [0])]


def _optimizer(name, model, collective):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() == 2]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() == 2)]
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]
    if name == "onebit_adam":
        return OneBitAdam(groups, lr=3e-3, freeze_step=3, collective=collective)
    return ZeroOneAdam(groups, lr=3e-3, var_freeze_step=6, var_update_scaler=1, local_steps="fixed", local_step_interval=2, collective=collective)


def _train(rank, name, collective, steps, accum=2, state=None, first=0, clip=None):
    """Train `steps` steps from step `first` (from `state` if given; clip_by_bucket(`clip`)); each step's
    parameters, error buffers, whether the step synced and how many buckets had started before step()."""
    torch.manual_seed(0)
    model = Net()
    opt = _optimizer(name, model, collective)
    opt.clip_by_bucket(clip)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    records = []
    for step in range(first, first + steps):
        generator = torch.Generator().manual_seed(1000 * step + rank)
        for micro in range(accum):
            x = torch.randn(8, 16, generator=generator)
            with opt.no_sync() if micro < accum - 1 else contextlib.nullcontext():
                model(x, use_extra=not (rank == 0 and step % 3 == 0)).pow(2).mean().backward()
        started = opt._next_span
        opt.step()
        opt.zero_grad(set_to_none=True)
        errors = [a.clone() for a in opt.collective.accumulators]
        records.append(([p.detach().clone() for p in model.parameters()], errors, opt.last_step.synced, started))
    return records, {"model": model.state_dict(), "optimizer": opt.state_dict()}


def _paths(rank, world_size, ranks_per_node):
    """Every optimizer, bucketed in step() and overlapped, and the overlapped run resumed half way."""
    if ranks_per_node:
        factory = functools.partial(ClusterCollective, "hierarchical", ranks_per_node)
    else:
        factory = functools.partial(lambda **kw: functools.partial(BucketedCollective, inner=OneBitAllReduce, **kw))
    results = {}
    for name in ("onebit_adam", "zero_one_adam"):
        plain, _ = _train(rank, name, factory(bucket_cap_mb=CAP_MB, overlap=False), 12)
        overlapped, _ = _train(rank, name, factory(bucket_cap_mb=CAP_MB, overlap=True), 12)
        half, state = _train(rank, name, factory(bucket_cap_mb=CAP_MB, overlap=True), 7)
        resumed, _ = _train(rank, name, factory(bucket_cap_mb=CAP_MB, overlap=True), 5, state=state, first=7)
        results[name] = (plain, overlapped, half + resumed)
    dist.barrier()
    return results


@pytest.mark.slow
@pytest.mark.parametrize(("world_size", "ranks_per_node"), [(2, 0), (3, 0), (4, 2)])
def test_overlapped_rounds_equal_the_same_buckets_in_step_bit_for_bit(world_size, ranks_per_node):
    every = run_ranks(_paths, world_size, ranks_per_node, timeout=600)
    for name in ("onebit_adam", "zero_one_adam"):
        for rank, results in enumerate(every):
            plain, overlapped, resumed = results[name]
            for step, (a, b, c) in enumerate(zip(plain, overlapped, resumed)):
                for x, y, z in zip(a[0] + a[1], b[0] + b[1], c[0] + c[1]):
                    assert torch.equal(x, y), f"{name} rank {rank} step {step}: overlapped differs"
                    assert torch.equal(x, z), f"{name} rank {rank} step {step}: resumed differs"
                assert a[2] == b[2]
            # the overlapped run started rounds during backward (all but those after an unused parameter)
            assert any(r[3] > 0 for r in overlapped) and all(r[3] == 0 for r in plain)
        for step in range(12):  # every rank on the same parameters after a sync
            if every[0][name][1][step][2]:
                for other in every[1:]:
                    for x, y in zip(every[0][name][1][step][0], other[name][1][step][0]):
                        assert torch.equal(x, y), f"{name} step {step}: ranks differ after a sync"


def _clipped_paths(rank, world_size):
    """0/1 Adam clipped by bucket: in step(), overlapped, and not clipped."""
    factory = lambda overlap: functools.partial(BucketedCollective, inner=OneBitAllReduce, bucket_cap_mb=CAP_MB, overlap=overlap)
    plain, _ = _train(rank, "zero_one_adam", factory(overlap=False), 8, clip=0.05)
    overlapped, _ = _train(rank, "zero_one_adam", factory(overlap=True), 8, clip=0.05)
    unclipped, _ = _train(rank, "zero_one_adam", factory(overlap=True), 8)
    return plain, overlapped, unclipped


@pytest.mark.slow
def test_rounds_clipped_by_bucket_start_during_backward_and_equal_the_same_clip_in_step():
    for rank, (plain, overlapped, unclipped) in enumerate(run_ranks(_clipped_paths, 2)):
        for step, (a, b) in enumerate(zip(plain, overlapped)):
            assert all(torch.equal(x, y) for x, y in zip(a[0] + a[1], b[0] + b[1])), f"rank {rank} step {step}: overlapped differs"
        assert any(r[3] > 0 for r in overlapped) and all(r[3] == 0 for r in plain)  # started during backward, clipped
        assert not all(torch.equal(x, y) for x, y in zip(overlapped[-1][0], unclipped[-1][0]))  # and the clip did something


def test_clip_by_bucket_scales_each_bucket_to_its_share_of_the_norm():
    # One rank, a bucket per tensor: 3 of the 4 elements in one (norm 5: its limit 2 * sqrt(3/4) clips it),
    # 1 in the other (norm 0.5, under its limit 2 * sqrt(1/4) = 1: left as it is).
    big, small = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(1))
    collective = functools.partial(BucketedCollective, inner=OneBitAllReduce, bucket_cap_mb=3 * 4 / 2**20)
    opt = ZeroOneAdam([big, small], lr=1e-3, collective=collective)
    opt.clip_by_bucket(2.0)
    big.grad, small.grad = torch.tensor([3.0, 4.0, 0.0]), torch.tensor([0.5])
    opt.step()
    assert torch.allclose(big.grad, torch.tensor([3.0, 4.0, 0.0]) * (2 * 0.75**0.5 / (5 + 1e-6)))
    assert torch.equal(small.grad, torch.tensor([0.5]))
    with pytest.raises(ValueError, match="positive max_norm or None"):
        opt.clip_by_bucket(0.0)
    # DiLoCo without buckets: each parameter group is the bucket; its inner AdamW steps on the clipped gradient
    weight, bias = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(4))
    diloco = DiLoCo([{"params": [weight]}, {"params": [bias]}], lr=1e-3, sync_every=4)
    diloco.clip_by_bucket(1.0)
    weight.grad, bias.grad = torch.full((2, 2), 3.0), torch.full((4,), 0.1)  # norms 6 (limit sqrt(1/2)) and 0.2 (under it)
    diloco.step()
    assert torch.allclose(weight.grad, torch.full((2, 2), 3.0 * 0.5**0.5 / (6 + 1e-6))) and torch.equal(bias.grad, torch.full((4,), 0.1))


def _second_backward(rank, world_size):
    torch.manual_seed(0)
    model = Net()
    opt = _optimizer("onebit_adam", model, functools.partial(BucketedCollective, inner=OneBitAllReduce, bucket_cap_mb=CAP_MB, overlap=True))
    x = torch.randn(8, 16)
    model(x).sum().backward()
    try:
        model(x).sum().backward()
    except RuntimeError as error:
        message = str(error)
    else:
        message = None
    opt.step()  # the rounds that did start finish: the ranks stay matched
    return message


@pytest.mark.slow
def test_a_second_backward_without_no_sync_is_refused():
    messages = run_ranks(_second_backward, 2)
    assert all(m and "no_sync()" in m for m in messages)


def _another_bucketing(rank, world_size):
    """A state saved in buckets of one size, loaded with another and without buckets: refused as a change
    of layout; resharded, it continues with the same parameters and moments."""
    bucketed = functools.partial(BucketedCollective, inner=OneBitAllReduce, bucket_cap_mb=CAP_MB)
    _, state = _train(rank, "zero_one_adam", bucketed, 3)
    refusals = []
    for collective in (functools.partial(BucketedCollective, inner=OneBitAllReduce, bucket_cap_mb=CAP_MB / 2), OneBitAllReduce):
        torch.manual_seed(0)
        model = Net()
        opt = _optimizer("zero_one_adam", model, collective)
        try:
            opt.load_state_dict(state["optimizer"])
        except TopologyChanged as error:
            refusals.append(str(error))
        opt.load_resharded(state["optimizer"])
        moments = [b.clone() for b in opt._buffers[0].values()]
        values = lambda t: t[t != 0].sort().values  # noqa: E731 -- the same values, moved to the new layout
        refusals.append(all(torch.equal(values(m), values(b)) for m, b in zip(moments, state["optimizer"]["zoa"]["buffers"][0].values())))
    return refusals


@pytest.mark.slow
def test_another_bucketing_is_refused_as_a_change_of_layout_and_reshards():
    for refusals in run_ranks(_another_bucketing, 2):
        assert ["comm.bucket_cap_mb" in refusals[0], refusals[1], "comm.bucket_cap_mb" in refusals[2], refusals[3]] == [True] * 4, refusals


def _timed_rounds(rank, world_size):
    """The ledger's round and exposed seconds of one exchange of 2M elements in 1 MB buckets: in the
    caller, and started before the caller spends a second elsewhere (as backward does)."""
    seconds = []
    for overlap in (False, True):
        ledger = CommLedger(num_params=2**21)
        collective = BucketedCollective([2**21], inner=OneBitAllReduce, bucket_cap_mb=1.0, overlap=overlap, ledger=ledger)
        out = torch.zeros(collective.layouts[0].padded)
        for bucket in collective.buckets:
            collective.accumulators[0][bucket.start : bucket.stop].normal_()
            collective.start_exchange(bucket.index, out)
        time.sleep(1.0)  # the caller's backward: Gloo and the comm thread go on meanwhile
        collective.wait()
        seconds.append((ledger.round_seconds, ledger.exposed_seconds))
    return seconds


def test_the_ledger_times_rounds_and_what_step_waited_of_them():
    for (in_step, in_step_waited), (overlapped, overlapped_waited) in run_ranks(_timed_rounds, 2):
        assert in_step > 0 and in_step_waited == in_step  # in the caller all of it is exposed
        assert overlapped > 0 and 0 < overlapped_waited < 0.1  # finished while the caller slept; the wait is still recorded
