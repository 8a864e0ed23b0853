"""plan's memory per rank against what the optimizers hold: each built as the trainer builds it on a
small GPT-2, in this process (one rank) and on 2 Gloo ranks (4 for the node-aware sync), every tensor
of its state counted; the sharded figures by hand; the CLI's rows and its refusal of a bad --gpu-memory."""

import dataclasses
import json
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from conftest import refused, zoa_here
from distributed_harness import run_ranks
from transformers import GPT2Config, GPT2LMHeadModel

from zoa_train.comm import ClusterCollective
from zoa_train.comm.sharding import local_shard
from zoa_train.errors import UserError
from zoa_train.optim import LRSchedule, registry
from zoa_train.optim.base import DataParallelOptimizer
from zoa_train.optim.training import parameter_groups
from zoa_train.plan.model import largest_fsdp_unit, memory_per_rank, plan
from zoa_train.plan.table import format_plan
from zoa_train.plan.units import parse_memory

# GPT-2 of 2 layers, width 32, 64 tokens, 16 positions (lm_head tied to wte).
CONFIG = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
STEPS = 3  # past every warm-up below: PowerSGD has compressed, the 1-bit optimizers have sent 1 bit
KNOBS = {
    "adam": {},
    "onebit_adam": {"freeze_step": 2},
    "zero_one_adam": {"var_freeze_step": 2, "local_steps": "fixed", "local_step_interval": 1},
    "powersgd": {"freeze_step": 2, "powersgd_rank": 2},
    "diloco": {"sync_every": 2, "outer_collective": "topk", "topk_chunk": 64},  # chunks of 64: the top-k layout pads
}
PLAN_KNOBS = {key: value for knobs in KNOBS.values() for key, value in knobs.items()}


def tiny_gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**CONFIG))


def section(name: str) -> SimpleNamespace:
    """A recipe's optimizer section: the shared knobs, weight decay (two parameter groups), `name`'s knobs."""
    return SimpleNamespace(name=name, **dataclasses.asdict(registry.SharedKnobs(lr=3e-3, weight_decay=0.01)), **KNOBS[name])


def planned(world_size: int, ranks_per_node: int = 1, **more) -> dict:
    named = list(tiny_gpt2().named_parameters())
    shapes = tuple(tuple(p.shape) for _, p in named)
    return plan(
        STEPS,
        LRSchedule("constant", lr=3e-3),
        world_size,
        sum(p.numel() for _, p in named),
        bandwidth_bytes_per_s=1e9,
        latency_s=0.0,
        ranks_per_node=ranks_per_node,
        param_shapes=shapes,
        param_names=tuple(name for name, _ in named),
        **{**PLAN_KNOBS, **more},
    )


def nbytes(t: torch.Tensor) -> int:
    """Bytes this rank holds of `t` (its shard of a DTensor)."""
    t = local_shard(t)
    return t.numel() * t.element_size()


def held(trained) -> dict[str, int]:
    """Bytes of every tensor an optimizer keeps (a TrainingOptimizer's, or a torch optimizer), by the
    names plan gives them: flat buffers over the groups, the collective's buffers, torch's state."""
    opt, found = getattr(trained, "optimizer", trained), Counter()
    if isinstance(opt, DataParallelOptimizer):
        for buffers in opt._buffers:
            for name, t in buffers.items():
                found[name] += nbytes(t)
        for t in getattr(opt, "_pseudo_gradients", []):
            found["pseudo_gradient"] += nbytes(t)
        if opt.collective is not None:
            found.update({f"collective.{name}": nbytes(t) for name, t in opt.collective.held_buffers().items()})
    else:
        for state in opt.state.values():
            for name, t in state.items():
                found[name] += nbytes(t)
        hook = getattr(trained, "comm_hook", None)
        if hook is not None:  # torch's PowerSGD state, per DDP bucket
            for name, memory in (("powersgd_error", hook.state.error_dict), ("powersgd_p", hook.state.p_memory_dict), ("powersgd_q", hook.state.q_memory_dict)):
                found[name] = sum(nbytes(t) for t in memory.values())
    return dict(found)


