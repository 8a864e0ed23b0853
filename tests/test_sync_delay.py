"""0/1 Adam's delayed sync (`sync_delay` 1, docs/algorithm.md "Delayed sync"): a sync step's 1-bit round
runs behind the next step's forward and backward and lands at the next step() before anything else.

- where the gradients do not depend on the parameters, the delay changes nothing: the delayed run equals
  the in-step run bit for bit (parameters, momentum, error buffers, the ledger), unbucketed, in
  buckets and node-aware on 2 x 2; so the only effect of the delay is where the next gradient is taken;
- with a real model: deterministic, the anchor (the point of the last applied sync) identical on every
  rank after every step, the parameters identical after synchronize(), and a resume from a state saved
  with a round in flight continues the uninterrupted run bit for bit;
- sharded inside the node (FSDP2, 2 nodes x 2 ranks), 0/1 Adam and DiLoCo: the same, on the shards.
"""

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_ranks

from zoa_train.comm import ClusterCollective, OneBitAllReduce
from zoa_train.comm.buckets import BucketedCollective
from zoa_train.comm.sharding import local_shard, shard_model
from zoa_train.optim import ZeroOneAdam
from zoa_train.optim.diloco import DiLoCo

# variance steps (dense, then every other), 1-bit syncs before and after the freeze, local steps
SCHEDULE = dict(var_freeze_step=8, var_update_scaler=2, local_steps="fixed", local_step_interval=3)
BUCKETED = functools.partial(BucketedCollective, inner=OneBitAllReduce, bucket_cap_mb=300 * 4 / 2**20)
# by name, made in the ranks: a collective that holds process groups must not outlive the ranks' group
COLLECTIVES = {
    "flat": lambda: OneBitAllReduce,
    "buckets": lambda: BUCKETED,
    "node-aware": lambda: ClusterCollective("hierarchical", ranks_per_node=2),  # 2 nodes x 2: node groups used from the round's thread
}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(40, 16)  # rows without gradient on most steps
        self.hidden = torch.nn.Linear(16, 32)
        self.head = torch.nn.Linear(32, 5)

    def forward(self, tokens):
        return self.head(torch.tanh(self.hidden(self.embed(tokens).mean(1))))


def _optimizer(model, delay, collective=OneBitAllReduce):
    matrices = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    groups = [{"params": matrices, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]
    return ZeroOneAdam(groups, lr=3e-3, collective=collective, sync_delay=delay, **SCHEDULE)


def _state(model, opt):
    flat = [t.clone() for t in model.parameters()]
    buffers = [b.clone() for group in opt._buffers for b in group.values()]
    errors = [e.clone() for state in opt.collective.state_dicts() for e in _tensors(state)]
    return flat, buffers, errors


def _tensors(state):
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []


def _fixed_gradients(rank, world_size, delay, collective, steps=20):
    """Gradients that depend on the step and the rank only; the state after synchronize()."""
    torch.manual_seed(0)
    model = Net()
    opt = _optimizer(model, delay, collective)
    kinds = []
    for step in range(steps):
        generator = torch.Generator().manual_seed(100 * step + rank)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=generator)
        model.embed.weight.grad[10:] = 0  # rows that never get a gradient
        opt.step()
        kinds.append(opt.last_step.kind)
    opt.synchronize()
    return _state(model, opt), opt.ledger.summary(), kinds


def _both_ways(rank, world_size, names):
    return [(_fixed_gradients(rank, world_size, 0, COLLECTIVES[n]()), _fixed_gradients(rank, world_size, 1, COLLECTIVES[n]())) for n in names]


def _check_equal(in_step, delayed):
    (state0, ledger0, kinds0), (state1, ledger1, kinds1) = in_step, delayed
    assert kinds0 == kinds1 and set(kinds0) == {"v", "s", "l"}  # variance, 1-bit and local steps
    for part0, part1 in zip(state0, state1):
        assert all(torch.equal(a, b) for a, b in zip(part0, part1))
    assert ledger0 == ledger1  # the same bits, rounds and bytes, each round counted in its own step
    torch.manual_seed(0)
    start = Net().embed.weight.detach()[10:]  # rows that never had a gradient: only weight decay moved them
    assert torch.allclose(state1[0][0][10:], start * (1 - 3e-3 * 0.01) ** len(kinds1), rtol=1e-6, atol=0)


def test_the_delay_changes_nothing_where_gradients_do_not_depend_on_the_parameters():
    for world_size, names in ((2, ["flat", "buckets"]), (4, ["node-aware"])):
        for rank in run_ranks(_both_ways, world_size, names):
            for in_step, delayed in rank:
                _check_equal(in_step, delayed)


def _real(rank, world_size, steps, save_at=None, state=None):
    return train_delayed(rank, world_size, Net, lambda model: _optimizer(model, 1), steps, save_at, state)


def train_delayed(rank, world_size, model_class, make_optimizer, steps, save_at=None, state=None):
    """A real model (`model_class()`, seeded) with its delayed optimizer (`make_optimizer(model)`) on each
    rank's own batches: per step whether the anchors agree on every rank, and the final parameters after
    synchronize(); with `save_at` the states saved after that step (tests/test_diloco_delay.py too)."""
    torch.manual_seed(0)
    model = model_class()
    opt = make_optimizer(model)
    first = 0
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        first = state["step"]
    anchors_agree, saved = [], None
    for step in range(first, steps):
        generator = torch.Generator().manual_seed(100 * step + rank)
        tokens = torch.randint(0, 10, (8, 6), generator=generator)
        labels = torch.randint(0, 5, (8,), generator=generator)
        torch.nn.functional.cross_entropy(model(tokens), labels).backward()
        opt.step()
        opt.zero_grad()
        anchor = torch.cat([group["anchor"] for group in opt._buffers])
        every = [torch.empty_like(anchor) for _ in range(world_size)]
        dist.all_gather(every, anchor)
        anchors_agree.append(all(torch.equal(a, every[0]) for a in every))
        if step + 1 == save_at:
            in_flight = opt._in_flight
            saved = {
                "model": {k: v.clone() for k, v in model.state_dict().items()},
                "optimizer": copy.deepcopy(opt.state_dict()),
                "step": save_at,
                "in_flight": in_flight,
            }
    opt.synchronize()
    final = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(final) for _ in range(world_size)]
    dist.all_gather(every, final)
    return final, all(torch.equal(f, every[0]) for f in every), anchors_agree, saved, opt.ledger.summary()


