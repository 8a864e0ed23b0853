"""zoa_train.plan.model: the counts of the authors' BERT-Large run, exact bytes and times on small
cases, the unit parsers, and agreement with what ZeroOneAdam actually decides step by step."""

import io
import json
import math
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import zoa_here
from reference import zero_one_counts_reference
from rich.console import Console

from zoa_train.comm import ring_allreduce_bytes
from zoa_train.config import load_recipe
from zoa_train.errors import UserError
from zoa_train.optim import LRSchedule, ZeroOneAdam
from zoa_train.optim.builtin import zero_one_step_kinds
from zoa_train.plan.model import Cluster, StepCosts, ddp_exposed_time, flat_onebit_cost, onebit_call_bytes, plan
from zoa_train.plan.table import format_plan
from zoa_train.plan.units import parse_bandwidth, parse_latency
from zoa_train.step_kinds import LOCAL, ONEBIT, VARIANCE

# The authors' BERT-Large seq-128 recipe (paper, section 5; recipes/bert_large.yaml).
BERT_STEPS = 152_500
BERT_LR = LRSchedule("exponential", lr=4e-4, warmup_steps=12_500, decay_factor=0.99, decay_every=520)
BERT_KNOBS = dict(
    freeze_step=23_000,
    var_freeze_step=12_500,
    var_update_scaler=16,
    local_step_clip=16,
    local_step_scaler=32_678,
    allreduce_bits=16,
    bandwidth_bytes_per_s=parse_bandwidth("100Gbit"),
    latency_s=parse_latency("20us"),
)


@pytest.fixture(scope="module")
def bert():
    """Both local-step policies of the BERT-Large run, and how long the "steps" plan took."""
    start = time.perf_counter()
    by_steps = plan(BERT_STEPS, BERT_LR, 64, 336_000_000, local_steps="steps", **BERT_KNOBS)
    elapsed = time.perf_counter() - start
    by_lr = plan(BERT_STEPS, BERT_LR, 64, 336_000_000, local_steps="lr", **BERT_KNOBS)
    return by_steps, by_lr, elapsed


def test_bert_large_matches_the_papers_counts(bert):
    result, _, elapsed = bert
    adam, onebit, zoa = result["adam"], result["onebit_adam"], result["zero_one_adam"]
    assert adam["bits_per_param"] == 16.0 and adam["rounds"] == BERT_STEPS and adam["variance_updates"] == BERT_STEPS
    # 23,000 fp16 steps then 129,500 one-bit steps: (23,000*16 + 129,500) / 152,500 = 3.262.
    assert 3.24 <= onebit["bits_per_param"] <= 3.28
    assert onebit["bits_per_param"] == pytest.approx((23_000 * 16 + 129_500) / BERT_STEPS)
    assert onebit["rounds"] == BERT_STEPS and onebit["variance_updates"] == 23_000
    assert 0.47 <= zoa["bits_per_param"] <= 0.53
    assert 74_000 <= zoa["rounds"] <= 75_000
    assert zoa["rounds"] == zoa["syncs"] == zoa["fp_allreduces"] + zoa["onebit_allreduces"]
    assert zoa["bits_per_param"] == pytest.approx((16 * zoa["fp_allreduces"] + zoa["onebit_allreduces"]) / BERT_STEPS)
    assert elapsed < 3.0


def test_bert_variance_updates_by_hand_and_below_the_bound(bert):
    """Gaps 2^floor(j/16): 16 gaps each of 1, 2, ..., 256 reach step 16*511 = 8,176 after 144 gaps
    (145 updates), then gaps of 512 fit 8 more times before 12,500: |T_v| = 153."""
    for result in bert[:2]:
        zoa = result["zero_one_adam"]
        assert zoa["variance_updates"] == 153
        assert zoa["variance_update_bound"] == pytest.approx(math.log(0.1) / math.log(0.999))
        assert zoa["variance_updates"] < zoa["variance_update_bound"]
        assert zoa["max_interval"] <= 16


def expected_syncs(segments):
    """Syncs of a run split into (length, interval) segments, ignoring carry-over at boundaries."""
    return sum(length / interval for length, interval in segments)


def test_bert_rounds_by_policy_agree_with_a_count_by_segments(bert):
    by_steps, by_lr, _ = bert
    # "steps": interval 1 up to the freeze, then doubling every 32,678 steps, clipped at 16.
    freeze, scaler = 12_500, 32_678
    edges = [freeze + k * scaler for k in range(5)] + [BERT_STEPS]
    steps_segments = [(freeze, 1)] + [(edges[k + 1] - edges[k], 2**k) for k in range(5)]
    assert by_steps["zero_one_adam"]["rounds"] == pytest.approx(expected_syncs(steps_segments), abs=5)
    assert by_steps["zero_one_adam"]["max_interval"] == 16
    # "lr": the lr halves after ceil(1 / log2(1/0.99)) = 69 decays of 520 steps (35,880 steps), longer
    # than 32,678, and at the end it has halved only 3 times (269 decays): the interval stops at 8.
    decays_per_halving = math.ceil(1 / math.log2(1 / 0.99))
    assert decays_per_halving == 69
    last_decays = (BERT_STEPS - 1 - freeze) // 520
    assert math.floor(last_decays * math.log2(1 / 0.99)) == 3
    halving = decays_per_halving * 520
    lr_edges = [freeze + k * halving for k in range(4)] + [BERT_STEPS]
    lr_segments = [(lr_edges[1], 1)] + [(lr_edges[k + 1] - lr_edges[k], 2**k) for k in range(1, 4)]
    assert by_lr["zero_one_adam"]["rounds"] == pytest.approx(expected_syncs(lr_segments), abs=5)
    assert by_lr["zero_one_adam"]["max_interval"] == 8
    assert by_lr["zero_one_adam"]["rounds"] > by_steps["zero_one_adam"]["rounds"]
    assert by_lr["zero_one_adam"]["variance_updates"] == by_steps["zero_one_adam"]["variance_updates"]


