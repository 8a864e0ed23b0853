import math

import pytest

from zoa_train.optim import LRSchedule, ZeroOneSchedule, variance_update_bound


def run(schedule: ZeroOneSchedule, lr, steps):
    return [schedule.advance(lr(t)) for t in range(steps)]


def test_variance_steps_have_gaps_doubling_every_kappa_updates_and_stop_at_the_freeze():
    decisions = run(ZeroOneSchedule(var_freeze_step=100, var_update_scaler=2), lambda t: 1e-3, 200)
    assert [d.step for d in decisions if d.variance_update] == [0, 1, 2, 4, 6, 10, 14, 22, 30, 46, 62, 94]


def test_sync_interval_follows_the_lr_under_warmup_and_decay_and_is_clipped():
    lr = LRSchedule("exponential", lr=1.0, warmup_steps=10, decay_factor=0.5, decay_every=20)
    schedule = ZeroOneSchedule(var_freeze_step=30, var_update_scaler=1000, local_steps="lr", local_step_clip=4)
    decisions = run(schedule, lr, 110)
    intervals = [d.interval for d in decisions]
    assert intervals[:30] == [1] * 30  # warm-up and before the freeze
    assert intervals[30:50] == [2] * 20  # lr halved once
    assert intervals[50:70] == [4] * 20  # twice
    assert intervals[70:] == [4] * 40  # three times, clipped at H = 4
    syncs = [d.step for d in decisions if d.sync]
    assert syncs[:30] == list(range(30))
    assert syncs[30:40] == list(range(31, 50, 2))
    assert syncs[40:45] == [53, 57, 61, 65, 69]


def test_steps_policy_doubles_every_scaler_steps_after_the_freeze():
    schedule = ZeroOneSchedule(var_freeze_step=10, local_steps="steps", local_step_scaler=8, local_step_clip=16)
    intervals = [d.interval for d in run(schedule, lambda t: 1.0, 60)]
    assert intervals[:10] == [1] * 10
    assert intervals[10:18] == [1] * 8 and intervals[18:26] == [2] * 8 and intervals[26:34] == [4] * 8
    assert intervals[34:42] == [8] * 8 and intervals[42:] == [16] * 18


def test_no_variance_update_once_the_interval_exceeds_one():
    for policy in ("lr", "steps", "fixed"):
        schedule = ZeroOneSchedule(var_freeze_step=20, var_update_scaler=1, local_steps=policy, local_step_interval=4, local_step_scaler=2)
        decisions = run(schedule, lambda t: 1.0 / (1 + t), 300)
        assert all(d.interval == 1 for d in decisions if d.variance_update)
        assert max(d.step for d in decisions if d.variance_update) < 20
        assert any(d.interval > 1 for d in decisions)


def test_schedule_state_round_trip_continues_identically():
    lr = LRSchedule("cosine", lr=1.0, warmup_steps=5, total_steps=200, min_lr=0.01)
    a = ZeroOneSchedule(var_freeze_step=40, var_update_scaler=2)
    run(a, lr, 77)
    b = ZeroOneSchedule(var_freeze_step=40, var_update_scaler=2)
    b.load_state_dict(a.state_dict())
    assert [a.advance(lr(t)) for t in range(77, 200)] == [b.advance(lr(t)) for t in range(77, 200)]


def test_lr_schedules():
    exp = LRSchedule("exponential", lr=4e-4, warmup_steps=100, decay_factor=0.99, decay_every=520)
    assert exp(0) == pytest.approx(4e-6) and exp(99) == pytest.approx(4e-4)
    assert exp(100 + 520) == pytest.approx(4e-4 * 0.99)
    cos = LRSchedule("cosine", lr=1e-3, warmup_steps=10, total_steps=110, min_lr=1e-5)
    assert cos(10) == pytest.approx(1e-3) and cos(60) == pytest.approx((1e-3 + 1e-5) / 2) and cos(500) == pytest.approx(1e-5)
    with pytest.raises(ValueError):
        LRSchedule("linear")


def test_invalid_schedule_knobs_are_refused():
    with pytest.raises(ValueError, match="local_steps"):
        ZeroOneSchedule(local_steps="sometimes")
    with pytest.raises(ValueError, match="local_step_clip"):
        ZeroOneSchedule(local_step_clip=0)


def test_variance_update_bound_matches_the_paper():
    assert math.floor(variance_update_bound(0.9, 0.999)) == 2301
