"""0/1 Adam, 1-bit Adam and DiLoCo sharded inside the node (FSDP2), one bit between nodes (comm.shard node).

The reference for 2 nodes x 2 ranks sharded is the same optimizer unsharded on 2 ranks, each of
which sees the union of its node's micro-batches (gradient accumulation over two). They are equal
bit for bit here, not only to rounding, because every operation meets the same numbers in the same
order: each micro-batch's backward is the same computation on the same all-gathered weights; FSDP2
averages two micro-batches' gradients as g_a/2 + g_b/2, as accumulation of two half-weighted losses
does (halving is exact); and the 1-bit compressor's scale rows are whole rows of each tensor in both
layouts (the tensors' shards are whole 4096-element rows), so every row is compressed with the same
scale. update_clip scales each tensor by its RMS, summed over shards in another order: it is checked
to rounding (test_update_clip_sees_whole_tensors).
"""

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import refused, zoa, zoa_here
from distributed_harness import run_ranks

from zoa_train.comm import OneBitAllReduce
from zoa_train.comm.buckets import BucketedCollective
from zoa_train.comm.sharding import gradient_order, local_shard, shard_model
from zoa_train.evaluation.checkpoints import load_language_model
from zoa_train.optim import OneBitAdam, ZeroOneAdam
from zoa_train.optim.diloco import DiLoCo
from zoa_train.optim.training import parameter_groups
from zoa_train.step_kinds import LOCAL, ONEBIT, VARIANCE
from zoa_train.train.checkpointer import read_whole
from zoa_train.train.rundir import file_digest, read_manifest, verify_checkpoint

WIDTH = 128  # a shard of a WIDTH x WIDTH weight over 2 ranks: 8192 elements, two whole scale rows


class Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x)) + x
        return x


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)


def _optimizer(name: str, params, group, update_clip=None):
    if name == "zero_one_adam":  # variance steps, 1-bit syncs and local steps within 24 steps
        knobs = dict(var_freeze_step=10, var_update_scaler=2, local_steps="fixed", local_step_interval=3, update_clip=update_clip)
        return ZeroOneAdam(params, lr=0.01, weight_decay=0.01, process_group=group, **knobs)
    if name == "diloco":  # inner AdamW steps on the node's gradients, an outer step over the shard every 4
        return DiLoCo(params, lr=0.01, weight_decay=0.01, sync_every=4, process_group=group)
    return OneBitAdam(params, lr=0.01, weight_decay=0.01, freeze_step=5, process_group=group)