def test_bert_step_kinds_respect_clip_and_freeze():
    intervals, variance_steps = [], []
    for decision, kind in zero_one_step_kinds(BERT_STEPS, BERT_LR, var_freeze_step=12_500, var_update_scaler=16, local_steps="lr", local_step_clip=16):
        intervals.append(decision.interval)
        if kind == VARIANCE:
            variance_steps.append(decision.step)
            assert decision.interval == 1 and decision.sync
    assert max(intervals) <= 16
    assert max(variance_steps) < 12_500
    assert variance_steps[:17] == list(range(17))  # 16 gaps of 1


def small_plan(**overrides):
    """1,000 parameters, 2 ranks, 3 steps, fp32; alpha 1 ms, beta 1 MB/s.

    Adam: ring allreduce 2*(2-1)*1000*4/2 = 4,000 bytes per step.
    1-bit call: 500 per rank -> one row of 512 (a multiple of 32), segment 512/8 + 4 = 68 bytes,
    2*(2-1) segments = 136 bytes.
    1-bit Adam (freeze 1): one fp32 allreduce, then two 1-bit calls.
    0/1 Adam (var_freeze_step 1, fixed interval 2): step 0 is a variance step (fp32 allreduce),
    step 1 local, step 2 a 1-bit sync."""
    args = dict(
        steps=3,
        lr_schedule=LRSchedule("constant", lr=1e-3),
        world_size=2,
        num_params=1000,
        freeze_step=1,
        var_freeze_step=1,
        local_steps="fixed",
        local_step_interval=2,
        bandwidth_bytes_per_s=1e6,
        latency_s=1e-3,
    )
    args.update(overrides)
    return plan(**args)


def test_small_case_bytes_and_time_by_hand():
    result = small_plan()
    assert onebit_call_bytes(1000, 2) == 136
    adam, onebit, zoa = result["adam"], result["onebit_adam"], result["zero_one_adam"]
    assert adam["bytes_per_rank"] == 3 * 4000
    assert onebit["bytes_per_rank"] == 4000 + 2 * 136
    assert zoa["bytes_per_rank"] == 4000 + 136
    fp_time, onebit_time = 2 * 1e-3 + 4000 / 1e6, (1e-3 + 68 / 1e6) * 2
    assert adam["comm_time_s"] == pytest.approx(3 * fp_time)
    assert onebit["comm_time_s"] == pytest.approx(fp_time + 2 * onebit_time)
    assert zoa["comm_time_s"] == pytest.approx(fp_time + onebit_time)
    assert (adam["rounds"], onebit["rounds"], zoa["rounds"]) == (3, 3, 2)
    assert (zoa["fp_allreduces"], zoa["onebit_allreduces"], zoa["variance_updates"], zoa["syncs"]) == (1, 1, 1, 2)
    assert (adam["bits_per_param"], onebit["bits_per_param"], zoa["bits_per_param"]) == (32, pytest.approx(34 / 3), 11)
    assert zoa["collective_calls"] == 3  # one allreduce, two passes of the 1-bit call
    assert zoa["max_interval"] == 2


def test_bytes_with_three_ranks_and_fp16_and_one_rank():
    result = small_plan(world_size=3, allreduce_bits=16)
    # fp16 ring: 2*2*1000*2 // 3 = 2,666; 1-bit: 334 per rank -> one row of 352 (a multiple of 32),
    # segment 352/8 + 4 = 48, 4 segments.
    assert onebit_call_bytes(1000, 3) == 192
    assert result["adam"]["bytes_per_rank"] == 3 * 2666
    assert result["zero_one_adam"]["bytes_per_rank"] == 2666 + 192
    assert result["adam"]["bits_per_param"] == 16 and result["zero_one_adam"]["bits_per_param"] == 17 / 3
    alone = small_plan(world_size=1)
    for name in ("adam", "onebit_adam", "zero_one_adam"):
        assert alone[name]["bytes_per_rank"] == 0 and alone[name]["comm_time_s"] == 0.0
        assert alone[name]["rounds"] == small_plan()[name]["rounds"]  # nominal counts do not depend on n


def test_time_grows_with_latency_and_falls_with_bandwidth():
    base = small_plan()
    slower = small_plan(latency_s=1e-2)
    faster = small_plan(bandwidth_bytes_per_s=1e9)
    for name in ("adam", "onebit_adam", "zero_one_adam"):
        assert slower[name]["comm_time_s"] > base[name]["comm_time_s"] > faster[name]["comm_time_s"]
        assert slower[name]["bytes_per_rank"] == base[name]["bytes_per_rank"] == faster[name]["bytes_per_rank"]


