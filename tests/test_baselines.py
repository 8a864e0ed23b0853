"""The field's baselines, PowerSGD (torch's DDP hook) and DiLoCo: ranks identical when they should be,
the ledger against a count by hand from the tensor shapes, and exact resume through `zoa-train run`."""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from conftest import refused, zoa
from distributed_harness import run_ranks
from reference import ExactAllReduce
from test_run import metrics, short
from transformers import GPT2Config, GPT2LMHeadModel

from zoa_train.comm import ClusterCollective
from zoa_train.optim import registry
from zoa_train.optim.diloco import OuterSchedule

# GPT-2 of 1 layer, width 32, 64 tokens, 16 positions: 15,328 parameters (lm_head tied to wte).
CONFIG = dict(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


def tiny_gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**CONFIG))


def section(name: str, **knobs) -> SimpleNamespace:
    """A recipe's optimizer section: the shared knobs' defaults, lr 3e-3, and `knobs`."""
    shared = dataclasses.asdict(registry.SharedKnobs(lr=3e-3, weight_decay=0.01))
    return SimpleNamespace(name=name, **shared, **knobs)


def flat_parameters(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train(rank, world_size, name, knobs, steps, lr_at=None, collective=None):
    model = tiny_gpt2()
    # the run's collective (what outer_collective onebit takes): the default OneBitAllReduce, the exact
    # one of tests/reference.py, or the node-aware one over nodes of 2 ranks
    factories = {"exact": lambda: ExactAllReduce, "nodes of 2": lambda: ClusterCollective("hierarchical", ranks_per_node=2)}
    chosen = {"collective": factories[collective]()} if collective else {}
    opt = registry.create(section(name, **knobs), model, torch.device("cpu"), world_size, **chosen)
    record = []
    for t in range(steps):
        if lr_at is not None:
            opt.optimizer.param_groups[0]["lr"] = opt.optimizer.param_groups[1]["lr"] = lr_at(t)
        g = torch.Generator().manual_seed(1000 * rank + t)  # each rank its own batch
        tokens = torch.randint(0, 64, (4, 16), generator=g)
        calls_before = {k: dict(v) for k, v in opt.ledger.by_kind.items()}  # DDP's hooks record during backward
        opt.module(tokens, labels=tokens).loss.backward()
        before = flat_parameters(model)
        kind = opt.step()
        opt.optimizer.zero_grad(set_to_none=True)
        after = flat_parameters(model)
        gathered = [torch.empty_like(after) for _ in range(world_size)]
        dist.all_gather(gathered, after)
        befores = [torch.empty_like(before) for _ in range(world_size)]
        dist.all_gather(befores, before)
        sent = {k: v["elements"] - calls_before.get(k, {}).get("elements", 0) for k, v in opt.ledger.by_kind.items()}
        record.append(
            dict(
                kind=kind,
                identical=all(torch.equal(gathered[0], x) for x in gathered),
                mean_before=torch.stack(befores).mean(0),
                after=after,
                elements={k: v for k, v in sent.items() if v},
                bits=opt.ledger.average_bits_per_param,
            )
        )
    return record, opt.ledger.num_params


@pytest.mark.slow
def test_powersgd_keeps_ranks_identical_and_sends_what_the_shapes_say():
    ranks = run_ranks(_train, 2, "powersgd", dict(freeze_step=3, powersgd_rank=2), 6)
    record, num_params = ranks[0]
    assert num_params == 15_328
    assert "".join(r["kind"] for r in record) == "fffrrr"
    assert all(r["identical"] for r in record)
    # By hand, rank 2, min_compression_rate 2: a tensor viewed as n x m is compressed when 4(n+m) < nm.
    # Compressed (P n x 2, Q m x 2): wte 64x32, wpe 16x32, c_attn 32x96, attn c_proj 32x32, c_fc 32x128,
    # mlp c_proj 128x32. Whole: the 1-D tensors, 2x32 of layer norms twice, ln_f 2x32, biases 96+32+128+32.
    ps = 2 * (64 + 16 + 32 + 32 + 32 + 128)
    qs = 2 * (32 + 32 + 96 + 32 + 128 + 32)
    whole = 3 * 64 + 96 + 32 + 128 + 32
    assert (ps, qs, whole) == (608, 704, 480)
    assert record[3]["elements"] == {"powersgd_p": ps, "powersgd_q": qs, "powersgd_whole": whole}
    assert record[0]["elements"] == {"ddp_allreduce": num_params}
    # Full precision (fp32 here) for 3 steps, then 32 bits for each compressed element.
    assert record[-1]["bits"] == pytest.approx((3 * 32 + 3 * 32 * (ps + qs + whole) / num_params) / 6)
    assert all(torch.equal(a["after"], b["after"]) for a, b in zip(record, ranks[1][0]))


@pytest.mark.slow
def test_diloco_syncs_every_h_steps_and_ranks_agree_only_then():
    ranks = run_ranks(_train, 2, "diloco", dict(sync_every=3), 7)
    record, num_params = ranks[0]
    assert "".join(r["kind"] for r in record) == "llollol"
    assert [r["identical"] for r in record] == [False, False, True, False, False, True, False]
    assert record[2]["elements"] == {"allreduce_float32": num_params} and not record[3]["elements"]
    assert record[-1]["bits"] == pytest.approx(2 * 32 / 7)


@pytest.mark.slow
def test_diloco_outer_sync_through_an_exact_collective_is_the_full_precision_one_bit_for_bit():
    today = run_ranks(_train, 2, "diloco", dict(sync_every=3), 7)[0][0]
    # outer_collective onebit takes the run's collective, here the exact one of tests/reference.py
    exact = run_ranks(_train, 2, "diloco", dict(sync_every=3, outer_collective="onebit"), 7, None, "exact")[0][0]
    assert [r["kind"] for r in exact] == [r["kind"] for r in today] and [r["identical"] for r in exact] == [r["identical"] for r in today]
    assert all(torch.equal(a["after"], b["after"]) for a, b in zip(today, exact))


@pytest.mark.slow
@pytest.mark.parametrize("outer, world_size", [("onebit", 3), ("topk", 2)])
def test_diloco_with_a_compressed_outer_sync_keeps_ranks_identical_after_each_outer_step(outer, world_size):
    from zoa_train.comm.topk import topk_wire

    knobs = dict(sync_every=3, outer_collective=outer, topk_density=0.05)
    ranks = run_ranks(_train, world_size, "diloco", knobs, 7)
    record, num_params = ranks[0]
    assert "".join(r["kind"] for r in record) == "llollol"
    assert [r["identical"] for r in record] == [False, False, True, False, False, True, False]
    exact = run_ranks(_train, world_size, "diloco", dict(sync_every=3), 3)[0][0]
    assert not torch.equal(record[2]["after"], exact[2]["after"])  # the average was compressed
    if outer == "onebit":  # one bit per element and outer step
        assert record[2]["elements"] == {"onebit_allreduce": num_params} and record[-1]["bits"] == pytest.approx(2 / 7)
    else:  # in two groups (decay, no decay), each in chunks of 4,096
        model = tiny_gpt2()
        groups = [[p.numel() for p in model.parameters() if (p.ndim >= 2) == decay] for decay in (True, False)]
        wire = topk_wire(groups, 0.05)
        assert record[2]["elements"] == {"topk_allreduce": wire.chunks * wire.k, "topk_scales": 2 * wire.chunks}
        assert record[-1]["bits"] == pytest.approx(2 * wire.payload_bits / num_params / 7)


@pytest.mark.slow
def test_diloco_with_the_1bit_outer_sync_is_node_aware_on_nodes():
    ranks = run_ranks(_train, 4, "diloco", dict(sync_every=2, outer_collective="onebit"), 4, None, "nodes of 2")
    record, num_params = ranks[0]
    assert [r["identical"] for r in record] == [False, True, False, True]  # all 4 ranks after each outer step
    # Between the 2 nodes a rank sends its shard in 1 bit (the two ranks of a node: the model once);
    # the reduce-scatter and all-gather inside the node move the whole model in fp32.
    assert ranks[0][0][1]["elements"]["onebit_allreduce"] + ranks[1][0][1]["elements"]["onebit_allreduce"] == num_params
    assert record[1]["elements"]["intra_allreduce_float32"] == num_params


def first_step_only(t: int) -> float:
    return 3e-3 if t == 0 else 0.0


@pytest.mark.slow
def test_diloco_with_outer_lr_1_and_no_momentum_averages_the_models():
    # Inner lr 0 on the outer step's own inner step, so that what the outer step averages is the
    # parameters the ranks held after the step before.
    ranks = run_ranks(_train, 2, "diloco", dict(sync_every=2, outer_lr=1.0, outer_momentum=0.0), 2, first_step_only)
    first, second = ranks[0][0]
    assert not first["identical"] and second["identical"]
    assert torch.allclose(second["after"], second["mean_before"], atol=1e-6, rtol=0)
    assert not torch.allclose(second["after"], first["after"])  # rank 0 moved to the average, not its own point


@pytest.mark.slow
def test_streaming_diloco_syncs_one_fragment_at_a_time():
    schedule = OuterSchedule(sync_every=4, fragments=2)
    assert [schedule.due(t) for t in range(1, 9)] == [[], [0], [], [1], [], [0], [], [1]]
    ranks = run_ranks(_train, 2, "diloco", dict(sync_every=4, fragments=2), 4)
    record, num_params = ranks[0]
    assert "".join(r["kind"] for r in record) == "lolo"
    assert not any(r["identical"] for r in record)  # one fragment agrees, the other does not
    halves = [record[1]["elements"]["allreduce_float32"], record[3]["elements"]["allreduce_float32"]]
    assert sum(halves) == num_params and max(halves) < 0.75 * num_params


def test_diloco_refuses_a_fragment_without_parameters():
    from zoa_train.optim.diloco import DiLoCo

    with pytest.raises(ValueError, match="fragments must be between 1 and sync_every"):
        DiLoCo(torch.nn.Linear(2, 2).parameters(), sync_every=2, fragments=3)
    with pytest.raises(ValueError, match="without a parameter"):
        DiLoCo(torch.nn.Linear(2, 2).parameters(), sync_every=4, fragments=3)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,knobs",
    [
        # The checkpoint at step 4 is mid-compression; the resumed run's first step has one DDP bucket
        # where the step it continues had DDP's rebuilt buckets.
        ("powersgd", ("optimizer.freeze_step=2", "optimizer.powersgd_rank=2")),
        # The checkpoint at step 4 lies inside a period of H = 3 (ranks' parameters differ).
        ("diloco", ("optimizer.sync_every=3",)),
        # ... with the error of the outer step at step 3 carried to the one at step 6.
        ("diloco", ("optimizer.sync_every=3", "optimizer.outer_collective=onebit")),
        ("diloco", ("optimizer.sync_every=3", "optimizer.outer_collective=topk", "optimizer.outer_momentum=0", "optimizer.topk_error_decay=0.9")),
    ],
)
def test_baseline_resumes_exactly(tmp_path, cache_dir, name, knobs):
    sets = short(cache_dir, 8, f"optimizer.name={name}", "train.checkpoint_every=4", "model.dropout=0.1", *knobs)
    first, second = tmp_path / "first", tmp_path / "second"
    done = zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(first), *sets)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(second), "--resume", str(first / "checkpoints" / "step_00000004"), *sets)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records, again = metrics(first), metrics(second)
    assert [r["loss"] for r in again] == [r["loss"] for r in records[4:]]
    assert again[-1]["bits_per_param"] == records[-1]["bits_per_param"] and again[-1]["rounds"] == records[-1]["rounds"]
    a = torch.load(first / "checkpoints" / "step_00000008" / "model.pt")
    b = torch.load(second / "checkpoints" / "step_00000008" / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize(
    "knobs,message",
    [
        (("optimizer.name=powersgd", "optimizer.freeze_step=1"), "optimizer.freeze_step must be at least 2 for powersgd"),
        (("optimizer.name=diloco", "optimizer.sync_every=2", "optimizer.fragments=3"), "optimizer.fragments (3) must not exceed optimizer.sync_every (2)"),
        (("optimizer.name=diloco", "optimizer.outer_momentum=1"), "optimizer.outer_momentum must be in [0, 1)"),
    ],
)
def test_bad_baseline_settings_are_one_sentence(tmp_path, cache_dir, knobs, message):
    done = zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(tmp_path / "run"), *short(cache_dir, 2, *knobs))
    refused(done, message)