def _twice(rank, world_size, steps, save_at):
    return _real(rank, world_size, steps, save_at), _real(rank, world_size, steps)


def _resumed(rank, world_size, steps, states):
    return _real(rank, world_size, steps, state=states[rank])


def test_a_delayed_run_is_deterministic_keeps_its_ranks_together_and_resumes_exactly():
    steps, save_at = 16, 11  # the 11th step is a sync after the freeze (vvvsvsvsllsll...): its round in flight when saved
    runs = run_ranks(_twice, 2, steps, save_at)
    for (final, agree, anchors, saved, ledger), (final2, _, _, _, ledger2) in runs:
        assert torch.equal(final, final2) and ledger == ledger2
        assert agree and all(anchors)
        assert saved["in_flight"]
    resumed = run_ranks(_resumed, 2, steps, [first[3] for first, _ in runs])
    for ((final, _, _, _, ledger), _), (final2, agree, anchors, _, ledger2) in zip(runs, resumed):
        assert torch.equal(final, final2) and ledger == ledger2 and agree and all(anchors)


def test_a_delay_the_optimizer_cannot_run_is_refused():
    with pytest.raises(ValueError, match="sync_delay must be 0"):
        _optimizer(Net(), 2)
    overlapped = functools.partial(BucketedCollective, inner=OneBitAllReduce, overlap=True)
    with pytest.raises(ValueError, match="comm.overlap false"):
        _optimizer(Net(), 1, overlapped)


def _sharded(rank, world_size, steps, save_at):
    """2 nodes x 2 ranks, sharded inside the node (FSDP2), each delayed optimizer with its in-step twin:
    fixed gradients in both; then a real backward delayed, saved after `save_at` with a round in flight
    and resumed from there. The shards after synchronize()."""
    from test_sharded import Blocks, _batch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("node", "local"))
    makers = {
        "zero_one_adam": lambda params, delay: ZeroOneAdam(
            params, lr=3e-3, weight_decay=0.01, process_group=mesh.get_group("node"), sync_delay=delay, **SCHEDULE
        ),
        "diloco": lambda params, delay: DiLoCo(params, lr=3e-3, weight_decay=0.01, sync_every=4, process_group=mesh.get_group("node"), sync_delay=delay),
    }

    def train(name, delay, real, state=None):
        torch.manual_seed(0)
        model = shard_model(Blocks(), mesh["local"])
        opt = makers[name](list(model.parameters()), delay)
        first, kinds, saved = 0, [], None
        if state is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            first = save_at
        for step in range(first, steps):
            if real:
                x, y = _batch(rank, step)
                torch.nn.functional.mse_loss(model(x), y).backward()
            else:  # the same on every run, whatever the parameters
                generator = torch.Generator().manual_seed(100 * step + rank)
                for p in model.parameters():
                    p.grad = DTensor.from_local(torch.randn(local_shard(p).shape, generator=generator), p.device_mesh, p.placements)
            opt.step()
            opt.zero_grad(set_to_none=True)
            kinds.append(opt.last_step.kind)
            if real and step + 1 == save_at:
                in_flight = opt._in_flight  # before state_dict(), which waits for the round
                saved = {"model": copy.deepcopy(model.state_dict()), "optimizer": copy.deepcopy(opt.state_dict()), "in_flight": in_flight}
        opt.synchronize()
        return [local_shard(p).detach().clone() for p in model.parameters()], opt.ledger.summary(), kinds, saved

    runs = {}
    for name in makers:
        in_step, fixed, real = train(name, 0, False), train(name, 1, False), train(name, 1, True)
        runs[name] = in_step, fixed, real, train(name, 1, True, real[3])
    return runs


@pytest.mark.slow
def test_sharded_inside_the_node_the_delay_changes_nothing_where_gradients_do_not_depend_on_the_parameters_and_resumes_exactly():
    ranks = run_ranks(_sharded, 4, 20, 11, sharded=True)  # 0/1 Adam's 11th step syncs (its round in flight when saved), DiLoCo's 12th
    for name in ("zero_one_adam", "diloco"):
        for rank in ranks:
            (shards0, ledger0, kinds0, _), (shards1, ledger1, kinds1, _), real, resumed = rank[name]
            assert kinds0 == kinds1 and ledger0 == ledger1, name
            assert all(torch.equal(a, b) for a, b in zip(shards0, shards1)), name
            assert all(torch.equal(a, b) for a, b in zip(real[0], resumed[0])) and real[1] == resumed[1], name
        for a, b in ((0, 2), (1, 3)):  # a real backward, delayed: the nodes hold the same shards after synchronize()
            assert all(torch.equal(p, q) for p, q in zip(ranks[a][name][2][0], ranks[b][name][2][0])), name
    assert set(ranks[0]["zero_one_adam"][0][2]) == {"v", "s", "l"}
    assert ranks[0]["zero_one_adam"][2][3]["in_flight"]