def _sharded_and_reference(rank, world_size, name, steps, update_clip=None):
    """2 nodes x 2 ranks sharded, next to the reference on local rank 0 of each node (ranks 0 and 2)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("node", "local"))
    reference_group = dist.new_group([0, 2])
    node, local = divmod(rank, 2)
    torch.manual_seed(0)
    reference = Blocks()
    torch.manual_seed(0)
    sharded = shard_model(Blocks(), mesh["local"])  # the same initial weights, sharded
    opt = _optimizer(name, list(sharded.parameters()), mesh.get_group("node"), update_clip)
    ref_opt = _optimizer(name, list(reference.parameters()), reference_group, update_clip) if local == 0 else None
    differences, kinds, bits, at_syncs = [], [], [], []
    for t in range(steps):
        x, y = _batch(rank, t)
        torch.nn.functional.mse_loss(sharded(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        full = [p.full_tensor() for p in sharded.parameters()]  # a collective of the node's ranks
        kinds.append(opt.last_step.kind)
        bits.append(opt.last_step.bits_per_param)
        if opt.last_step.synced:
            at_syncs.append((t, [local_shard(p).clone() for p in sharded.parameters()]))
        if ref_opt is not None:
            for micro in (2 * node, 2 * node + 1):  # the node's micro-batches, accumulated
                x, y = _batch(micro, t)
                (torch.nn.functional.mse_loss(reference(x), y) / 2).backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            differences.append(max((a - b.detach()).abs().max().item() for a, b in zip(full, reference.parameters())))
    return differences, kinds, bits, at_syncs


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero_one_adam", "onebit_adam", "diloco"])
def test_sharded_on_2_x_2_is_unsharded_on_2_ranks_that_see_their_nodes_batches(name):
    ranks = run_ranks(_sharded_and_reference, 4, name, 24, sharded=True)
    for rank in (0, 2):
        differences, kinds, _, _ = ranks[rank]
        assert differences == [0.0] * 24, f"rank {rank}: {differences}"
    kinds = "".join(ranks[0][1])
    if name == "zero_one_adam":
        assert {VARIANCE, ONEBIT, LOCAL} <= set(kinds), kinds  # variance steps, 1-bit syncs and local steps all ran
    # the nodes hold the same shards after every sync
    for a, b in ((0, 2), (1, 3)):
        syncs = 6 if name == "diloco" else 12  # DiLoCo syncs at its outer steps only: every 4th of 24
        assert len(ranks[a][3]) >= syncs and [t for t, _ in ranks[a][3]] == [t for t, _ in ranks[b][3]]
        assert all(torch.equal(p, q) for (_, mine), (_, theirs) in zip(ranks[a][3], ranks[b][3]) for p, q in zip(mine, theirs))


@pytest.mark.slow
def test_update_clip_sees_whole_tensors():
    # update_clip 0.05 clips nearly every step before the freeze, by each tensor's RMS: sharded, the
    # node sums its shards' squared norms, in another order than one rank's norm of the whole tensor,
    # so the clip factors agree to rounding (a few ulp), and so do the parameters after 24 steps.
    ranks = run_ranks(_sharded_and_reference, 4, "zero_one_adam", 24, 0.05, sharded=True)
    for rank in (0, 2):
        assert max(ranks[rank][0]) < 1e-6, ranks[rank][0]


# ---- rounds started during backward, as FSDP2 reduces each block --------------------------------------


class Tower(torch.nn.Module):
    """Blocks with biases and norms between an input layer and a norm and head of their own (FSDP2's root
    unit, reduced last); the head's 5 rows shard unequally (3 and 2) over a node's two ranks."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(WIDTH, WIDTH)
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.LayerNorm(WIDTH)) for _ in range(3))
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, 5)
        self.started: list[int] = []  # per backward, the buckets started when it reached the embedding's output

    def forward(self, x, opt):
        h = self.embed(x)
        if h.requires_grad:
            h.register_hook(lambda grad: self.started.append(opt._next_span))
        for layer in self.layers:
            h = torch.tanh(layer(h)) + h
        return self.head(self.norm(h))


# a cap of 8,492 elements: the head's shard (384 or 256 elements) and the last block's weight (8,192) fit in one
# bucket on one of a node's ranks and not on the other, when the cap counts shards
SHARD_CAP_MB = 8492 * 4 / 2**20