def grad_bytes(model: torch.nn.Module) -> int:
    """Bytes of the storage behind the gradients, each storage once (DDP's buckets hold them as views)."""
    storages = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None}
    return sum(storages.values())


def train(trained, model, rank: int = 0) -> None:
    module = getattr(trained, "module", model)
    for t in range(STEPS):
        tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1000 * rank + t))
        if t:
            trained.zero_grad()
        module(tokens, labels=tokens).loss.backward()
        trained.step()


def measured(name: str, world_size: int, rank: int = 0, collective=None) -> dict:
    """What `name`'s optimizer, built as the trainer builds it, holds after STEPS steps."""
    model = tiny_gpt2()
    trained = registry.create(section(name), model, torch.device("cpu"), world_size, **({"collective": collective} if collective else {}))
    train(trained, model, rank)
    return {"buffers": held(trained), "params": sum(nbytes(p) for p in model.parameters()), "grads": grad_bytes(model)}


def expected(record: dict) -> dict:
    return {"buffers": record["state_buffers"] | record["scratch_buffers"], "params": record["params"], "grads": record["grads"]}


def test_one_rank_holds_what_plan_says():
    """World size 1, this process: the self-syncing optimizers as the trainer builds them, and the
    torch AdamW that `adam` puts on DDP (DDP itself needs a process group: the 2-rank test has it)."""
    result = planned(1)
    for name in ("onebit_adam", "zero_one_adam", "diloco"):
        assert measured(name, 1) == expected(result[name]["memory_per_rank"]), name
    model = tiny_gpt2()
    adamw = torch.optim.AdamW(parameter_groups(model, 0.01), lr=3e-3, foreach=True)  # adam_on_ddp's on a CPU
    train(adamw, model)
    assert held(adamw) == result["adam"]["memory_per_rank"]["state_buffers"]
    # one rank: nothing to pad, nothing on the wire, the worker buffer the whole model
    zero_one = result["zero_one_adam"]["memory_per_rank"]
    numel = sum(p.numel() for p in model.parameters())
    assert zero_one["state_buffers"]["collective._worker"] == zero_one["state_buffers"]["anchor"] == 4 * numel and zero_one["scratch"] == 0


def _measure_ranks(rank: int, world_size: int, names: tuple[str, ...], ranks_per_node: int) -> dict:
    collective = ClusterCollective("hierarchical", ranks_per_node=ranks_per_node) if ranks_per_node > 1 else None
    found = {name: measured(name, world_size, rank, collective) for name in names}
    dist.barrier()
    return found


@pytest.mark.slow
def test_two_ranks_hold_what_plan_says():
    """Every optimizer, built by the registry over a 2-rank Gloo group, on every rank: its flat state,
    its collective's error, wire and kernel buffers (the fused kernels: none), torch's AdamW state and
    PowerSGD hook state, and the gradients (under DDP, its buckets: no second copy)."""
    result = planned(2)
    for found in run_ranks(_measure_ranks, 2, tuple(KNOBS), 1):
        for name, record in result.items():
            assert found[name] == expected(record["memory_per_rank"]), name
    assert result["zero_one_adam"]["memory_per_rank"]["scratch"] > 0 and result["powersgd"]["memory_per_rank"]["state_buffers"]["powersgd_p"] > 0


def _diloco_in_flight(rank: int, world_size: int, knobs: dict) -> int:
    """The most bytes of pseudo-gradient a delayed full-precision DiLoCo holds after a step (its outer
    round in flight), over a period of every fragment's outer step."""
    model = tiny_gpt2()
    optimizer = SimpleNamespace(**vars(section("diloco")) | knobs)
    trained = registry.create(optimizer, model, torch.device("cpu"), world_size)
    most = 0
    for t in range(knobs["sync_every"] + 1):
        tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1000 * rank + t))
        trained.zero_grad()
        model(tokens, labels=tokens).loss.backward()
        trained.step()
        most = max(most, sum(nbytes(g) for _, flats in trained.optimizer._pending for g in flats))
    trained.optimizer.synchronize()
    return most