def test_zero_steps_and_bad_arguments():
    empty = small_plan(steps=0)
    assert all(empty[name]["bits_per_param"] == 0.0 and empty[name]["rounds"] == 0 for name in empty)
    for overrides in (
        dict(allreduce_bits=8),
        dict(world_size=0),
        dict(num_params=0),
        dict(steps=-1),
        dict(bandwidth_bytes_per_s=0),
        dict(latency_s=-1.0),
        dict(local_steps="sometimes"),
        dict(local_step_clip=0),
        dict(world_size=4, ranks_per_node=3),
        dict(backend="mpi"),
        dict(intra_bandwidth_bytes_per_s=0),
        dict(costs=StepCosts(0.0)),
        dict(costs=StepCosts(1.0, backward_fraction=1.5)),
    ):
        with pytest.raises(UserError):
            small_plan(**overrides)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("10Gbit", 1.25e9),
        ("10 Gbit/s", 1.25e9),
        ("10gbit", 1.25e9),
        ("100Mbit/s", 12.5e6),
        ("1.25GB/s", 1.25e9),
        ("500MB", 5e8),
        ("5e8", 5e8),
        ("1.2TB", 1.2e12),
        ("1.6Tbit/s", 2e11),
        ("123", 123.0),
        (2.5e9, 2.5e9),
    ],
)
def test_parse_bandwidth(text, expected):
    assert parse_bandwidth(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["fast", "", "10Gb", "-1Gbit", "0", "0MB", "10 GB/h", "1Gbit/s/s", "Gbit", "inf"])
def test_parse_bandwidth_rejects(text):
    with pytest.raises(UserError, match="bandwidth") as info:
        parse_bandwidth(text)
    assert repr(text) in str(info.value)


@pytest.mark.parametrize(
    "text, expected",
    [("20us", 2e-5), ("20 us", 2e-5), ("5ms", 5e-3), ("800ns", 8e-7), ("0.5s", 0.5), ("0.001", 1e-3), ("0", 0.0), (3e-6, 3e-6)],
)
def test_parse_latency(text, expected):
    assert parse_latency(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["soon", "", "20 parsecs", "-1ms", "1ms/s", "us", "5 min"])
def test_parse_latency_rejects(text):
    with pytest.raises(UserError, match="latency") as info:
        parse_latency(text)
    assert repr(text) in str(info.value)


def test_format_plan_shows_the_three_optimizers():
    table = format_plan(small_plan())
    out = io.StringIO()
    Console(file=out, width=160).print(table)
    text = out.getvalue()
    for word in ("Adam", "1-bit Adam", "0/1 Adam", "|T_v|", "rounds", "syncs", "bits / param", "bytes / rank", "comm time", "vs Adam"):
        assert word in text
    assert "4.14 kB" in text and "12.00 kB" in text


def test_two_nodes_of_two_ranks_by_hand():
    """1,000 parameters on 2 nodes x 2 ranks, fp32, alpha 1 ms, beta 1 MB/s per node, nothing limits
    inside a node.

    Ring allreduce over 4 ranks: every link of the ring, the node's too, carries 2*3*1000*4/4 = 6,000
    bytes; 6 messages.
    Flat 1-bit call over 4 ranks: 250 per rank -> a row of 256, segment 256/8 + 4 = 36 bytes. The
    all-to-all sends 2 segments from each of a node's 2 ranks off the node (144 bytes); Gloo's
    all-gather as many, NCCL's ring 3 segments (108 bytes). 3 messages per pass.
    Node-aware: a shard of 500 among 2 ranks, a row of 256 again (36 bytes): each local rank sends 1
    segment per pass off the node, the node's 2 local ranks 72 bytes per pass over the node's link
    at once (each at half its rate); 1 message per pass. Inside the node, 500 fp32 out and 500 back.
    Node-aware full precision: the same 500 out and back inside the node, and a ring of 2 ranks over
    each shard between the nodes: 2*1*500*4/2 = 2,000 bytes per rank, 4,000 over the node's link
    (the node's 2 local ranks at half its rate each), 2 messages."""
    gloo = small_plan(world_size=4, ranks_per_node=2, backend="gloo", steps=2)  # 1-bit Adam: an fp32 step, a 1-bit one
    nccl = small_plan(world_size=4, ranks_per_node=2, backend="nccl", steps=2)
    fp_time = 6e-3 + 6000 / 1e6
    adam = gloo["adam"]
    assert adam["inter_bytes_per_node"] == 2 * 6000 and adam["comm_time_s"] == pytest.approx(2 * fp_time)
    onebit, node_aware = gloo["onebit_adam"], gloo["onebit_adam"]["hierarchical"]
    assert onebit["inter_bytes_per_node"] == 6000 + 288 and onebit["bytes_per_rank"] == 6000 + 6 * 36
    assert onebit["comm_time_s"] == pytest.approx(fp_time + 2 * (3e-3 + 144 / 1e6))
    assert nccl["onebit_adam"]["inter_bytes_per_node"] == 6000 + 144 + 108
    assert node_aware["inter_bytes_per_node"] - 4000 == 144 == (onebit["inter_bytes_per_node"] - 6000) / 2  # 1/G of flat's
    assert node_aware["bytes_per_rank"] == 2000 + 72 and node_aware["intra_bytes_per_rank"] == 2 * (500 * 4 + 500 * 4)
    assert node_aware["comm_time_s"] == pytest.approx(2e-3 + 2000 / 5e5 + 2 * (1e-3 + 72 / 1e6))
    assert "hierarchical" not in adam and "hierarchical" not in small_plan(world_size=4, ranks_per_node=4)["onebit_adam"]