def _overlapped_on_the_node(rank, world_size, name):
    """2 nodes x 2 ranks sharded, bucketed by gradient_order: in step() and overlapped, unclipped and
    clipped by bucket; and bucketed by the shards' own sizes, refused."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("node", "local"))
    runs = {}
    for overlap, clip in ((False, None), (True, None), (False, 0.05), (True, 0.05)):  # clipped by bucket: norms summed over the node
        torch.manual_seed(0)
        model = shard_model(Tower(), mesh["local"])
        groups = parameter_groups(model, 0.01)
        factory = functools.partial(BucketedCollective, inner=OneBitAllReduce, bucket_cap_mb=SHARD_CAP_MB, overlap=overlap, order=gradient_order(model, groups))
        if name == "zero_one_adam":  # update_clip sums norms over the node's shards in each bucket's hook
            knobs = dict(var_freeze_step=10, var_update_scaler=2, local_steps="fixed", local_step_interval=3, update_clip=0.05)
            opt = ZeroOneAdam(groups, lr=0.01, process_group=mesh.get_group("node"), collective=factory, **knobs)
        else:
            opt = OneBitAdam(groups, lr=0.01, freeze_step=5, process_group=mesh.get_group("node"), collective=factory)
        opt.clip_by_bucket(clip)
        steps = []
        for t in range(16):
            x, y = _batch(rank, t)
            torch.nn.functional.mse_loss(model(x, opt), y[:, :5]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            steps.append(([local_shard(p).clone() for p in model.parameters()], opt.last_step.kind, opt.last_step.bits_per_param))
        buckets = [(b.group, b.tensors, b.layout.numel) for b in opt.collective.buckets]
        runs[overlap, clip] = steps, model.started, buckets
    torch.manual_seed(0)
    model = shard_model(Tower(), mesh["local"])
    factory = functools.partial(BucketedCollective, inner=OneBitAllReduce, bucket_cap_mb=SHARD_CAP_MB)
    try:
        ZeroOneAdam(parameter_groups(model, 0.01), process_group=mesh.get_group("node"), collective=factory)
        refusal = None
    except ValueError as error:
        refusal = str(error)
    return runs, refusal


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero_one_adam", "onebit_adam"])
def test_rounds_started_as_fsdp2_reduces_each_block_equal_the_same_buckets_in_step(name):
    ranks = run_ranks(_overlapped_on_the_node, 4, name, sharded=True)
    for rank, (runs, refusal) in enumerate(ranks):
        (_, _, buckets), (overlapped, started, _) = runs[False, None], runs[True, None]
        for clip in (None, 0.05):
            for t, (a, b) in enumerate(zip(runs[False, clip][0], runs[True, clip][0])):
                assert all(torch.equal(x, y) for x, y in zip(a[0], b[0])) and a[1:] == b[1:], f"rank {rank} step {t} clip {clip}: overlapped differs"
        assert not all(torch.equal(x, y) for x, y in zip(overlapped[-1][0], runs[True, 0.05][0][-1][0]))  # the clip did something
        # the blocks' weights first, a bucket each; the root unit's tensors (all of group 1's bucket holds some) last
        assert [bucket[:2] for bucket in buckets] == [(0, [3]), (0, [2]), (0, [1]), (1, [9, 8, 7, 6, 5, 4, 3, 2, 1, 12, 11, 10, 0]), (0, [4]), (0, [0])]
        # every block's bucket had started when backward reached the embedding's output, before FSDP2 reduced the root unit
        assert max(started) == 3, started
        assert "cut different buckets" in refusal, refusal
    kinds = "".join(kind for _, kind, _ in ranks[0][0][True, None][0])
    assert ONEBIT in kinds and (name == "onebit_adam" or LOCAL in kinds), kinds
    for a, b in ((0, 2), (1, 3)):  # the nodes' shards equal after every sync
        for t, ((mine, kind, _), (theirs, _, _)) in enumerate(zip(ranks[a][0][True, 0.05][0], ranks[b][0][True, 0.05][0])):
            if kind != LOCAL:
                assert all(torch.equal(x, y) for x, y in zip(mine, theirs)), f"ranks {a} and {b} differ after step {t}"
    assert [bucket[:2] for bucket in ranks[0][0][False, None][2]] == [bucket[:2] for bucket in ranks[1][0][False, None][2]]  # cut alike on the node


# ---- through the trainer: 4 ranks as 2 emulated nodes of 2 ------------------------------------------

SHARDED = ("train.nproc=4", "comm.ranks_per_node=2", "comm.shard=node", "train.micro_batch_size=8")


def _short(cache_dir, steps: int, *extra: str) -> list[str]:
    sets = [f"train.steps={steps}", "train.log_every=1", "train.val_batches=1", "train.val_every=0", "logging.wandb=disabled", f"data.cache_dir={cache_dir}"]
    return [arg for s in [*sets, *SHARDED, *extra] for arg in ("--set", s)]


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _as_written_before_model_shards(run_dir, step: int, out):
    """A copy of run `run_dir` whose checkpoint at `step` (taken at a sync) is laid out as zoa-train wrote a
    sharded run's checkpoint before model/: the whole model, gathered, in model.pt. Returns that checkpoint."""
    shutil.copytree(run_dir, out)
    checkpoint = out / "checkpoints" / f"step_{step:08d}"
    torch.save(read_whole(checkpoint / "model")["model"], checkpoint / "model.pt")
    shutil.rmtree(checkpoint / "model")
    marker = [line for line in (checkpoint / "COMPLETE").read_text().splitlines() if not line.startswith("file model/")]
    marker.append(f"file model.pt {(checkpoint / 'model.pt').stat().st_size} {file_digest(checkpoint / 'model.pt')}")
    (checkpoint / "COMPLETE").write_text("".join(line + "\n" for line in marker))
    return checkpoint


