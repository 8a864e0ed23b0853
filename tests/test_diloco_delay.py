"""DiLoCo's delayed outer sync (`sync_delay` 1): a step with outer steps due starts their average on a
thread of its own, behind the next step's forward and backward, and the next step() applies them first,
before its inner update (docs/optimizers.md, DiLoCo).

- where the gradients do not depend on the parameters, the delay changes nothing: the delayed run equals
  the in-step run bit for bit after synchronize() (parameters, anchors, outer momentum, inner moments,
  the outer collective's error buffers, the ledger), for the full-precision outer sync (whole and in
  Streaming DiLoCo's fragments), the 1-bit one and the top-k one; so the only effect of the delay is
  where one inner gradient per outer step is taken;
- with a real model: deterministic, the anchors identical on every rank after every step, the parameters
  identical after synchronize(), and a resume from a state saved with an outer round in flight continues
  the uninterrupted run bit for bit.
"""

import functools

import pytest
import torch
from distributed_harness import run_ranks
from test_sync_delay import train_delayed

from zoa_train.comm import OneBitAllReduce, TopKAllReduce
from zoa_train.optim.diloco import DiLoCo

TOPK = functools.partial(TopKAllReduce, density=0.1, chunk=64, error_decay=0.9)
# (outer collective, DiLoCo's knobs): each of its outer syncs; the last step of every run below is an outer step
CASES = {
    "full": (None, dict(sync_every=3)),
    "full in fragments": (None, dict(sync_every=4, fragments=2)),
    "onebit": (OneBitAllReduce, dict(sync_every=3)),
    "topk": (TOPK, dict(sync_every=3)),
}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(40, 16)  # rows without gradient on most steps
        self.hidden = torch.nn.Linear(16, 32)
        self.head = torch.nn.Linear(32, 5)

    def forward(self, tokens):
        return self.head(torch.tanh(self.hidden(self.embed(tokens).mean(1))))


def _optimizer(model, delay, case):
    collective, knobs = CASES[case]
    matrices = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    groups = [{"params": matrices, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]
    return DiLoCo(groups, lr=3e-3, outer_lr=0.7, outer_momentum=0.9, outer_collective=collective, sync_delay=delay, **knobs)


def _tensors(state):
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []


def _state(model, opt):
    params = [t.detach().clone() for t in model.parameters()]
    buffers = [b.clone() for group in opt._buffers for b in group.values()]  # inner m and v, anchor, outer momentum
    errors = [e.clone() for e in _tensors(opt.collective.state_dicts())] if opt.collective is not None else []
    return params, buffers, errors


def _fixed_gradients(rank, world_size, delay, case, steps=12):
    """Gradients that depend on the step and the rank only; the state after synchronize()."""
    torch.manual_seed(0)
    model = Net()
    opt = _optimizer(model, delay, case)
    kinds, in_flight = [], []
    for step in range(steps):
        generator = torch.Generator().manual_seed(100 * step + rank)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=generator)
        model.embed.weight.grad[10:] = 0  # rows that never get a gradient
        opt.step()
        kinds.append(opt.last_step.kind)
        in_flight.append(opt._in_flight)
    opt.synchronize()
    assert not opt._in_flight and not opt._landed and not opt.parameters_differ
    return _state(model, opt), opt.ledger.summary(), "".join(kinds), in_flight


def _both_ways(rank, world_size):
    return {case: (_fixed_gradients(rank, world_size, 0, case), _fixed_gradients(rank, world_size, 1, case)) for case in CASES}


def test_the_delay_changes_nothing_where_gradients_do_not_depend_on_the_parameters():
    for rank in run_ranks(_both_ways, 2):
        for case, ((state0, ledger0, kinds0, flight0), (state1, ledger1, kinds1, flight1)) in rank.items():
            assert kinds0 == kinds1 and set(kinds0) == {"l", "o"}, case  # inner and outer steps
            assert not any(flight0) and flight1 == [kind == "o" for kind in kinds1], case  # every outer round delayed, and only with the delay
            for part0, part1 in zip(state0, state1):
                assert len(part0) == len(part1) and all(torch.equal(a, b) for a, b in zip(part0, part1)), case
            assert ledger0 == ledger1, case  # the same bits, rounds and bytes, each round counted in its own step


def _real(rank, world_size, case, steps, save_at=None, state=None):
    return train_delayed(rank, world_size, Net, lambda model: _optimizer(model, 1, case), steps, save_at, state)


REAL = ("full in fragments", "topk")  # a pending fragment of several; the outer collective's own buffers
STEPS, SAVE_AT = 10, 6  # the 6th step is an outer step (of fragment 0; of the whole model at sync_every 3): its round in flight when saved


def _twice(rank, world_size):
    return {case: (_real(rank, world_size, case, STEPS, SAVE_AT), _real(rank, world_size, case, STEPS)) for case in REAL}


def _resumed(rank, world_size, states):
    return {case: _real(rank, world_size, case, STEPS, state=states[rank][case]) for case in REAL}


def test_a_delayed_run_is_deterministic_keeps_its_ranks_together_and_resumes_exactly():
    runs = run_ranks(_twice, 2)
    for rank in runs:
        for case, ((final, agree, anchors, saved, ledger), (final2, _, _, _, ledger2)) in rank.items():
            assert torch.equal(final, final2) and ledger == ledger2, case
            assert agree and all(anchors), case
            assert saved["in_flight"], case
    resumed = run_ranks(_resumed, 2, [{case: first[3] for case, (first, _) in rank.items()} for rank in runs])
    for rank, again in zip(runs, resumed):
        for case, ((final, _, _, _, ledger), _) in rank.items():
            final2, agree, anchors, _, ledger2 = again[case]
            assert torch.equal(final, final2) and ledger == ledger2 and agree and all(anchors), case


def test_one_rank_has_nothing_to_delay_and_the_knob_is_checked():
    torch.manual_seed(0)
    model = Net()
    opt = _optimizer(model, 1, "full")
    assert opt._round_thread is None and opt.max_steps_apart == 3 + 1
    with pytest.raises(ValueError, match="sync_delay must be 0"):
        _optimizer(Net(), 2, "full")