def test_sharded_by_hand():
    """The same 1,000 parameters sharded (comm.shard node) on 2 nodes x 2 ranks: each rank holds 500
    and exchanges them among the 2 ranks that hold the same shard, the node's 2 local ranks at once over
    its link: the node-aware call's part between nodes, byte for byte (a 1-bit call of 500 among 2
    ranks: 72 bytes a rank, 144 over the link; a ring of 500 fp32: 2,000 a rank, 4,000 over the link).
    Adam sharded is HSDP: that ring every step. FSDP2 inside the node, per micro-batch: two all-gathers
    and a reduce-scatter, each sending 500 fp32 from each rank: 6,000 bytes a rank a step."""
    result = small_plan(world_size=4, ranks_per_node=2, backend="gloo", steps=2)  # 1-bit Adam: an fp32 step, a 1-bit one
    onebit, node_aware, adam = result["onebit_adam"]["sharded"], result["onebit_adam"]["hierarchical"], result["adam"]["sharded"]
    assert (onebit["bytes_per_rank"], onebit["inter_bytes_per_node"]) == (node_aware["bytes_per_rank"], node_aware["inter_bytes_per_node"]) == (2072, 4144)
    assert onebit["comm_time_s"] == pytest.approx(node_aware["comm_time_s"])  # nothing limits inside the node: FSDP2 is free
    assert onebit["intra_bytes_per_rank"] == adam["intra_bytes_per_rank"] == 2 * 6000
    assert (adam["bytes_per_rank"], adam["inter_bytes_per_node"], adam["bits_per_param"]) == (2 * 2000, 2 * 4000, 32)
    assert "sharded" not in result["powersgd"] and "sharded" in result["diloco"]  # PowerSGD is DDP's hook: not shardable
    assert all("sharded" not in record for record in small_plan(world_size=4, ranks_per_node=1).values())


def test_fsdp2_adds_what_compute_does_not_hide():
    """FSDP2's 12 kB a step inside a node of 2 ranks sharing 1 MB/s: 12 ms of transfer. Prefetching
    hides it behind the step's compute but for the first unit's all-gather and the last's
    reduce-scatter (here the one unit is the whole model: 2/3 of it, 8 ms); with 1 ms of compute
    there is less to hide behind (11 ms exposed). The work on the ranks, 1,500 elements at fsdp_rate,
    is not hidden. Adam's HSDP all-reduce of a single unit is all exposed, as DDP's one bucket is."""
    args = dict(world_size=4, ranks_per_node=2, steps=2, latency_s=0.0)
    for step_time, exposed in ((0.1, 0.008), (0.001, 0.011)):
        free = small_plan(**args, costs=StepCosts(step_time))
        limited = small_plan(**args, costs=StepCosts(step_time), intra_bandwidth_bytes_per_s=1e6)
        for name in ("adam", "onebit_adam", "zero_one_adam"):
            added = limited[name]["sharded"]["total_time_s"] - free[name]["sharded"]["total_time_s"]
            assert added == pytest.approx(2 * exposed, abs=1e-9), name
    worked = small_plan(**args, costs=StepCosts(0.1, fsdp_rate=1e5))["zero_one_adam"]["sharded"]
    free = small_plan(**args, costs=StepCosts(0.1))["zero_one_adam"]["sharded"]
    assert worked["total_time_s"] - free["total_time_s"] == pytest.approx(2 * 1500 / 1e5)
    summing = small_plan(**args, costs=StepCosts(0.1, reduce_rate=1e5))["zero_one_adam"]["sharded"]
    assert summing["total_time_s"] - free["total_time_s"] == pytest.approx(500 / 1e5)  # its variance round's 500 elements sent between nodes
    adam = small_plan(**args, costs=StepCosts(0.1))["adam"]["sharded"]
    assert adam["step_time_s"] == pytest.approx(0.1 + 2 * 500 * 4 / 2 / 5e5)
    double = small_plan(**args, costs=StepCosts(0.1, micro_batches=2), intra_bandwidth_bytes_per_s=1e6)["adam"]["sharded"]
    assert double["intra_bytes_per_rank"] == 2 * 2 * 6000  # FSDP2 gathers and reduces at each micro-batch
    bf16 = small_plan(**args, allreduce_bits=16)["zero_one_adam"]["sharded"]
    assert bf16["intra_bytes_per_rank"] == 2 * (500 * 4 + 500 * 4 + 500 * 2)  # the reduce-scatter in the allreduce dtype, as the ledger counts it