@pytest.mark.slow
def test_a_sharded_run_resumes_exactly_inside_a_local_period_and_reshards_at_a_sync(tmp_path, cache_dir):
    # rounds started during backward as FSDP2 reduces each block (unclipped: clipping would keep them in step())
    local = ("optimizer.var_freeze_step=2", "optimizer.local_steps=fixed", "optimizer.local_step_interval=3")
    knobs = _short(cache_dir, 8, "train.checkpoint_every=4", *local, "comm.overlap=true", "train.grad_clip=0")
    first = tmp_path / "first"
    done = zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(first), *knobs)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "flat 1-bit sync of each shard, buckets of 100 MB overlapped with backward" in done.stdout, done.stdout
    records = _metrics(first)
    assert records[-1]["rounds"] < 8 and records[-1]["intra_bytes_sent"] > 0  # local steps; FSDP2's traffic counted inside the node
    second = tmp_path / "second"
    resumed = zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(second), "--resume", str(first / "checkpoints" / "step_00000004"), *knobs)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = _metrics(second)
    assert [r["loss"] for r in again] == [r["loss"] for r in records[4:]]
    assert again[-1]["bits_per_param"] == records[-1]["bits_per_param"]
    # No model.pt: every rank wrote its shards (model/, in the background), each file in the marker; the
    # checkpoint inside a local-step period holds each node's model, the one at a sync one model.
    final, inside = first / "checkpoints" / "step_00000008", first / "checkpoints" / "step_00000004"
    assert not (final / "model.pt").exists() and verify_checkpoint(final) is None
    assert {f"model/__{r}_0.distcp" for r in range(4)} | {"model/.metadata"} <= set(read_manifest(final))
    nodes = read_whole(inside / "model")
    assert sorted(nodes) == ["node_0", "node_1"] and any(not torch.equal(nodes["node_0"][k], nodes["node_1"][k]) for k in nodes["node_0"])
    a, b = read_whole(final / "model")["model"], read_whole(second / "checkpoints" / "step_00000008" / "model")["model"]
    assert a["transformer.wte.weight"].shape == (4096, 128) and all(torch.equal(a[k], b[k]) for k in a)  # exact, bit for bit
    # export and eval read the shards whole on one process: the run's model, and inside a period the nodes' average
    loaded = load_language_model(first, "wikitext")  # the run directory: its latest checkpoint, step 8
    assert loaded.step == 8 and loaded.averaged_ranks == 1 and all(torch.equal(v, a[k]) for k, v in loaded.model.state_dict().items())
    averaged = load_language_model(inside)
    assert averaged.averaged_ranks == 2 and torch.equal(
        averaged.model.state_dict()["lm_head.weight"], (nodes["node_0"]["lm_head.weight"] + nodes["node_1"]["lm_head.weight"]) / 2
    )
    # another layout is refused in one sentence, and continues with --reshard: the last checkpoint (a
    # sync) unsharded on 2 ranks, the same micro-batches two a step on each rank
    unsharded = ["--set", "comm.shard=none", "--set", "train.nproc=2", "--set", "train.steps=10"]
    last = str(first / "checkpoints" / "step_00000008")
    same_world = ["--set", "comm.shard=none", "--set", "train.steps=10"]  # 4 ranks unsharded: the layout is what differs
    refused(zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(tmp_path / "third"), "--resume", last, *knobs, *same_world), "sharded on 2 nodes x 2 ranks", "unsharded", alone=False)  # fmt: skip
    assert (first / "checkpoints" / "step_00000008" / "optimizer").is_dir()  # the state per parameter, each rank's shards
    resumed = zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(tmp_path / "third"), "--resume", last, "--reshard", *knobs, *unsharded)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in _metrics(tmp_path / "third")] == [9, 10]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, knobs, bits",
    [
        ("adam", (), [16.0] * 4),  # HSDP: the shard's all-reduce between nodes every step, in the recipe's bf16
        # an outer step at 3 (16 bits of the shard, bf16; the run's mean so far); the checkpoint at 2 is inside a period
        ("diloco", ("optimizer.sync_every=3",), [0.0, 0.0, 16 / 3, 4.0]),
    ],
)
def test_adam_and_diloco_sharded_resume_exactly(tmp_path, cache_dir, name, knobs, bits):
    knobs = _short(cache_dir, 4, f"optimizer.name={name}", *knobs, "train.checkpoint_every=2", "train.global_batch_size=64")  # 2 micro-batches: no_sync
    first = tmp_path / "first"
    done = zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(first), *knobs)
    assert done.returncode == 0, done.stderr[-3000:]
    records = _metrics(first)
    assert [r["bits_per_param"] for r in records] == bits
    second = tmp_path / "second"
    resumed = zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(second), "--resume", str(first / "checkpoints" / "step_00000002"), *knobs)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["loss"] for r in _metrics(second)] == [r["loss"] for r in records[2:]]
    if name == "adam":  # a checkpoint written before model/ (HSDP's is at a sync), its model gathered in model.pt, resumes and exports alike
        before = _as_written_before_model_shards(first, 2, tmp_path / "before")
        resumed = zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(tmp_path / "third"), "--resume", str(before), *knobs)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert [r["loss"] for r in _metrics(tmp_path / "third")] == [r["loss"] for r in records[2:]]
        old, new = load_language_model(before).model.state_dict(), load_language_model(first / "checkpoints" / "step_00000002").model.state_dict()
        assert all(torch.equal(old[k], new[k]) for k in new)