def test_a_delayed_outer_round_holds_its_fragment_s_pseudo_gradient_as_plan_says():
    knobs = {"outer_collective": "full", "sync_every": 3, "fragments": 2, "sync_delay": 1}
    record = planned(2, **knobs)["diloco"]["memory_per_rank"]
    assert planned(2, **knobs | {"sync_delay": 0})["diloco"]["memory_per_rank"]["state_buffers"].keys() == record["state_buffers"].keys() - {"pseudo_gradient"}
    assert run_ranks(_diloco_in_flight, 2, knobs) == [record["state_buffers"]["pseudo_gradient"]] * 2


@pytest.mark.slow
def test_the_node_aware_sync_holds_what_plan_says():
    """2 nodes of 2 Gloo ranks, every local rank: the node-aware collective's accumulators, shard,
    all-gather and the flat allreduce of the shard between the nodes (plan's node-aware record)."""
    result = planned(4, ranks_per_node=2)
    record = result["zero_one_adam"]["hierarchical"]["memory_per_rank"]
    assert "collective._shard" in record["scratch_buffers"] and "collective.inter._server" in record["state_buffers"]
    for found in run_ranks(_measure_ranks, 4, ("zero_one_adam",), 2):
        assert found["zero_one_adam"] == expected(record)


def test_sharded_memory_by_hand():
    """A (100, 10) matrix and its bias in one numbered block on 2 nodes of 8 ranks: each rank holds 13
    of the 100 rows (FSDP2 pads to ceil(100/8)), 143 elements of each fp32 buffer. 0/1 Adam's layouts
    over the 2 nodes: the matrix's 130 elements in rows of 96 (one per rank: 192 padded), the bias's
    13 in a row of 32 (64): m, v and the anchor 256 elements each, the worker error 256, the server
    error one chunk of each (96 + 32); each wire segment 96/8 + 4 + 32/8 + 4 = 24 bytes, n of them in
    the send, receive and all-gather buffers and one in _mine. The unit is the block: 1,100 parameters
    and as many gradients unsharded at once."""
    result = plan(1, LRSchedule("constant", lr=1e-3), 16, 1100, bandwidth_bytes_per_s=1e9, latency_s=0.0, ranks_per_node=8,
                  param_shapes=((100, 10), (100,)), param_names=("blocks.0.weight", "blocks.0.bias"), gpu_memory_bytes=20_000)  # fmt: skip
    zero_one = result["zero_one_adam"]["sharded"]["memory_per_rank"]
    assert zero_one["params"] == zero_one["grads"] == 4 * 143
    assert zero_one["state_buffers"] == {"exp_avg": 1024, "exp_avg_sq": 1024, "anchor": 1024, "collective._worker": 1024, "collective._server": 4 * 128}
    assert zero_one["scratch_buffers"] == {"collective._send": 48, "collective._recv": 48, "collective._gathered": 48, "collective._mine": 24}
    assert zero_one["fsdp_unit"] == 8 * 1100 and zero_one["fsdp_unit_is"] == "a block (blocks.0)"
    assert zero_one["total"] == 2 * 572 + 4608 + 168 + 8800 == 20_000 - zero_one["headroom"] and zero_one["fits"]
    adam = result["adam"]["sharded"]["memory_per_rank"]
    assert adam["state_buffers"] == {"exp_avg": 572, "exp_avg_sq": 572, "step": 8}  # AdamW on the shards (HSDP)
    assert not result["onebit_adam"]["memory_per_rank"]["fits"]  # unsharded it needs more than 20 kB
    assert "sharded" not in result["powersgd"]  # DDP's hook: not shardable
    diloco = result["diloco"]["sharded"]["memory_per_rank"]  # inner m and v, the anchor and the outer momentum of the shard
    assert diloco["state_buffers"] == {name: 4 * 143 for name in ("exp_avg", "exp_avg_sq", "anchor", "outer_momentum")}
    one_rank_a_node = plan(1, LRSchedule("constant", lr=1e-3), 2, 1100, bandwidth_bytes_per_s=1e9, latency_s=0.0)
    assert all("sharded" not in record for record in one_rank_a_node.values())  # sharding over 1 rank changes nothing