def test_a_delayed_round_adds_only_what_outlasts_the_next_step():
    """sync_delay 1: 0/1 Adam's one 1-bit sync (step 2, closing a period of interval 2) and each of
    DiLoCo's outer rounds run behind a step of compute: with 0.1 s of it they add nothing, with 0.1 ms
    what their transfer takes beyond it. The variance step stays in step; the counts do not change, nor
    the memory, but for the pseudo-gradient DiLoCo's delayed round holds (1,000 fp32: one fragment)."""
    cluster = Cluster(2, 1, 1e6, 1e-3)
    onebit = flat_onebit_cost(1000, cluster).seconds
    outer = 2 * (1e-3 + 2000 / 1e6)  # DiLoCo's full-precision outer round of 1,000 fp32 on 2 ranks: a ring of 2 phases
    for step_time in (0.1, 1e-4):
        args = dict(costs=StepCosts(step_time), sync_every=1)
        in_step, delayed = small_plan(**args), small_plan(**args, sync_delay=1)
        for name, round_s, calls in (("zero_one_adam", onebit, 1), ("diloco", outer, 3)):
            saved = in_step[name]["total_time_s"] - delayed[name]["total_time_s"]
            assert saved == pytest.approx(calls * min(round_s, step_time), rel=1e-9), (name, step_time)
            assert {k: v for k, v in in_step[name].items() if "time" not in k and "speedup" not in k and k != "memory_per_rank"} == {
                k: v for k, v in delayed[name].items() if "time" not in k and "speedup" not in k and k != "memory_per_rank"
            }
            held = delayed[name]["memory_per_rank"]["optimizer_state"] - in_step[name]["memory_per_rank"]["optimizer_state"]
            assert held == (4 * 1000 if name == "diloco" else 0), name
        assert in_step["onebit_adam"] == delayed["onebit_adam"]  # no delayed sync of its own
    # Sharded inside the node: the same rounds over the shard, hidden behind the step as far as it lasts.
    for step_time in (0.1, 1e-4):
        args = dict(world_size=4, ranks_per_node=2, costs=StepCosts(step_time), sync_every=1, intra_bandwidth_bytes_per_s=1e15)  # FSDP2 adds no time
        in_step, delayed = small_plan(**args), small_plan(**args, sync_delay=1)
        for name, calls in (("zero_one_adam", 1), ("diloco", 3)):
            saved = in_step[name]["sharded"]["total_time_s"] - delayed[name]["sharded"]["total_time_s"]
            assert 0 < saved <= calls * step_time * (1 + 1e-6), (name, step_time)
            assert in_step[name]["sharded"]["rounds"] == delayed[name]["sharded"]["rounds"]


def test_sharded_speedups_are_against_adam_sharded():
    result = small_plan(world_size=4, ranks_per_node=2, costs=StepCosts(0.01), intra_bandwidth_bytes_per_s=1e6)
    adam = result["adam"]["sharded"]["total_time_s"]
    assert result["adam"]["sharded"]["speedup_vs_adam"] == pytest.approx(1.0)
    for name in ("onebit_adam", "zero_one_adam"):
        sharded = result[name]["sharded"]
        assert sharded["speedup_vs_adam"] == pytest.approx(adam / sharded["total_time_s"])
        assert sharded["speedup_vs_onebit_adam"] == pytest.approx(result["onebit_adam"]["sharded"]["total_time_s"] / sharded["total_time_s"])
        assert result[name]["hierarchical"]["speedup_vs_adam"] == pytest.approx(result["adam"]["total_time_s"] / result[name]["hierarchical"]["total_time_s"])


def test_a_finite_intra_node_link_costs_the_node_aware_call_its_full_precision():
    args = dict(world_size=4, ranks_per_node=2, steps=2, latency_s=0.0)
    free = small_plan(**args)["onebit_adam"]["hierarchical"]["comm_time_s"]
    limited = small_plan(**args, intra_bandwidth_bytes_per_s=1e5)["onebit_adam"]["hierarchical"]["comm_time_s"]
    # The 1-bit call and the node-aware fp32 step alike: 500 fp32 from each of the node's 2 ranks, out and back.
    assert limited == pytest.approx(free + 2 * 2 * (2 * 500 * 4 / 1e5))


def test_ddp_overlaps_all_but_its_last_bucket_with_backward():
    cluster = Cluster(2, 1, bandwidth=1e6, latency=0.0)
    # One bucket (4 kB): ready when backward ends, all of it exposed.
    assert ddp_exposed_time(1000, 4, cluster, StepCosts(1.0)) == pytest.approx(4000 / 1e6)
    # 2 MiB of fp32 gradients: a 1 MiB first bucket ready half-way through backward, sent (1 s) while
    # the second is produced; the second bucket starts when backward ends: 1 s exposed, not 2.
    numel = 2**19
    per_bucket = 2**20 / 1e6
    assert ddp_exposed_time(numel, 4, cluster, StepCosts(3.0, backward_fraction=1.0)) == pytest.approx(per_bucket)
    # A backward shorter than the first bucket's transfer queues the second behind it.
    assert ddp_exposed_time(numel, 4, cluster, StepCosts(0.5, backward_fraction=1.0)) == pytest.approx(0.25 + 2 * per_bucket - 0.5)


def test_step_times_add_compute_to_what_each_step_sends():
    costs = StepCosts(0.1, backward_fraction=0.5, compress_rate=1e5)
    result = small_plan(costs=costs)  # 3 steps; 1-bit Adam: 1 fp32 + 2 1-bit steps; 0/1 Adam: 1 + 1 + 1 local
    fp_time, onebit_time = 2e-3 + 4000 / 1e6, (1e-3 + 68 / 1e6) * 2 + 1000 / 1e5
    adam, onebit, zoa = result["adam"], result["onebit_adam"], result["zero_one_adam"]
    assert adam["total_time_s"] == pytest.approx(3 * (0.1 + fp_time))  # one bucket: nothing overlapped
    assert onebit["total_time_s"] == pytest.approx(3 * 0.1 + fp_time + 2 * onebit_time)
    assert zoa["total_time_s"] == pytest.approx(3 * 0.1 + fp_time + onebit_time)
    assert zoa["step_time_s"] == pytest.approx(zoa["total_time_s"] / 3)
    assert zoa["speedup_vs_adam"] == pytest.approx(adam["total_time_s"] / zoa["total_time_s"])
    assert zoa["speedup_vs_onebit_adam"] == pytest.approx(onebit["total_time_s"] / zoa["total_time_s"])
    assert "speedup_vs_onebit_adam" not in adam and "step_time_s" not in small_plan()["adam"]