@pytest.mark.parametrize(
    "setting,fragment",
    [
        ("optimizer.name=powersgd", "takes adam, onebit_adam, zero_one_adam, diloco"),
        ("comm.topology=hierarchical", "comm.topology auto or flat"),
        ("train.precision=fp16", "not fp16"),
    ],
)
def test_what_sharding_does_not_combine_with_is_refused_in_one_sentence(capsys, setting, fragment):
    refused(zoa_here(capsys, "run", "recipes/gpt2_tiny.yaml", "--set", "comm.shard=node", "--set", setting), fragment)


# ---- resharding: the optimizer's state per parameter, into another layout -------------------------


def _reshard(rank, world_size, tmp):
    """0/1 Adam's state (every step a variance step: synchronised) sharded on 2 x 2, saved through
    torch.distributed.checkpoint and loaded into 0/1 Adam unsharded on the 4 ranks; and an unsharded
    state loaded into a fresh sharded optimizer from its flat buffers."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("node", "local"))
    torch.manual_seed(0)
    sharded = shard_model(Blocks(), mesh["local"])
    opt = ZeroOneAdam(sharded.parameters(), lr=0.01, var_freeze_step=100, var_update_scaler=1, process_group=mesh.get_group("node"))
    for t in range(3):
        x, y = _batch(rank, t)
        torch.nn.functional.mse_loss(sharded(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    saved = {k: v.full_tensor() for k, v in opt.parameter_state().items()}  # collectives of the node
    dcp.save({"optimizer": opt.parameter_state()}, checkpoint_id=tmp)
    torch.manual_seed(0)
    plain = Blocks()
    unsharded = ZeroOneAdam(plain.parameters(), lr=0.01, var_freeze_step=100, var_update_scaler=1)
    unsharded.load_resharded(opt.shared_state_dict(), lambda targets: dcp.load({"optimizer": targets}, checkpoint_id=tmp))
    into_unsharded = all(torch.equal(saved[k], v) for k, v in unsharded.parameter_state().items())
    again = ZeroOneAdam(
        shard_model(Blocks(), mesh["local"]).parameters(), lr=0.01, var_freeze_step=100, var_update_scaler=1, process_group=mesh.get_group("node")
    )
    again.load_resharded(unsharded.shared_state_dict())  # flat buffers of whole tensors, cut into this rank's shards
    into_sharded = all(torch.equal(saved[k], v.full_tensor()) for k, v in again.parameter_state().items())
    return len(saved), into_unsharded, into_sharded, again.schedule.step == opt.schedule.step, _model_shards(rank, sharded, plain, mesh, tmp)


def _model_shards(rank, sharded, plain, mesh, tmp):
    """The model's shards written as the trainer writes a checkpoint's model/ (RunDirectory.save, every rank
    its own), at a sync and, with node 1's parameters moved, inside a local-step period (each node's own);
    beside each, the whole model gathered as model.pt used to be (get_model_state_dict, full_state_dict),
    and the shards read into the unsharded model on the 4 ranks (what --reshard does)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from zoa_train.train.checkpointer import read_shards
    from zoa_train.train.rundir import RunDirectory, shards_key

    run, node = RunDirectory(f"{tmp}-run"), rank // 2
    gathered = []
    for step, synced in ((1, True), (2, False)):
        if not synced:
            with torch.no_grad():
                for p in sharded.parameters():
                    local_shard(p).add_(node)  # the nodes' models differ
        run.save(step, rank, 4, {}, {}, keep=5, synced=synced, sharded={"model": {shards_key(None if synced else node): sharded.state_dict()}})
        gathered.append(get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True)))
    read_shards({"model": plain.state_dict()}, run.checkpoints / "step_00000001" / "model")
    into_plain = all(torch.equal(v, gathered[0][k]) for k, v in plain.state_dict().items())
    return str(run.checkpoints), gathered, into_plain


