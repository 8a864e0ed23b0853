"""Multi-process properties of the three optimizers (Gloo on CPU)."""

import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_ranks
from reference import ExactAllReduce, zero_one_adam_reference

from zoa_train.comm import ClusterCollective, OneBitAllReduce
from zoa_train.optim import DataParallelAdam, LRSchedule, OneBitAdam, ZeroOneAdam, ZeroOneSchedule
from zoa_train.optim import zero_one_adam as zero_one_adam_module

DIM = 40


def quadratic_problem(rank: int, step: int):
    """Rank- and step-dependent least squares: grad = A^T (A x - b)."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    a = torch.randn(8, DIM, generator=g)
    b = torch.randn(8, generator=g) + rank
    return a, b


def quadratic_grad(rank, step, x):
    a, b = quadratic_problem(rank, step)
    return a.T @ (a @ x - b)


def x0():
    return torch.linspace(-1, 1, DIM)


def _train_quadratic(rank, world_size, name, kwargs, steps, exact, lr_kwargs):
    lr = lr_kwargs if callable(lr_kwargs) else LRSchedule(**lr_kwargs)
    x = torch.nn.Parameter(x0())
    cls = {"zero_one": ZeroOneAdam, "onebit": OneBitAdam, "adam": DataParallelAdam}[name]
    opt = cls([x], lr=lr(0), **kwargs, **({"collective": ExactAllReduce} if exact else {}))
    records = []
    for t in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr(t)
        x.grad = quadratic_grad(rank, t, x.detach())
        opt.step()
        records.append(opt.last_step)
    return x.detach().clone(), opt._flat[0].views(opt._buffers[0]["exp_avg"])[0].clone(), records


LR = dict(name="exponential", lr=0.02, warmup_steps=5, decay_factor=0.5, decay_every=10)


@pytest.mark.slow
def test_exact_compressor_zero_one_adam_equals_adam_when_every_step_updates_the_variance():
    every_step = dict(var_freeze_step=1000, var_update_scaler=10**6)
    zero_one = run_ranks(_train_quadratic, 2, "zero_one", every_step, 50, True, LR)
    adam = run_ranks(_train_quadratic, 2, "adam", {}, 50, False, LR)
    onebit = run_ranks(_train_quadratic, 2, "onebit", dict(freeze_step=1000), 50, False, LR)
    for r in range(2):
        torch.testing.assert_close(zero_one[r][0], adam[r][0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(onebit[r][0], adam[r][0], rtol=1e-6, atol=1e-6)
        assert all(rec.variance_updated and rec.synced for rec in zero_one[r][2])


@pytest.mark.slow
def test_exact_compressor_zero_one_adam_follows_algorithm_1_through_freeze_and_local_steps():
    knobs = dict(var_freeze_step=12, var_update_scaler=2, local_steps="lr", local_step_clip=4)
    # update_clip off: Algorithm 1 has no clipping (and on this problem the clip would act); nor bias correction.
    ranks = run_ranks(_train_quadratic, 2, "zero_one", dict(knobs, weight_decay=0.1, update_clip=None, bias_correction=False), 50, True, LR)
    lr = LRSchedule(**LR)
    xs, ms = zero_one_adam_reference(x0(), quadratic_grad, 2, 50, lr, ZeroOneSchedule(**knobs), weight_decay=0.1)
    records = ranks[0][2]
    assert any(not rec.synced for rec in records) and any(rec.interval == 4 for rec in records)
    for r in range(2):
        torch.testing.assert_close(ranks[r][0], xs[r], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ranks[r][1], ms[r], rtol=1e-5, atol=1e-5)


def restarting_lr(t: int) -> float:
    """Halved every 4 steps and back to the top at step 24 (a warm restart): with local_steps "lr"
    the sync interval then drops from 8 to 1 in the middle of a local-step period."""
    return 0.02 * 0.5 ** ((t % 24) // 4)


@pytest.mark.slow
def test_exact_compressor_zero_one_adam_follows_algorithm_1_when_the_interval_shrinks():
    knobs = dict(var_freeze_step=8, var_update_scaler=2, local_steps="lr", local_step_clip=8)
    algorithm_1 = dict(knobs, weight_decay=0.1, update_clip=None, bias_correction=False)
    ranks = run_ranks(_train_quadratic, 2, "zero_one", algorithm_1, 40, True, restarting_lr)
    xs, ms = zero_one_adam_reference(x0(), quadratic_grad, 2, 40, restarting_lr, ZeroOneSchedule(**knobs), weight_decay=0.1)
    syncs = [t for t, rec in enumerate(ranks[0][2]) if rec.synced]
    # a sync that ends more local steps than its own interval (the displacement of all must count)
    assert any(b - a > ranks[0][2][b].interval for a, b in zip(syncs, syncs[1:]))
    for r in range(2):
        torch.testing.assert_close(ranks[r][0], xs[r], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ranks[r][1], ms[r], rtol=1e-5, atol=1e-5)


def _collective(ranks_per_node: int):
    """The flat 1-bit allreduce, or the node-aware one on nodes of `ranks_per_node` ranks."""
    return ClusterCollective("hierarchical", ranks_per_node) if ranks_per_node else OneBitAllReduce


def _sync_invariants(rank, world_size, weight_decay, update_clip=None, ranks_per_node=0, fused_finish=True):
    torch.manual_seed(0)  # the same init everywhere; the optimizer broadcasts rank 0's anyway
    if not fused_finish:  # the end of each sync in torch ops rather than the native one-pass kernel
        zero_one_adam_module.fused_sync_finish = lambda device: None
    emb = torch.nn.Embedding(20, 6)
    head = torch.nn.Linear(6, 3)
    frozen_rows = emb.weight.detach()[10:].clone()
    params = [{"params": emb.parameters()}, {"params": head.parameters(), "lr": 0.02}, {"params": []}]
    opt = ZeroOneAdam(
        params,
        lr=0.05,
        weight_decay=weight_decay,
        var_freeze_step=8,
        var_update_scaler=2,
        local_steps="fixed",
        local_step_interval=3,
        update_clip=update_clip,
        collective=_collective(ranks_per_node),
    )
    lr_products = torch.ones(())
    snapshots = []
    for t in range(30):
        g = torch.Generator().manual_seed(100 * rank + t)
        tokens = torch.randint(0, 10, (16,), generator=g)  # rows 10.. never get a gradient
        loss = torch.nn.functional.cross_entropy(head(emb(tokens)), torch.randint(0, 3, (16,), generator=g))
        opt.zero_grad()
        loss.backward()
        if t % 5 == 0:
            head.bias.grad = None  # a parameter without gradient in a step
        opt.step()
        lr_products *= 1 - 0.05 * weight_decay
        if opt.last_step.synced:
            flat = torch.cat([p.detach().reshape(-1) for p in opt.param_groups[0]["params"] + opt.param_groups[1]["params"]])
            momentum = torch.cat([b["exp_avg"] for b in opt._buffers])
            snapshots.append((t, flat.clone(), momentum.clone()))
    opt.synchronize()  # ends the last local-step period, whose weight decay comes at its sync
    return snapshots, emb.weight.detach()[10:].clone(), frozen_rows * lr_products, opt.ledger.average_bits_per_param


@pytest.mark.slow
@pytest.mark.parametrize("world_size,update_clip,ranks_per_node", [(2, None, 0), (3, None, 0), (2, 0.05, 0), (4, None, 2)])
def test_real_compression_keeps_ranks_bit_identical_and_zero_gradient_rows_still(world_size, update_clip, ranks_per_node):
    # update_clip 0.05 clips nearly every step, each rank by its own factors; 4 ranks as 2 nodes x 2
    # through the node-aware sync.
    ranks = run_ranks(_sync_invariants, world_size, 0.0, update_clip, ranks_per_node)
    steps = [t for t, _, _ in ranks[0][0]]
    assert len(steps) >= 12 and any(b - a == 3 for a, b in zip(steps, steps[1:]))  # local steps happened
    for r in range(1, world_size):
        for (t0, x0_, m0), (t1, x1, m1) in zip(ranks[0][0], ranks[r][0]):
            assert t0 == t1 and torch.equal(x0_, x1) and torch.equal(m0, m1), f"rank {r} differs at step {t0}"
    for _, rows, initial_rows, bits in ranks:
        assert torch.equal(rows, initial_rows)  # never-used embedding rows did not move
        assert 0 < bits < 8


@pytest.mark.slow
def test_the_fused_end_of_a_sync_trains_to_the_same_bits_as_the_torch_ops():
    # 1-bit syncs after local-step periods, weight decay (a decay factor at each sync), rows whose
    # variance stays zero (an infinite denominator), a tensor without gradient on some steps.
    assert zero_one_adam_module.fused_sync_finish("cpu") is not None  # the native kernel is built here
    fused, plain = (run_ranks(_sync_invariants, 2, 0.1, None, 0, fused_finish) for fused_finish in (True, False))
    for rank in range(2):
        assert len(fused[rank][0]) >= 12
        for (t0, x0_, m0), (t1, x1, m1) in zip(fused[rank][0], plain[rank][0], strict=True):
            assert t0 == t1 and torch.equal(x0_, x1) and torch.equal(m0, m1), f"rank {rank} differs at step {t0}"
        assert torch.equal(fused[rank][1], plain[rank][1])


@pytest.mark.slow
def test_weight_decay_only_shrinks_zero_gradient_rows():
    snapshots, rows, decayed_rows, _ = run_ranks(_sync_invariants, 2, 0.1)[0]
    torch.testing.assert_close(rows, decayed_rows, rtol=1e-6, atol=1e-7)


def _largest_steps(rank, world_size, steps):
    """Largest |step| / lr of each half of one tensor: half its coordinates get gradients of size 1,
    half of size 1e-4 (a rarely used embedding row next to busy ones), compressed every step."""
    x = torch.nn.Parameter(torch.zeros(4096))
    lr = 0.01
    opt = ZeroOneAdam([x], lr=lr, bias_correction=True, var_freeze_step=steps, var_update_scaler=1)  # variance at 0, 1, 3, 7, ...
    largest = torch.zeros(2)
    for t in range(steps):
        g = torch.Generator().manual_seed(100 * rank + t)
        x.grad = torch.randn(4096, generator=g) * torch.cat([torch.ones(2048), torch.full((2048,), 1e-4)])
        before = x.detach().clone()
        opt.step()
        largest = torch.maximum(largest, (x.detach() - before).abs().view(2, -1).amax(dim=1) / lr)
    return largest


@pytest.mark.slow
def test_compressed_steps_keep_rare_coordinates_at_adams_step_size():
    # Adam moves every coordinate by about lr however small its gradients; a 1-bit gradient of one
    # scale per row would give the rare half the busy half's size, divided by its small sqrt(v).
    largest = run_ranks(_largest_steps, 2, 40)[0]
    assert largest.max() < 6, largest


def _steps_after_a_gradient_jump(rank, world_size, update_clip):
    """RMS of each step / lr on the 1-bit steps after the gradient grows 1,000x, before the freeze."""
    x = torch.nn.Parameter(torch.zeros(4096))
    lr = 0.01
    # No bias correction: the step is then lr times the clipped m/d, whose RMS the clip bounds.
    opt = ZeroOneAdam([x], lr=lr, var_freeze_step=100, var_update_scaler=1, update_clip=update_clip, bias_correction=False)
    sizes = []
    for t in range(7):  # variance steps at 0, 1, 3 (and 7): steps 4, 5, 6 use the v of step 3
        g = torch.Generator().manual_seed(100 * rank + t)
        x.grad = torch.randn(4096, generator=g) * (1e-3 if t < 4 else 1.0)
        before = x.detach().clone()
        opt.step()
        assert opt.last_step.variance_updated == (t in (0, 1, 3))
        sizes.append(float((x.detach() - before).pow(2).mean().sqrt() / lr))
    return sizes[4:]


@pytest.mark.slow
def test_update_clip_bounds_steps_taken_with_a_stale_variance():
    # Adam's step is about lr whatever the gradient does; with v from before a 1,000x jump, m/d
    # is ~100 per coordinate until the next variance update.
    unclipped = run_ranks(_steps_after_a_gradient_jump, 2, None)[0]
    clipped = run_ranks(_steps_after_a_gradient_jump, 2, 1.0)[0]
    assert min(unclipped) > 20, unclipped
    assert max(clipped) < 1.5, clipped


def test_update_clip_must_be_positive():
    with pytest.raises(ValueError, match="update_clip"):
        ZeroOneAdam([torch.nn.Parameter(torch.zeros(2))], update_clip=0.0)


def test_variance_weighted_by_steps_is_the_default_weighting_when_every_step_updates_it():
    # Every step to the freeze at 20 updates v (gaps of 1), then local steps as the lr halves: the
    # two weightings take the same steps to the bit, through the freeze and the local steps.
    knobs = dict(var_freeze_step=20, var_update_scaler=10**6, local_steps="lr", local_step_clip=4)
    runs = {w: run_ranks(_train_quadratic, 2, "zero_one", dict(knobs, var_update_weighting=w), 50, False, LR) for w in ("updates", "steps")}
    assert any(not rec.synced for rec in runs["steps"][0][2])
    for r in range(2):
        assert torch.equal(runs["updates"][r][0], runs["steps"][r][0]) and torch.equal(runs["updates"][r][1], runs["steps"][r][1])


VARIANCE_BETAS = (0.9, 0.8)  # a small b2, so that each weight in v is far from its neighbours


def _variance_gradient(rank: int, t: int) -> torch.Tensor:
    return torch.randn(6, generator=torch.Generator().manual_seed(10 * rank + t)) * (t + 1)


def _variance_after_gaps(rank, world_size, weighting):
    """Steps 0-7 with variance updates at 0, 1, 3 and 7 (kappa 1); at step 7: x before and after, m, v."""
    x = torch.nn.Parameter(torch.zeros(6))
    opt = ZeroOneAdam([x], lr=0.01, betas=VARIANCE_BETAS, var_freeze_step=100, var_update_scaler=1, var_update_weighting=weighting)
    for t in range(8):
        x.grad = _variance_gradient(rank, t)  # independent of x
        before = x.detach().clone()
        opt.step()
    assert opt.last_step.variance_updated
    m, v = (opt._flat[0].views(opt._buffers[0][name])[0].clone() for name in ("exp_avg", "exp_avg_sq"))
    return before, x.detach().clone(), m, v


@pytest.mark.parametrize("weighting", ["updates", "steps"])
def test_variance_and_its_bias_correction_weigh_updates_or_steps(weighting):
    b1, b2 = VARIANCE_BETAS
    updates = [0, 1, 3, 7]
    g2 = {t: ((_variance_gradient(0, t) + _variance_gradient(1, t)) / 2) ** 2 for t in updates}  # the averaged gradient, squared
    if weighting == "updates":  # one Adam step per update: sum_j (1-b2) b2^(3-j) g_j^2, over 4 "steps"
        v = sum((1 - b2) * b2 ** (3 - j) * g2[t] for j, t in enumerate(updates))
        covered = 4
    else:  # each step s of 0..7 holds the gradient of the first update at or after it: 0, 1, 3, 3, 7, 7, 7, 7
        v = sum((1 - b2) * b2 ** (7 - s) * g2[next(t for t in updates if t >= s)] for s in range(8))
        covered = 8
    before, after, m, v_seen = run_ranks(_variance_after_gaps, 2, weighting)[0]
    torch.testing.assert_close(v_seen, v, rtol=1e-6, atol=0)
    # the variance step 7 moves x by lr/(1-b1^8) * m / (sqrt(v / (1-b2^covered)) + eps)
    step = 0.01 / (1 - b1**8) * m / ((v / (1 - b2**covered)).sqrt() + 1e-8)
    torch.testing.assert_close(before - after, step, rtol=1e-5, atol=1e-9)


def test_var_update_weighting_must_be_updates_or_steps():
    from zoa_train.config import recipe_from_dict
    from zoa_train.errors import UserError

    with pytest.raises(ValueError, match="var_update_weighting must be one of updates, steps, not 'step'"):
        ZeroOneAdam([torch.nn.Parameter(torch.zeros(2))], var_update_weighting="step")
    with pytest.raises(UserError, match=r"optimizer.var_update_weighting must be one of updates, steps, not 'step'\.$"):
        recipe_from_dict({"optimizer": {"var_update_weighting": "step"}})


def _momentum_under_weight_decay(rank, world_size, weight_decay):
    x = torch.nn.Parameter(torch.ones(64))
    opt = ZeroOneAdam([x], lr=0.01, weight_decay=weight_decay, var_freeze_step=4, var_update_scaler=1, local_steps="fixed", local_step_interval=2)
    out = []
    for t in range(20):
        x.grad = torch.randn(64, generator=torch.Generator().manual_seed(10 * rank + t))  # independent of x
        opt.step()
        out.append(opt._buffers[0]["exp_avg"].clone())
    return out


@pytest.mark.slow
def test_weight_decay_does_not_leak_into_the_rebuilt_momentum():
    plain = run_ranks(_momentum_under_weight_decay, 2, 0.0)[0]
    decayed = run_ranks(_momentum_under_weight_decay, 2, 0.5)[0]
    # Equal to rounding: the displacement anchor - x is rounded at the (decayed) parameters' scale.
    # A leak would be of the order lr * wd = 0.005 of the momentum.
    for a, b in zip(plain, decayed):
        assert (a - b).abs().max() <= 1e-5 * a.abs().max()


def _resume(rank, world_size, steps, save_at, path, load, ranks_per_node=0, knobs=None, old_state=False):
    """`knobs` override the optimizer's; `old_state` loads the state as saved before var_update_weighting."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt_kwargs = dict(lr=0.01, var_freeze_step=10, var_update_scaler=2, local_steps="fixed", local_step_interval=4, weight_decay=0.01)
    opt = ZeroOneAdam(model.parameters(), **{**opt_kwargs, **(knobs or {})}, collective=_collective(ranks_per_node))
    start = 0
    if load:
        ckpt = torch.load(f"{path}.rank{rank}", weights_only=False)
        if old_state:
            for group in ckpt["optimizer"]["param_groups"]:
                del group["var_update_weighting"]
            for scalars in ckpt["optimizer"]["zoa"]["scalars"]:
                del scalars["variance_steps"]
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        start = save_at
    for t in range(start, steps):
        g = torch.Generator().manual_seed(100 * rank + t)
        loss = model(torch.randn(8, 12, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if t + 1 == save_at and not load:
            assert not opt.last_step.synced or t < opt.schedule.var_freeze_step  # inside a local-step period (none before the freeze)
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f"{path}.rank{rank}")
    return [p.detach().clone() for p in model.parameters()], opt.ledger.summary()


@pytest.mark.slow
@pytest.mark.parametrize("world_size,ranks_per_node", [(2, 0), (4, 2)])
def test_resume_inside_a_local_period_continues_the_same_trajectory(tmp_path, world_size, ranks_per_node):
    path = str(tmp_path / "ckpt")
    uninterrupted = run_ranks(_resume, world_size, 40, 23, path, False, ranks_per_node)
    resumed = run_ranks(_resume, world_size, 40, 23, path, True, ranks_per_node)
    for r in range(world_size):
        assert all(torch.equal(a, b) for a, b in zip(uninterrupted[r][0], resumed[r][0]))
        assert uninterrupted[r][1] == resumed[r][1]


@pytest.mark.parametrize("weighting", ["updates", "steps"])
def test_resume_between_variance_updates_continues_the_same_trajectory(tmp_path, weighting):
    # Updates at 0, 1, 3, 7, 15 (kappa 1), the freeze at 30: saved at step 23, the resumed run's
    # variance bias correction, and so its frozen denominator, must be the uninterrupted run's.
    path, knobs = str(tmp_path / "ckpt"), dict(var_freeze_step=30, var_update_scaler=1, var_update_weighting=weighting)
    uninterrupted = run_ranks(_resume, 2, 40, 23, path, False, 0, knobs)
    resumed = run_ranks(_resume, 2, 40, 23, path, True, 0, knobs)
    for r in range(2):
        assert all(torch.equal(a, b) for a, b in zip(uninterrupted[r][0], resumed[r][0]))
        assert uninterrupted[r][1] == resumed[r][1]


def test_a_state_saved_before_var_update_weighting_resumes_as_it_ran(tmp_path):
    # The state of an older zoa-train holds no variance_steps: v then held one step per update.
    path, knobs = str(tmp_path / "ckpt"), dict(var_freeze_step=30, var_update_scaler=1)
    uninterrupted = run_ranks(_resume, 2, 40, 23, path, False, 0, knobs)
    resumed = run_ranks(_resume, 2, 40, 23, path, True, 0, knobs, True)
    for r in range(2):
        assert all(torch.equal(a, b) for a, b in zip(uninterrupted[r][0], resumed[r][0]))


def _load_on_other_world_size(rank, world_size, path):
    x = torch.nn.Parameter(torch.zeros(10))
    opt = ZeroOneAdam([x])
    with pytest.raises(ValueError, match="saved on 2 ranks and this run has 3"):
        opt.load_state_dict(torch.load(path, weights_only=False))
    return True


def _save_two_ranks(rank, world_size, path):
    x = torch.nn.Parameter(torch.zeros(10))
    opt = ZeroOneAdam([x])
    if rank == 0:
        torch.save(opt.state_dict(), path)
    return True


@pytest.mark.slow
def test_state_from_another_world_size_is_refused(tmp_path):
    path = str(tmp_path / "state.pt")
    run_ranks(_save_two_ranks, 2, path)
    assert all(run_ranks(_load_on_other_world_size, 3, path))


def _digits(rank, world_size, name, steps):
    from sklearn.datasets import load_digits

    data = load_digits()
    features = torch.tensor(data.data, dtype=torch.float32) / 16.0
    labels = torch.tensor(data.target)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    lr = LRSchedule("exponential", lr=3e-3, warmup_steps=20, decay_factor=0.5, decay_every=40)
    # Bias correction on for both: with few variance updates an uncorrected v is far too small.
    common = dict(lr=lr(0), weight_decay=1e-4, allreduce_dtype=torch.bfloat16, bias_correction=True)
    if name == "adam":
        opt = DataParallelAdam(model.parameters(), **common)
    else:
        opt = ZeroOneAdam(model.parameters(), var_freeze_step=40, var_update_scaler=1, local_steps="lr", local_step_clip=8, **common)
    g = torch.Generator().manual_seed(rank)
    shard = torch.arange(rank, len(labels), world_size)
    for t in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr(t)
        batch = shard[torch.randint(0, len(shard), (32,), generator=g)]
        loss = torch.nn.functional.cross_entropy(model(features[batch]), labels[batch])
        opt.zero_grad()
        loss.backward()
        opt.step()
    if name != "adam":
        opt.synchronize()
    with torch.no_grad():
        final = torch.nn.functional.cross_entropy(model(features), labels).item()
    return final, opt.ledger.average_bits_per_param, opt.ledger.rounds


@pytest.mark.slow
def test_zero_one_adam_converges_like_adam_on_digits_with_under_one_bit():
    steps = 300
    adam_loss, adam_bits, adam_rounds = run_ranks(_digits, 4, "adam", steps)[0]
    zoa_loss, zoa_bits, zoa_rounds = run_ranks(_digits, 4, "zero_one", steps)[0]
    assert adam_bits == 16 and adam_rounds == steps
    assert zoa_bits < 1.0 and zoa_rounds < steps
    assert zoa_loss <= adam_loss * 1.05 + 1e-3, (zoa_loss, adam_loss)


def _batchnorm_statistics_over_steps(rank, world_size):
    from zoa_train.optim.training import batchnorm_statistics

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    opt = ZeroOneAdam(model.parameters(), lr=0.01, var_freeze_step=2, var_update_scaler=1, local_steps="fixed", local_step_interval=3)
    opt.average_at_sync(batchnorm_statistics(model))
    out = []
    for t in range(8):
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(10 * rank + t)) * (1 + rank)  # ranks see different data
        model(x).pow(2).mean().backward()
        before = model[1].running_mean.clone()
        opt.step()
        opt.zero_grad()
        out.append((opt.last_step.synced, before, model[1].running_mean.clone(), model[1].running_var.clone()))
    opt.synchronize()  # ends on a local step: the statistics are averaged too
    out.append((True, None, model[1].running_mean.clone(), model[1].running_var.clone()))
    return out