def test_overlapped_rounds_add_only_what_backward_does_not_hide():
    """With comm.overlap the 1-bit optimizers' rounds are bucketed as DDP's: one bucket (all ready when
    backward ends) is exposed whole, so the totals equal the non-overlapped ones; buckets of a quarter
    of the model hide the transfers of all but the last bucket behind a long backward, and none of the
    work on the ranks (encoding), which competes with backward for them. What is sent does not change."""
    costs = StepCosts(0.1, backward_fraction=0.5, compress_rate=1e5)
    plain = small_plan(costs=costs)
    whole = small_plan(costs=StepCosts(0.1, backward_fraction=0.5, compress_rate=1e5, overlap=True))
    quarter = small_plan(costs=StepCosts(10.0, backward_fraction=0.5, compress_rate=1e5, overlap=True, overlap_bucket_bytes=1000))
    long_plain = small_plan(costs=StepCosts(10.0, backward_fraction=0.5, compress_rate=1e5))
    for name in ("onebit_adam", "zero_one_adam"):
        assert whole[name]["total_time_s"] == pytest.approx(plain[name]["total_time_s"])
        assert quarter[name]["comm_time_s"] == long_plain[name]["comm_time_s"]
        assert quarter[name]["total_time_s"] < long_plain[name]["total_time_s"]
    # 1-bit Adam, 3 steps: 1 fp32 and 2 1-bit steps, each with only its last quarter's (250 elements)
    # transfer exposed, and the 1-bit steps with all their encoding (1,000 elements at 1e5/s).
    cluster = Cluster(2, 1, bandwidth=1e6, latency=1e-3)
    last_fp = 2e-3 + ring_allreduce_bytes(250, 4, 2) / 1e6
    last_onebit = flat_onebit_cost(250, cluster).seconds
    assert flat_onebit_cost(1000, cluster, 1e5).work_seconds == pytest.approx(1000 / 1e5)
    assert quarter["onebit_adam"]["total_time_s"] == pytest.approx(3 * 10.0 + last_fp + 2 * (last_onebit + 1000 / 1e5))
    assert quarter["adam"]["total_time_s"] == long_plain["adam"]["total_time_s"]  # DDP's own buckets, as before


def test_sharded_overlapped_rounds_carry_each_bucket_s_shard_and_add_only_what_backward_does_not_hide():
    """Sharded on 2 x 2 with comm.overlap, buckets of a quarter of the (whole) model: each bucket's round
    carries the node's shards of it (125 of its 250 elements per rank among the 2 nodes, the node's 2
    ranks sharing its 1 MB/s link), and behind a long backward only the last bucket's transfer is exposed,
    with all the encoding of a rank's 500-element shard. What is sent does not change."""
    args = dict(world_size=4, ranks_per_node=2, intra_bandwidth_bytes_per_s=1e15)  # FSDP2 adds no time
    plain = small_plan(**args, costs=StepCosts(10.0, backward_fraction=0.5, compress_rate=1e5))
    quarter = small_plan(**args, costs=StepCosts(10.0, backward_fraction=0.5, compress_rate=1e5, overlap=True, overlap_bucket_bytes=1000))
    among = Cluster(2, 1, bandwidth=0.5e6, latency=1e-3)
    last_fp = 2e-3 + ring_allreduce_bytes(125, 4, 2) / 0.5e6
    last_onebit = flat_onebit_cost(125, among).seconds
    onebit = quarter["onebit_adam"]["sharded"]
    assert onebit["total_time_s"] == pytest.approx(3 * 10.0 + last_fp + 2 * (last_onebit + 500 / 1e5), rel=1e-6)
    for name in ("onebit_adam", "zero_one_adam"):
        assert quarter[name]["sharded"]["comm_time_s"] == plain[name]["sharded"]["comm_time_s"]
        assert quarter[name]["sharded"]["total_time_s"] < plain[name]["sharded"]["total_time_s"]
    assert quarter["adam"]["sharded"] == plain["adam"]["sharded"]  # HSDP's own units, as before


def test_the_reduction_rate_prices_the_elements_each_rank_sends_in_full_precision():
    """Besides its transfer, a full-precision collective costs the elements a rank sends / reduce_rate:
    a ring on 2 ranks sends the 1,000 elements once (every fp32 step of the self-syncing optimizers,
    DDP's one exposed bucket), on 4 ranks 2 * 3/4 of them; the node-aware call's part inside a node of
    2 sends its 500-element shard out and back; the node-aware full-precision round the same inside the
    node and its shard once among the 2 nodes; the flat 1-bit call pays nothing of it."""
    costs, free = StepCosts(0.1, reduce_rate=1e5), StepCosts(0.1)
    fast, slow = small_plan(costs=free), small_plan(costs=costs)
    for name, fp_steps in (("adam", 3), ("onebit_adam", 1), ("zero_one_adam", 1)):
        assert slow[name]["total_time_s"] == pytest.approx(fast[name]["total_time_s"] + fp_steps * 1000 / 1e5)
    args = dict(world_size=4, ranks_per_node=2, steps=2)  # 1-bit Adam: an fp32 step, then a 1-bit one
    fast, slow = small_plan(**args, costs=free)["onebit_adam"], small_plan(**args, costs=costs)["onebit_adam"]
    assert slow["total_time_s"] == pytest.approx(fast["total_time_s"] + 1500 / 1e5)
    assert slow["hierarchical"]["total_time_s"] == pytest.approx(fast["hierarchical"]["total_time_s"] + (500 + 500) / 1e5 + 1000 / 1e5)
    with pytest.raises(UserError, match="reduction rate"):
        small_plan(costs=StepCosts(0.1, reduce_rate=0.0))