@pytest.mark.slow
def test_a_sharded_state_reshards_into_unsharded_and_back(tmp_path):
    from zoa_train.evaluation.checkpoints import read_model_state

    ranks = run_ranks(_reshard, 4, str(tmp_path / "dcp"), sharded=True)
    for count, into_unsharded, into_sharded, same_schedule, (_, _, into_plain) in ranks:
        assert count == 9 and into_unsharded and into_sharded and same_schedule and into_plain  # m, v, anchor of 3 tensors
    # Read whole on one process (export, eval): what model.pt held when rank 0 gathered it, bit for bit; inside
    # a local-step period each node's own model (node 1: ranks 2 and 3) and their average.
    checkpoints, (at_sync, inside), _ = ranks[0][4]
    _, (_, inside_node_1), _ = ranks[2][4]
    state, averaged = read_model_state(Path(checkpoints) / "step_00000001" / "model")
    assert averaged == 1 and sorted(state) == sorted(at_sync) and all(torch.equal(state[k], at_sync[k]) for k in at_sync)
    nodes = read_whole(Path(checkpoints) / "step_00000002" / "model")
    assert all(torch.equal(nodes["node_0"][k], inside[k]) and torch.equal(nodes["node_1"][k], inside_node_1[k]) for k in inside)
    state, averaged = read_model_state(Path(checkpoints) / "step_00000002" / "model")
    assert averaged == 2 and all(torch.equal(state[k], (inside[k] + inside_node_1[k]) / 2) for k in inside)


@pytest.mark.slow  # a 2-rank ResNet run sharded, then eval imagenet of its checkpoint
def test_eval_imagenet_reads_a_sharded_image_run_s_model_directory(tmp_path, cache_dir):
    """A sharded run writes model/ (each rank's shards), not model.pt: eval imagenet reads it whole in one process."""
    import json

    from conftest import zoa

    from zoa_train.data.images import prepare_digits

    sets = ["train.steps=2", "train.log_every=1", "train.val_every=0", "train.val_batches=1", "logging.wandb=disabled", "logging.tensorboard=false"]
    sets += [f"data.cache_dir={cache_dir}", "data.workers=0", "comm.shard=node", "comm.ranks_per_node=2", "train.micro_batch_size=16"]
    done = zoa("run", "recipes/resnet18_tiny.yaml", "--nproc", "2", "--out", str(tmp_path / "run"), *[a for s in sets for a in ("--set", s)])
    assert done.returncode == 0, done.stderr[-3000:]
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000002"
    assert (checkpoint / "model").is_dir() and not (checkpoint / "model.pt").exists()
    data = prepare_digits(cache_dir) / "val"
    scored = zoa("eval", "imagenet", "--checkpoint", str(tmp_path / "run"), "--data", str(data), "--workers", "0", "--json", str(tmp_path / "eval.json"))
    assert scored.returncode == 0, scored.stderr[-3000:]
    result = json.loads((tmp_path / "eval.json").read_text())
    assert 0 <= result["top1"] <= 1 and result["checkpoint"].endswith("model"), result
