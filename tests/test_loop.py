"""The training loop's parts: what it asks of an optimizer (TrainingOptimizer), its log window, and
the one check of optimizer knobs that refuses a bad recipe at load, before any rank starts."""

import re
import time
from pathlib import Path

import pytest
import torch
import yaml
from distributed_harness import run_ranks

from zoa_train.comm import ClusterCollective, CommLedger
from zoa_train.config import recipe_from_dict
from zoa_train.errors import UserError
from zoa_train.optim import registry
from zoa_train.optim.lr_schedules import LRSchedule
from zoa_train.plan.model import plan
from zoa_train.train.metrics import LogWindow

RULES = [
    ({"name": "powersgd", "freeze_step": 1}, "optimizer.freeze_step must be at least 2 for powersgd with error feedback or warm start, not 1"),
    ({"name": "diloco", "sync_every": 2, "fragments": 3}, "optimizer.fragments (3) must not exceed optimizer.sync_every (2)"),
    ({"name": "diloco", "outer_collective": "onebit", "fragments": 2}, "so optimizer.fragments must be 1, not 2"),
]


def gpt2_tiny(**optimizer) -> dict:
    with open(Path(__file__).resolve().parents[1] / "recipes" / "gpt2_tiny.yaml") as f:
        data = yaml.safe_load(f)
    data["optimizer"] |= optimizer
    return data


@pytest.mark.parametrize("knobs, message", RULES)
def test_a_rule_across_knobs_is_refused_at_load_by_every_entry(knobs, message):
    """The recipe, the HF integration's section and `plan` all go through registry.check_section."""
    with pytest.raises(UserError, match=f"^recipe: .*{re.escape(message)}"):
        recipe_from_dict(gpt2_tiny(**knobs))  # at load: no rank has started, no data or model built
    transformers = pytest.importorskip("zoa_train.integrations.transformers")
    name, rest = knobs["name"], {k: v for k, v in knobs.items() if k != "name"}
    with pytest.raises(UserError, match=f"^optimizer {name}: .*{re.escape(message)}"):
        transformers.optimizer_section(name, **rest)
    recipe = recipe_from_dict(gpt2_tiny(**{**knobs, "name": "adam"}))  # the rule is the named optimizer's alone
    assert recipe.optimizer.name == "adam"


def test_each_knob_is_checked_the_same_way_everywhere():
    message = "optimizer.freeze_step must be positive, not 0."
    with pytest.raises(UserError, match=re.escape(f"recipe: {message}")):
        recipe_from_dict(gpt2_tiny(name="adam", freeze_step=0))  # any registered knob, whichever optimizer is named
    with pytest.raises(UserError, match=re.escape(f"plan: {message}")):
        plan(100, LRSchedule("constant", lr=1e-3), 2, 1000, bandwidth_bytes_per_s=1e9, latency_s=0.0, freeze_step=0)
    with pytest.raises(UserError, match=re.escape("plan: optimizer.fragments (3) must not exceed")):
        plan(100, LRSchedule("constant", lr=1e-3), 2, 1000, bandwidth_bytes_per_s=1e9, latency_s=0.0, sync_every=2, fragments=3)
    registry.check_section({"freeze_step": 1}, "plan")  # powersgd's rule is applied only where powersgd is named
    with pytest.raises(UserError, match="powersgd"):
        registry.check_section({"freeze_step": 1}, "here", ["powersgd"])


def test_the_log_window_times_its_steps_without_the_pauses():
    window = LogWindow(every=4, units_per_step=100, unit="tokens")
    assert [s for s in range(1, 10) if window.should_log(s, last=False)] == [4, 8] and window.should_log(9, last=True)
    ledger = CommLedger(num_params=10)
    ledger.record("allreduce", payload_bits=1, elements=10, bytes_sent=2)
    ledger.end_step()
    for kind in "ffo":
        window.add(kind)
    paused = time.perf_counter()
    time.sleep(0.3)  # validation: not training time
    window.exclude(time.perf_counter() - paused)
    record = window.record(2.5, 1e-3, ledger, variance_updates=7)
    assert record["loss"] == 2.5 and record["lr"] == 1e-3 and record["step_kinds"] == "ffo" and record["variance_updates"] == 7
    assert record["bits_per_param"] == 1 and record["rounds"] == 1 and record["bytes_sent"] == 2
    assert 0 < record["train_s"] < 0.1 and record["tokens_per_s"] == pytest.approx(300 / record["train_s"])
    assert "comm_s" not in record  # no bucketed rounds timed
    time.sleep(0.01)
    ledger.record_time(round_seconds=0.5, exposed_seconds=0.2)
    again = window.record(2.0, 1e-3, ledger, 7)
    assert again["step_kinds"] == "" and again["tokens_per_s"] == 0 and 0 < again["train_s"] < 5  # a new window
    assert (again["comm_s"], again["comm_exposed_s"]) == (0.5, 0.2)
    ledger.record_time(round_seconds=0.25, exposed_seconds=0.25)
    third = window.record(2.0, 1e-3, ledger, 7)
    assert (third["comm_s"], third["comm_exposed_s"]) == (0.25, 0.25)  # the window's own, not the totals


def _drive(rank, world_size):
    """What the loop asks of each optimizer, on one rank: lr, a step, zero_grad, keep_rounds_in_step."""
    out = {}
    for name in registry.names():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        recipe = recipe_from_dict(gpt2_tiny(name=name, lr=0.25))
        c = recipe.comm
        collective = ClusterCollective(c.topology, c.ranks_per_node, torch.float32, c.kernels, c.bucket_cap_mb, overlap=True)
        opt = registry.create(recipe.optimizer, model, torch.device("cpu"), world_size, collective=collective)
        before = getattr(opt.optimizer, "overlap", None)
        opt.keep_rounds_in_step("a test")
        overlap = (before, getattr(opt.optimizer, "overlap", None))
        lr = opt.lr
        opt.module(torch.randn(3, 4)).sum().backward()
        opt.step()
        grads = [p.grad for p in model.parameters()]
        opt.zero_grad()
        out[name] = (lr, overlap, all(g is not None for g in grads), [p.grad for p in model.parameters()])
    return out


@pytest.mark.slow
def test_every_optimizer_gives_the_loop_its_lr_zero_grad_and_keeps_rounds_in_step():
    out = run_ranks(_drive, 1)[0]
    assert set(out) == set(registry.names())
    for name, (lr, overlap, had_grads, grads) in out.items():
        assert lr == 0.25 and had_grads, name
        assert grads == [None] * len(grads), name
        if name in ("onebit_adam", "zero_one_adam"):
            assert overlap == (True, False), name  # rounds started during backward, and no longer do
        else:
            assert overlap[1] in (None, False), name