def test_format_plan_shows_both_topologies_and_times():
    out = io.StringIO()
    Console(file=out, width=400).print(format_plan(small_plan(world_size=4, ranks_per_node=2, costs=StepCosts(0.1))))
    text = out.getvalue()
    for words in (
        "0/1 Adam (flat)",
        "0/1 Adam (node-aware)",
        "1-bit Adam (node-aware)",
        "0/1 Adam (sharded)",
        "Adam (sharded)",
        "bytes / rank inside the node",
        "bytes over each node's link",
        "predicted step time",
        "speed-up vs 1-bit Adam",
    ):
        assert words in text


LR_SCHEDULES = {
    "lr": LRSchedule("exponential", lr=1e-2, warmup_steps=5, decay_factor=0.5, decay_every=8),
    "steps": LRSchedule("cosine", lr=1e-2, warmup_steps=5, total_steps=60, min_lr=1e-4),
    "fixed": LRSchedule("constant", lr=1e-2),
}


@pytest.mark.parametrize("policy", ["lr", "steps", "fixed"])
def test_plan_decisions_match_zero_one_adam(policy):
    """A single-process ZeroOneAdam drives its own ZeroOneSchedule; with the lr set from the schedule
    each step, its per-step record must be what zero_one_step_kinds predicts."""
    knobs = dict(
        var_freeze_step=12,
        var_update_scaler=2,
        local_steps=policy,
        local_step_clip=4,
        local_step_scaler=7,
        local_step_interval=3,
    )
    lr = LR_SCHEDULES[policy]
    steps = 60
    param = torch.nn.Parameter(torch.zeros(10))
    optimizer = ZeroOneAdam([param], lr=lr(0), **knobs)
    generator = torch.Generator().manual_seed(0)
    actual = []
    for t in range(steps):
        optimizer.param_groups[0]["lr"] = lr(t)
        param.grad = torch.randn(10, generator=generator)
        optimizer.step()
        record = optimizer.last_step
        actual.append((record.step, record.synced, record.variance_updated, record.interval))
    predicted = []
    kinds = set()
    for decision, kind in zero_one_step_kinds(steps, lr, **knobs):
        predicted.append((decision.step, decision.sync, decision.variance_update, decision.interval))
        kinds.add(kind)
        assert kind == (VARIANCE if decision.variance_update else ONEBIT if decision.sync else LOCAL)
    assert actual == predicted
    assert kinds == {VARIANCE, ONEBIT, LOCAL}  # the run exercises every kind of step
    summary = plan(steps, lr, 2, 10, bandwidth_bytes_per_s=1e9, latency_s=0.0, **knobs)["zero_one_adam"]
    assert summary["syncs"] == sum(synced for _, synced, _, _ in actual)
    assert summary["variance_updates"] == sum(updated for _, _, updated, _ in actual)
    assert summary["max_interval"] == max(interval for *_, interval in actual)