@pytest.mark.slow
def test_batchnorm_statistics_are_averaged_at_every_sync():
    ranks = run_ranks(_batchnorm_statistics_over_steps, 2)
    synced_steps = 0
    for (synced, before0, mean0, var0), (_, before1, mean1, var1) in zip(*ranks):
        if synced:
            synced_steps += 1
            assert torch.equal(mean0, mean1) and torch.equal(var0, var1)
            if before0 is not None:
                assert torch.allclose(mean0, (before0 + before1) / 2)
        else:  # local step: each rank keeps its own statistics
            assert not torch.equal(mean0, mean1)
    assert 3 <= synced_steps < len(ranks[0])


def test_a_recipe_without_optimizer_keys_gets_the_library_defaults():
    from zoa_train.config import recipe_from_dict
    from zoa_train.optim import registry

    model = torch.nn.Linear(4, 4)
    built = registry.create(recipe_from_dict({}).optimizer, model, torch.device("cpu"), 1).optimizer
    library = ZeroOneAdam(model.parameters())
    assert built.schedule.state_dict() == library.schedule.state_dict()
    assert built.param_groups[0]["bias_correction"] == library.defaults["bias_correction"] is True  # as torch.optim.Adam
    assert built.param_groups[0]["update_clip"] == library.defaults["update_clip"]
    onebit = registry.create(recipe_from_dict({"optimizer": {"name": "onebit_adam"}}).optimizer, model, torch.device("cpu"), 1).optimizer
    assert onebit.freeze_step == OneBitAdam(model.parameters()).freeze_step