def test_fsdp_units_are_the_numbered_blocks_and_the_root():
    names = ("transformer.wte.weight", "transformer.h.0.attn.weight", "transformer.h.0.attn.bias", "transformer.h.11.mlp.weight", "transformer.ln_f.weight")
    shapes = ((1000, 10), (10, 30), (30,), (10, 40), (10,))
    assert largest_fsdp_unit(10_740, shapes, names) == (10_010, "the root (what no numbered block holds)")
    assert largest_fsdp_unit(730, shapes[1:4], names[1:4]) == (400, "a block (transformer.h.11)")
    assert largest_fsdp_unit(1_460, shapes[1:4], names[1:4]) == (800, "a block (transformer.h.11)")  # another count: scaled
    assert largest_fsdp_unit(730, shapes[1:4], ()) == (730, "the whole model (units unknown)")


def test_an_optimizer_that_declares_no_memory_is_not_planned():
    bare = registry.OptimizerSpec("bare", "Bare", build=lambda ctx: None, plan=lambda ctx: None)
    assert memory_per_rank(bare, None, (((10,),),), 1, lambda sizes: None) is None


@pytest.mark.parametrize("text, expected", [("80GB", 80e9), ("80 GiB", 80 * 2**30), ("141GB", 141e9), ("512MiB", 2**29), ("1e10", 1e10), (8e10, 8e10)])
def test_parse_memory(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["lots", "", "80Gb", "-1GB", "0GB", "80GB/s", "inf"])
def test_parse_memory_rejects(text):
    with pytest.raises(UserError, match="GPU memory") as info:
        parse_memory(text)
    assert repr(text) in str(info.value)


def test_the_cli_shows_memory_per_rank_and_what_fits(capsys):
    done = zoa_here(capsys, "plan", "recipes/gpt2_tiny.yaml", "--nodes", "2", "--gpus-per-node", "2", "--gpu-memory", "80GB")
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    for words in ("optimizer state / rank", "comm scratch / rank", "memory / rank", "fits in 80.00 GB", "0/1 Adam (sharded)", "activations (full)"):
        assert words in text, words
    assert "FSDP2 unit unsharded" in text and "largest unit the root" in text and "fits with checkpointing" in text
    done = zoa_here(capsys, "plan", "recipes/gpt2_tiny.yaml", "--nodes", "2", "--gpus-per-node", "2", "--json")
    result = json.loads(done.stdout)
    for name in ("adam", "zero_one_adam"):
        memory = result[name]["memory_per_rank"]
        parts = ("params", "grads", "optimizer_state", "scratch", "activations")
        assert memory["total"] == sum(memory[key] for key in parts) and "fits" not in memory and "fits_with" not in memory
        assert memory["activations"] == memory["activations_by_mode"]["none"] > memory["activations_by_mode"]["full"] > 0
        assert result[name]["sharded"]["memory_per_rank"]["total"] < memory["total"]
    assert result["zero_one_adam"]["hierarchical"]["memory_per_rank"]["total"] > result["zero_one_adam"]["memory_per_rank"]["total"]


@pytest.mark.parametrize("value", ["lots", "0GB", "80Gb"])
def test_a_bad_gpu_memory_is_refused_in_one_sentence(capsys, value):
    refused(zoa_here(capsys, "plan", "recipes/gpt2_tiny.yaml", "--gpu-memory", value), f"GPU memory {value!r}")