def test_plan_counts_the_baselines():
    from zoa_train.optim.lr_schedules import LRSchedule
    from zoa_train.plan.model import plan

    shapes = tuple(tuple(p.shape) for p in tiny_gpt2().parameters())
    n = sum(math.prod(s) for s in shapes)
    result = plan(
        100, LRSchedule("constant", lr=1e-3), 2, n, bandwidth_bytes_per_s=1e9, latency_s=0.0, param_shapes=shapes,
        freeze_step=10, powersgd_rank=2, sync_every=8, fragments=1,
    )  # fmt: skip
    powersgd, diloco = result["powersgd"], result["diloco"]
    assert powersgd["compressed_elements_per_step"] == 608 + 704 + 480
    assert powersgd["bits_per_param"] == pytest.approx((10 * 32 + 90 * 32 * 1792 / n) / 100)
    assert powersgd["rounds"] == 100 and powersgd["bytes_per_rank"] == 10 * 4 * n + 90 * 4 * 1792  # ring on 2 ranks: each sends the buffer once
    assert diloco["rounds"] == diloco["syncs"] == diloco["outer_steps"] == 12
    assert diloco["bits_per_param"] == pytest.approx(12 * 32 / 100) and diloco["bytes_per_rank"] == 12 * 4 * n


def test_plan_counts_a_compressed_outer_sync():
    from zoa_train.comm.topk import topk_wire
    from zoa_train.optim.lr_schedules import LRSchedule
    from zoa_train.plan.model import Cluster, flat_onebit_cost, plan

    shapes = tuple(tuple(p.shape) for p in tiny_gpt2().parameters())
    n = sum(math.prod(s) for s in shapes)
    common = dict(bandwidth_bytes_per_s=1e9, latency_s=0.0, param_shapes=shapes, sync_every=8, world_size=3)
    onebit = plan(100, LRSchedule("constant", lr=1e-3), num_params=n, outer_collective="onebit", **common)["diloco"]
    assert onebit["onebit_allreduces"] == onebit["rounds"] == 12 and onebit["bits_per_param"] == pytest.approx(12 / 100)
    assert onebit["bytes_per_rank"] == 12 * flat_onebit_cost(n, Cluster(3)).bytes_per_rank
    topk = plan(100, LRSchedule("constant", lr=1e-3), num_params=n, outer_collective="topk", topk_density=0.03, **common)["diloco"]
    wire = topk_wire([math.prod(s) for s in shapes], 0.03)
    assert topk["bits_per_param"] == pytest.approx(12 * wire.payload_bits / n / 100)
    assert topk["bytes_per_rank"] == 12 * 2 * wire.message_bytes and topk["collective_calls"] == 12  # each rank's message to the 2 others