def _adam_baseline_step(rank, world_size, bias_correction):
    from torch.nn.parallel import DistributedDataParallel

    from zoa_train.config import recipe_from_dict
    from zoa_train.optim import registry

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    recipe = recipe_from_dict({"optimizer": {"name": "adam", "bias_correction": bias_correction, "lr": 0.1}})
    opt = registry.create(recipe.optimizer, model, torch.device("cpu"), world_size)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))  # each rank its own batch
    opt.module(x).pow(2).mean().backward()
    grad = model.weight.grad.clone()
    kind = opt.step()
    return isinstance(opt.module, DistributedDataParallel), type(opt.optimizer).__name__, kind, grad, model.weight.detach().clone()


@pytest.mark.slow
@pytest.mark.parametrize("bias_correction", [True, False])
def test_adam_is_ddp_with_either_bias_correction(bias_correction):
    ranks = run_ranks(_adam_baseline_step, 2, bias_correction)
    for is_ddp, name, kind, _, _ in ranks:
        assert is_ddp and kind == "f"
        assert name == ("AdamW" if bias_correction else "DataParallelAdam")
    assert torch.equal(ranks[0][3], ranks[1][3])  # DDP averaged the gradients
    assert torch.equal(ranks[0][4], ranks[1][4])


def _fp16_overflow_checks(rank, world_size):

    from zoa_train.train.loss_scaling import LossScaler

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = ZeroOneAdam(model.parameters(), lr=0.01, var_freeze_step=4, var_update_scaler=1, local_steps="fixed", local_step_interval=4)
    scaler = LossScaler(True, init_scale=1024.0)
    calls = []
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting  # the scaler's collective is dist.all_reduce; the 1-bit passes use others
    log = []
    try:
        for t in range(16):
            opt.zero_grad()
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * rank + t))
            scaler.scale_loss(model(x).pow(2).mean()).backward()
            if rank == 1 and t == 9:  # an overflow on this rank only, at a local step
                model.weight.grad[0, 0] = float("inf")
            before = len(calls)
            communicates = opt.next_step_communicates()
            overflow = scaler.unscale_and_check(list(model.parameters()), communicates, opt.ledger)
            checked = len(calls) - before
            if overflow and communicates:
                continue
            if overflow:
                for p in model.parameters():
                    p.grad.zero_()
            opt.step()
            log.append((t, communicates, opt.last_step.synced, checked, overflow))
    finally:
        dist.all_reduce = real
    opt.synchronize()
    return log, scaler.scale, torch.cat([p.detach().reshape(-1) for p in model.parameters()]), opt.ledger.by_kind.get("overflow_check", {})