def test_format_plan_marks_what_does_not_fit():
    table = format_plan(planned(2, gpu_memory_bytes=100_000))
    from rich.console import Console

    console = Console(width=250, record=True)
    console.print(table)
    text = console.export_text()
    assert "fits in 100.00 kB" in text and "no, " in text and "over" in text


def _measure_sharded(rank: int, world_size: int, names: tuple[str, ...]) -> dict:
    """Each optimizer as the trainer builds it with comm.shard node, on 2 nodes of 2 ranks: this rank's
    shards of the parameters and gradients, and every tensor its optimizer keeps."""
    import functools

    from zoa_train.comm import OneBitAllReduce
    from zoa_train.comm.sharding import node_sharding

    sharding = node_sharding(2)
    found = {}
    for name in names:
        model = tiny_gpt2()
        trained = registry.create(section(name), model, torch.device("cpu"), world_size, collective=functools.partial(OneBitAllReduce), sharding=sharding)
        train(trained, model, rank)
        shards = [local_shard(p) for p in model.parameters()]
        grads = [local_shard(p.grad) for p in model.parameters() if p.grad is not None]
        found[name] = {"buffers": held(trained), "params": sum(map(nbytes, shards)), "grads": sum(map(nbytes, grads))}
    dist.barrier()
    return found


@pytest.mark.slow
def test_sharded_ranks_hold_what_plan_says():
    """Memory measured with FSDP2 on 2 x 2 ranks: local rank 0 holds the larger shards (FSDP2 gives each
    rank ceil(rows / G) rows, the last ones fewer), exactly plan's sharded figures; local rank 1 at most
    those; and the optimizer's state is half the unsharded state, but for the padding of the layout."""
    result = planned(4, ranks_per_node=2)
    shardable = ("adam", "onebit_adam", "zero_one_adam", "diloco")
    ranks = run_ranks(_measure_sharded, 4, shardable, sharded=True)
    for name in shardable:
        record = result[name]["sharded"]["memory_per_rank"]
        want = {"buffers": record["state_buffers"] | record["scratch_buffers"], "params": record["params"], "grads": record["grads"]}
        for rank in (0, 2):
            assert ranks[rank][name] == want, (name, rank)
        for rank in (1, 3):
            found = ranks[rank][name]
            assert found["params"] <= want["params"] and sum(found["buffers"].values()) <= sum(want["buffers"].values())
        unsharded = sum(result[name]["memory_per_rank"]["state_buffers"].values())
        assert sum(record["state_buffers"].values()) <= unsharded / 2 + 64 * 1024, name


def test_plan_counts_the_recipe_s_checkpointing_and_names_the_mode_that_fits():
    """The memory of one rank with each mode's activations; fits_with the mode that recomputes least among those that fit."""
    from zoa_train.optim.lr_schedules import LRSchedule
    from zoa_train.plan.model import plan

    activations = {"none": 9 * 10**9, "selective": 5 * 10**9, "full": 10**9}
    common = dict(bandwidth_bytes_per_s=1e9, latency_s=0.0, activations=activations)
    base = plan(10, LRSchedule(), 2, 10**8, **common)["adam"]["memory_per_rank"]  # 0.8 GB params and grads, 0.8 GB AdamW (and its step)
    assert base["activations"] == 9 * 10**9 and base["total"] == sum(base[k] for k in ("params", "grads", "optimizer_state", "scratch")) + 9 * 10**9
    full = plan(10, LRSchedule(), 2, 10**8, checkpointing="full", **common)["adam"]["memory_per_rank"]
    assert full["total"] == base["total"] - 8 * 10**9
    for gpu, mode in ((20e9, "none"), (8e9, "selective"), (3e9, "full"), (2e9, None)):
        memory = plan(10, LRSchedule(), 2, 10**8, gpu_memory_bytes=gpu, **common)["adam"]["memory_per_rank"]
        assert memory["fits_with"] == mode, (gpu, memory)
    with pytest.raises(UserError, match="checkpointing must be one of none, selective, full"):
        plan(10, LRSchedule(), 2, 10**8, checkpointing="most", **common)