@pytest.mark.parametrize("path", sorted(Path(__file__).resolve().parents[1].glob("recipes/*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_is_valid(path):
    import yaml

    recipe = load_recipe(path)
    assert recipe.train.global_batch_size % recipe.train.micro_batch_size == 0
    # Each names its bias correction, so that the library's default (true since issue 35, false before)
    # never changes what a recipe trains.
    assert "bias_correction" in yaml.safe_load(path.read_text())["optimizer"]


@pytest.mark.parametrize(
    "lr, knobs",
    [
        (
            LRSchedule("exponential", lr=1e-2, warmup_steps=20, decay_factor=0.5, decay_every=30),
            dict(var_freeze_step=50, var_update_scaler=3, local_steps="lr", local_step_clip=8),
        ),
        (
            LRSchedule("cosine", lr=1e-2, warmup_steps=10, total_steps=400, min_lr=1e-4),
            dict(var_freeze_step=64, var_update_scaler=2, local_steps="steps", local_step_clip=16, local_step_scaler=40),
        ),
        (LRSchedule("constant", lr=1e-2), dict(var_freeze_step=30, var_update_scaler=1, local_steps="fixed", local_step_interval=5)),
    ],
    ids=["lr", "steps", "fixed"],
)
def test_plan_counts_equal_an_independent_derivation(lr, knobs):
    """plan and ZeroOneAdam share ZeroOneSchedule; this counts the same run from the definitions alone."""
    steps = 400
    expected = zero_one_counts_reference(
        steps, lr, knobs["var_freeze_step"], knobs["var_update_scaler"], knobs["local_steps"],
        knobs.get("local_step_clip", 16), knobs.get("local_step_scaler", 32_678), knobs.get("local_step_interval", 1),
    )  # fmt: skip
    planned = plan(steps, lr, 2, 1000, bandwidth_bytes_per_s=1e9, latency_s=0.0, **knobs)["zero_one_adam"]
    assert {key: planned[key] for key in expected} == expected
    assert expected["rounds"] < steps - 100  # each schedule has long local-step periods to count


def test_a_lr_policy_that_never_takes_a_local_step_is_said_once():
    knobs = dict(var_freeze_step=20, var_update_scaler=4, local_steps="lr", local_step_clip=8)
    constant = plan(100, LRSchedule("constant", lr=1e-2), 2, 1000, bandwidth_bytes_per_s=1e9, latency_s=0.0, **knobs)["zero_one_adam"]
    assert "never takes a local step" in constant["warning"] and "var_freeze_step (20)" in constant["warning"]
    halving = LRSchedule("exponential", lr=1e-2, decay_factor=0.5, decay_every=30)
    assert "warning" not in plan(100, halving, 2, 1000, bandwidth_bytes_per_s=1e9, latency_s=0.0, **knobs)["zero_one_adam"]
    fixed = plan(
        100, LRSchedule("constant", lr=1e-2), 2, 1000, bandwidth_bytes_per_s=1e9, latency_s=0.0, **{**knobs, "local_steps": "fixed", "local_step_interval": 4}
    )
    assert "warning" not in fixed["zero_one_adam"]
    short = plan(20, LRSchedule("constant", lr=1e-2), 2, 1000, bandwidth_bytes_per_s=1e9, latency_s=0.0, **knobs)  # ends at the freeze
    assert "warning" not in short["zero_one_adam"]


@pytest.mark.parametrize(
    "knobs, warned",
    [
        (dict(sync_every=500), "optimizer.sync_every (500) leaves this run of 1,200 steps 2 outer step(s), too few to train"),
        (dict(sync_every=151), "set sync_every to 150 or less"),  # 7 outer steps
        (dict(sync_every=150), None),  # 8
        (dict(sync_every=8, fragments=4), None),
    ],
)
def test_diloco_with_too_few_outer_steps_is_said_once(knobs, warned):
    planned = plan(1200, LRSchedule("constant", lr=1e-3), 2, 1000, bandwidth_bytes_per_s=1e9, latency_s=0.0, **knobs)["diloco"]
    assert planned.get("warning") is None if warned is None else warned in planned["warning"]


@pytest.mark.parametrize("freeze_step, warned", [(100_000, True), (1200, True), (1199, False), (240, False)])
def test_powersgd_that_never_compresses_is_said_once(freeze_step, warned):
    planned = plan(1200, LRSchedule("constant", lr=1e-3), 2, 1000, bandwidth_bytes_per_s=1e9, latency_s=0.0, freeze_step=freeze_step)["powersgd"]
    assert ("so powersgd never compresses" in planned.get("warning", "")) is warned


def test_plan_says_a_warning_in_one_line(capsys, monkeypatch):
    """On stderr, for every optimizer it plans (run says its own optimizer's: tests/test_bad_input.py)."""
    from zoa_train import cli

    monkeypatch.setattr(sys, "argv", ["zoa-train", "plan", str(Path(__file__).resolve().parents[1] / "recipes" / "gpt2_tiny.yaml")])
    with pytest.raises(SystemExit) as done:
        cli.run()
    assert done.value.code == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning (diloco): ")]
    assert len(lines) == 1 and "2 outer step(s), too few to train" in lines[0]


def test_diloco_on_a_run_too_short_for_enough_outer_steps_says_so_rather_than_the_sync_every_it_has():
    """Fewer steps than the outer steps a run needs: no sync_every gives them, so the advice is more steps."""
    planned = plan(4, LRSchedule("constant", lr=1e-3), 2, 1000, bandwidth_bytes_per_s=1e9, latency_s=0.0, sync_every=1)["diloco"]
    assert "4 outer step(s), too few to train" in planned["warning"] and "train at least 8 steps" in planned["warning"]
    assert "set sync_every to" not in planned["warning"]


def test_plan_of_a_sharded_recipe_on_one_gpu_per_node_says_why_there_are_no_sharded_columns(capsys, monkeypatch):
    from zoa_train import cli

    recipe = str(Path(__file__).resolve().parents[1] / "recipes" / "llama_tiny.yaml")
    for gpus, warned in (("1", True), ("2", False)):
        monkeypatch.setattr(sys, "argv", ["zoa-train", "plan", recipe, "--set", "comm.shard=node", "--nodes", "2", "--gpus-per-node", gpus])
        with pytest.raises(SystemExit) as done:
            cli.run()
        assert done.value.code == 0
        err = capsys.readouterr().err
        assert ("comm.shard node" in err and "no sharded columns; pass --gpus-per-node" in err) is warned, err


def test_plan_keeps_rounds_in_step_where_the_trainer_would_and_says_so(capsys):
    args = ["plan", "recipes/gpt2_tiny.yaml", "--nodes", "4", "--gpus-per-node", "2", "--step-time", "50ms", "--bandwidth", "100Mbit", "--json"]
    overlap, unclipped = ["--set", "comm.overlap=true", "--set", "comm.bucket_cap_mb=0.25"], ["--set", "train.grad_clip=0"]
    plans = {}
    # the recipe clips at 1.0: by the global rule in step(); by bucket (grad_clip_rule auto under comm.overlap) overlapped
    by_global = ["--set", "train.grad_clip_rule=global"]
    for name, extra in (("in step", unclipped), ("clipped", overlap + by_global), ("overlapped", overlap + unclipped), ("by bucket", overlap)):
        done = zoa_here(capsys, *args, *extra)
        assert done.returncode == 0, done.stderr
        plans[name] = json.loads(done.stdout)["zero_one_adam"]
        assert ("train.grad_clip changes the gradients after backward" in done.stderr) == (name == "clipped"), done.stderr
    flat, sharded = (lambda p: p), (lambda p: p["sharded"])  # the flat record is the optimizer's own
    for record in (flat, sharded):
        assert record(plans["clipped"])["total_time_s"] == record(plans["in step"])["total_time_s"]
        assert record(plans["overlapped"])["total_time_s"] < record(plans["in step"])["total_time_s"]
        assert record(plans["by bucket"])["total_time_s"] == record(plans["overlapped"])["total_time_s"]