@pytest.mark.slow
def test_fp16_overflow_is_checked_collectively_only_on_steps_that_communicate():
    ranks = run_ranks(_fp16_overflow_checks, 2)
    for log, _, _, counted in ranks:
        assert all(communicates == synced for _, communicates, synced, _, _ in log)  # the prediction is the step's kind
        assert all(checked == (1 if communicates else 0) for _, communicates, _, checked, _ in log)  # no collective on local steps
        assert any(not communicates for _, communicates, _, _, _ in log)
        assert counted["calls"] == sum(c for _, c, _, _, _ in log)  # every check that communicated is in the ledger
    # Rank 1's overflow at a local step halves its scale only and zeroes only its gradients; the ranks
    # still agree on every step's kind and end identical after a sync.
    assert [t for t, *_ in ranks[0][0]] == [t for t, *_ in ranks[1][0]] == list(range(16))
    assert ranks[1][0][9][4] and not ranks[0][0][9][4]
    assert ranks[0][1] == 1024.0 and ranks[1][1] == 512.0
    assert torch.equal(ranks[0][2], ranks[1][2])


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_data_parallel_adam_is_torch_adamw_on_one_rank(weight_decay):
    """The reference every 'equals Adam' test compares against is itself torch's AdamW (with bias
    correction, as AdamW always applies it), to float rounding."""
    torch.manual_seed(0)
    shapes = [(64, 32), (32,), (7,)]
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    kwargs = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay)
    a = DataParallelAdam(ours, bias_correction=True, **kwargs)
    b = torch.optim.AdamW(theirs, foreach=False, **kwargs)
    for step in range(30):
        g = torch.Generator().manual_seed(step)
        for x, y in zip(ours, theirs):
            x.grad = torch.randn(x.shape, generator=g) * (1 + step % 3)
            y.grad = x.grad.clone()
        a.step()
        b.step()
    for x, y in zip(ours, theirs):
        torch.testing.assert_close(x.detach(), y.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cls", [ZeroOneAdam, OneBitAdam, DataParallelAdam])
def test_each_optimizer_documents_itself(cls):
    """help(ZeroOneAdam) shows what it computes, sends and keeps, and every parameter with its default."""
    import inspect

    doc = cls.__dict__.get("__doc__") or ""
    assert "State" in doc and "Parameters" in doc, cls
    for name in inspect.signature(cls).parameters:
        if name != "params":
            assert name in doc, (cls, name)


# ---- an optimizer built before the process group, and ranks given different models (issue 35) ----------


def _built_before_the_group(rank, world_size, port, bound):
    """Train 3 steps with ZeroOneAdam built after the process group, and again with one built before it
    (the group torn down and started again around the build), bound to the group by bind() (as an
    integration does, before any gradient: each rank may start from its own model), at its first
    step (every rank's model alike: that step's gradients were computed before the broadcast), or
    after a step on its own. Returns both results."""
    from zoa_train.distributed import init_process_group

    def model():
        torch.manual_seed(rank if bound == "bind" else 0)
        return torch.nn.Parameter(torch.randn(DIM))

    def train(x, opt, first=0):
        for t in range(first, 3):
            x.grad = quadratic_grad(rank, t, x.detach())
            opt.step()
        opt.synchronize()  # step 2 is a local step
        return x.detach().clone()

    knobs = dict(lr=0.01, var_freeze_step=2, local_steps="fixed", local_step_interval=2)
    x = model()
    after = train(x, ZeroOneAdam([x], **knobs))
    dist.destroy_process_group()
    x = model()
    early = ZeroOneAdam([x], **knobs)
    built_over = early.world_size
    first = 0
    if bound == "after a step":  # a step on its own before the group exists: the ranks' states would differ
        x.grad = quadratic_grad(rank, 0, x.detach())
        early.step()
        first = 1
    init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    if bound == "bind":
        early.bind()
    try:
        before = train(x, early, first)
    except ValueError as e:
        return {"error": str(e)}
    return {"built_over": built_over, "bound_over": early.world_size, "after": after, "before": before}


@pytest.mark.slow
@pytest.mark.parametrize("bound", ["bind", "first step"])
def test_an_optimizer_built_before_the_process_group_joins_it(bound):
    from distributed_harness import free_port

    ranks = run_ranks(_built_before_the_group, 2, free_port(), bound)
    for r in ranks:
        assert r["built_over"] == 1 and r["bound_over"] == 2
        assert torch.equal(r["before"], r["after"])  # bit for bit what an optimizer built over the group trains
    assert torch.equal(ranks[0]["before"], ranks[1]["before"])  # and the ranks agree (rank 0's start was broadcast)


@pytest.mark.slow
def test_an_optimizer_that_stepped_before_the_process_group_is_refused_on_every_rank():
    from distributed_harness import free_port

    ranks = run_ranks(_built_before_the_group, 2, free_port(), "after a step")
    assert ranks[0]["error"] == ranks[1]["error"]
    assert ranks[0]["error"].startswith("ZeroOneAdam took 1 steps on one rank before torch.distributed was initialised")


DIFFERENT_MODELS = {  # the parameter shapes of rank 0 and rank 1, and what the sentence says of them
    "another shape": ([(4, 4)], [(4, 5)], "rank 0 has 1 parameter groups of 1 tensors (16 elements), rank 1 1 of 1 (20 elements)"),
    "a tensor more": ([(4, 4), (4,)], [(4, 4)], "rank 0 has 1 parameter groups of 2 tensors (20 elements), rank 1 1 of 1 (16 elements)"),
    "the same sizes": ([(2, 8)], [(8, 2)], "(16 elements) of other shapes"),  # only the fingerprint of the shapes tells
}


def _different_models(rank, world_size):
    """Every optimizer over every case of DIFFERENT_MODELS: the error each construction raised, or None.
    The check comes before anything else is sent, so the ranks go on to the next case together."""
    from zoa_train.optim.diloco import DiLoCo

    errors = {}
    for cls in (ZeroOneAdam, OneBitAdam, DataParallelAdam, DiLoCo):
        for case, shapes in DIFFERENT_MODELS.items():
            try:
                cls([torch.nn.Parameter(torch.zeros(shape)) for shape in shapes[rank]], lr=0.01)
                errors[cls.__name__, case] = None
            except ValueError as e:
                errors[cls.__name__, case] = str(e)
    return errors


@pytest.mark.slow
def test_ranks_given_different_models_are_refused_when_the_optimizer_is_built():
    errors = run_ranks(_different_models, 2)
    assert errors[0] == errors[1]
    assert len(errors[0]) == 4 * len(DIFFERENT_MODELS)
    for (name, case), error in errors[0].items():
        assert error is not None and error.startswith(f"{name}: the ranks were given different models:"), (name, case, error)
        assert DIFFERENT_MODELS[case][2] in error, (name, case, error)