def _powersgd_across_layouts(rank, world_size, path, bucket_cap_mb, load):
    """5 steps of DDP + PowerSGDHook + SGD; the state saved after step 3, or loaded there into a DDP of
    other buckets (a DDP of its own, to choose them)."""
    from torch.nn.parallel import DistributedDataParallel

    from zoa_train.comm import CommLedger
    from zoa_train.optim.powersgd import PowerSGDHook

    model = tiny_gpt2()
    hook = PowerSGDHook(model, rank=2, start_step=2)
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    hook.register(ddp, CommLedger(num_params=1))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    start = 0
    if load == "state":
        saved = torch.load(f"{path}.{rank}", weights_only=False)
        model.load_state_dict(saved["model"])
        hook.load_state_dicts(saved["shared"], saved["rank"])
        start = 3
    elif load == "model only":
        saved = torch.load(f"{path}.{rank}", weights_only=False)
        model.load_state_dict(saved["model"])
        hook.load_resharded(saved["shared"])  # step count only: fresh error feedback and Qs
        start = 3
    buckets = set()
    for t in range(start, 5):
        tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1000 * rank + t))
        ddp(tokens, labels=tokens).loss.backward()
        buckets.add(len(hook._layouts))
        opt.step()
        opt.zero_grad()
        if t == 2 and load is None:
            torch.save({"model": model.state_dict(), "shared": hook.shared_state_dict(), "rank": hook.rank_state_dict()}, f"{path}.{rank}")
    return flat_parameters(model), buckets


@pytest.mark.slow
def test_powersgd_state_carries_over_to_other_buckets(tmp_path):
    path = str(tmp_path / "state")
    uninterrupted, buckets = run_ranks(_powersgd_across_layouts, 2, path, 0.005, None)[0]
    resumed, other_buckets = run_ranks(_powersgd_across_layouts, 2, path, 0.02, "state")[0]
    fresh, _ = run_ranks(_powersgd_across_layouts, 2, path, 0.02, "model only")[0]
    assert buckets != other_buckets  # the layouts differ: the state went through the per-parameter pools
    carried, dropped = (resumed - uninterrupted).abs().max(), (fresh - uninterrupted).abs().max()
    assert carried < 1e-5 and dropped > 1e3 * carried  # only the matrix products' rounding differs
