"""`zoa-train run` end to end: real processes, real recipes, real files (2 Gloo ranks on CPU)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from catalogue import check_documented
from conftest import TORCHRUN, refused, zoa

from zoa_train.optim import registry

ROOT = Path(__file__).resolve().parents[1]
METRIC_FIELDS = {"step", "loss", "lr", "tokens_per_s", "bits_per_param", "rounds", "bytes_sent", "variance_updates", "wall_time"}


def short(cache_dir: Path, steps: int, *extra: str) -> list[str]:
    sets = [
        f"train.steps={steps}",
        "train.log_every=1",
        "train.val_batches=1",
        "train.val_every=0",
        "logging.wandb=disabled",
        f"data.cache_dir={cache_dir}",
        *extra,
    ]
    return [arg for s in sets for arg in ("--set", s)]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_gpt2_tiny_runs_end_to_end_and_resumes_exactly(tmp_path, cache_dir):
    # 0/1 Adam with local steps from step 2 on, so the checkpoint at step 4 lies inside a local period.
    # Dropout on: each rank draws its own masks, from RNG states the checkpoint carries.
    knobs = short(
        cache_dir,
        8,
        "train.checkpoint_every=4",
        "optimizer.var_freeze_step=2",
        "optimizer.local_steps=fixed",
        "optimizer.local_step_interval=3",
        "model.dropout=0.1",
    )
    first = tmp_path / "first"
    done = zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(first), *knobs)
    assert done.returncode == 0, done.stderr[-3000:]
    records = metrics(first)
    assert [r["step"] for r in records] == list(range(1, 9))
    assert all(METRIC_FIELDS <= set(r) for r in records)
    assert "val_loss" in records[-1]
    assert records[-1]["rounds"] < 8  # local steps happened
    assert yaml.safe_load((first / "recipe.yaml").read_text())["train"]["steps"] == 8
    assert sorted(p.name for p in (first / "checkpoints").iterdir()) == ["step_00000004", "step_00000008"]
    assert (first / "tensorboard").is_dir() and (first / "tokenizer" / "tokenizer.json").is_file()
    # The end says what happened and what to run next, in words (no Python dict)
    said = done.stdout[done.stdout.index("done: 8 steps in ") :]
    best = min(r["val_loss"] for r in records if "val_loss" in r)
    assert f"validation loss {records[-1]['val_loss']:.4f} (best {best:.4f} at step" in said and f"in {records[-1]['rounds']} rounds" in said
    assert f"checkpoint {first / 'checkpoints' / 'step_00000008'}" in said and f"zoa-train eval wikitext --checkpoint {first} --data FILE" in said
    assert f"zoa-train export {first} OUT_DIR" in said and "{'step'" not in done.stdout

    second = tmp_path / "second"
    resumed = zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(second), "--resume", str(first / "checkpoints" / "step_00000004"), *knobs, "--json")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])  # --json: the same summary as one record
    assert summary["steps"] == 8 and summary["checkpoint"] == str(second / "checkpoints" / "step_00000008") and summary["val_loss"] is not None
    again = metrics(second)
    assert [r["step"] for r in again] == [5, 6, 7, 8]
    assert [r["loss"] for r in again] == [r["loss"] for r in records[4:]]
    assert again[-1]["rounds"] == records[-1]["rounds"] and again[-1]["bits_per_param"] == records[-1]["bits_per_param"]
    a = torch.load(first / "checkpoints" / "step_00000008" / "model.pt")
    b = torch.load(second / "checkpoints" / "step_00000008" / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # At a synced step a rank file holds only what is the rank's own (the 1-bit error buffers: 1 + 1/n
    # model sizes), not m, v and the anchor, which rank 0 saves once in optimizer.pt.
    final = second / "checkpoints" / "step_00000008"
    model_bytes = (final / "model.pt").stat().st_size
    assert (final / "rank_00001.pt").stat().st_size < 1.7 * model_bytes
    assert (final / "optimizer.pt").stat().st_size > 2.9 * model_bytes

    # --resume auto continues the latest checkpoint of the run directory: here, nothing is left to do.
    auto = zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(first), "--resume", "auto", *knobs)
    assert auto.returncode == 0, auto.stderr[-3000:]

    # Another optimizer cannot take over this state: one sentence, exit 2.
    other = zoa(
        "run",
        "recipes/gpt2_tiny.yaml",
        "--out",
        str(tmp_path / "third"),
        "--resume",
        str(first / "checkpoints" / "step_00000004"),
        *knobs,
        "--set",
        "optimizer.name=onebit_adam",
    )
    refused(other, "cannot resume from", alone=False)  # the ranks had started


@pytest.mark.slow
def test_two_emulated_nodes_of_two_ranks_sync_node_aware_and_reshard_to_flat(tmp_path, cache_dir):
    # 4 ranks as 2 nodes x 2 (comm.ranks_per_node: one machine, one hostname). Exact resume under the
    # node-aware sync is tests/test_optim.py's (2 x 2, inside a local-step period); here the trainer's
    # part: the sync it reports and logs, and a checkpoint continued under another topology.
    # comm.overlap under the recipe's gradient clipping by the global rule: bucketed, rounds in step(), and said so.
    overlap = ("comm.overlap=true", "train.grad_clip_rule=global")
    knobs = short(cache_dir, 4, "train.micro_batch_size=8", "optimizer.var_freeze_step=2", "comm.ranks_per_node=2", *overlap)
    first = tmp_path / "first"
    done = zoa("run", "recipes/gpt2_tiny.yaml", "--nproc", "4", "--out", str(first), *knobs)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "hierarchical 1-bit sync, 2 nodes x 2 ranks, buckets of 100 MB overlapped with backward" in done.stdout
    assert "train.grad_clip changes the gradients after backward, so its rounds start in step()" in done.stderr
    records = metrics(first)
    assert records[-1]["intra_bytes_sent"] > 0 and 0 < records[-1]["bits_per_param"]

    # Another topology cannot take over the error buffers: with --reshard the run continues with them
    # at zero (without it, one sentence: TopologyChanged, tests/test_hierarchical.py).
    end = str(first / "checkpoints" / "step_00000004")
    flat = [*knobs, "--set", "comm.topology=flat", "--set", "train.steps=5"]
    resharded = zoa("run", "recipes/gpt2_tiny.yaml", "--nproc", "4", "--out", str(tmp_path / "resharded"), "--resume", end, "--reshard", *flat)
    assert resharded.returncode == 0, resharded.stderr[-3000:]
    assert "another 1-bit sync layout" in resharded.stderr and [r["step"] for r in metrics(tmp_path / "resharded")] == [5]
    assert "hierarchical" not in resharded.stdout and metrics(tmp_path / "resharded")[-1]["intra_bytes_sent"] == records[-1]["intra_bytes_sent"]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adam", "onebit_adam"])
def test_bert_tiny_runs_with_the_baselines(tmp_path, cache_dir, optimizer):
    # Also exercises gradient accumulation (2 micro-batches per step), bf16 autocast and, with adam,
    # the next-sentence head on sentence pairs; with 1-bit Adam, rounds started during backward in
    # small buckets (the recipe's clipping then by bucket: grad_clip_rule auto), the first micro-batch
    # under the optimizer's no_sync().
    run_dir = tmp_path / optimizer
    extra = (
        f"optimizer.name={optimizer}",
        "optimizer.freeze_step=2",
        "train.micro_batch_size=8",
        "train.precision=bf16",
        f"model.next_sentence={str(optimizer == 'adam').lower()}",
        *(("comm.overlap=true", "comm.bucket_cap_mb=0.25") if optimizer == "onebit_adam" else ()),
    )
    done = zoa("run", "recipes/bert_tiny.yaml", "--out", str(run_dir), *short(cache_dir, 4, *extra))
    assert done.returncode == 0, done.stderr[-3000:]
    records = metrics(run_dir)
    assert len(records) == 4 and all(METRIC_FIELDS <= set(r) for r in records)
    expected_bits = 16.0 if optimizer == "adam" else (2 * 16 + 2 * 1) / 4
    assert records[-1]["bits_per_param"] == pytest.approx(expected_bits)
    assert records[-1]["rounds"] == 4
    if optimizer == "onebit_adam":  # clipped by bucket, the rounds still started during backward
        assert "gradients clipped bucket by bucket as backward finishes them (train.grad_clip_rule auto)" in done.stdout, done.stdout
        assert "changes the gradients after backward" not in done.stderr


@pytest.mark.slow
def test_runs_under_real_torchrun(tmp_path, cache_dir):
    run_dir = tmp_path / "torchrun"
    done = zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(run_dir), *short(cache_dir, 3), command=TORCHRUN)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3]
    assert (run_dir / "checkpoints" / "step_00000003" / "rank_00001.pt").is_file()
    # Piped output (a Slurm log, CI): one whole progress line per log step from rank 0, no bar, no
    # warnings that are not the user's business.
    progress = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in progress] == ["1/3", "2/3", "3/3"], done.stdout
    assert all(len(line) > 80 and " bits/param " in line and " elapsed " in line and " ETA " in line for line in progress)
    assert "loss_type" not in done.stderr, done.stderr


def write_recipe(tmp_path: Path, edit) -> Path:
    recipe = yaml.safe_load((ROOT / "recipes" / "gpt2_tiny.yaml").read_text())
    edit(recipe)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


BAD_RECIPES = {
    "unknown key": (lambda r: r["optimizer"].update(lrr=1.0), "unknown key optimizer.lrr; did you mean optimizer.lr?"),
    "wrong type": (lambda r: r["train"].update(steps="many"), "train.steps must be int"),
    "impossible value": (lambda r: r["optimizer"].update(lr=-1.0), "optimizer.lr must be positive"),
    "batch layout": (lambda r: r["train"].update(global_batch_size=30), "not divisible by micro_batch_size x world size"),
    "missing file": (lambda r: r["data"].update(source="files", train_files=["/nonexistent/corpus.txt"]), "data file /nonexistent/corpus.txt does not exist"),
    "bad choice": (lambda r: r["optimizer"].update(name="sgd"), f"optimizer.name must be one of {', '.join(registry.names())}"),
    "emulated nodes that do not divide": (
        lambda r: r.setdefault("comm", {}).update(ranks_per_node=3),
        "comm.ranks_per_node 3 does not divide the 2 ranks into whole nodes",
    ),
    "nccl without GPUs": (lambda r: r["train"].update(backend="nccl"), f"2 ranks need 2 GPUs and this machine has {torch.cuda.device_count()}"),
    "clip by bucket under DDP": (
        lambda r: (r["train"].update(grad_clip_rule="bucket"), r["optimizer"].update(name="adam")),
        "adam reduces its gradients with DDP or FSDP2, so set train.grad_clip_rule global",
    ),
    "live under DDP": (
        lambda r: (r["train"].update(elastic="live"), r["optimizer"].update(name="adam")),
        "train.elastic live: optimizer.name adam reduces its gradients with DDP",
    ),
    "live with overlap": (
        lambda r: (r["train"].update(elastic="live"), r.setdefault("comm", {}).update(overlap=True)),
        "train.elastic live: comm.overlap starts rounds during backward",
    ),
    "live sharded": (
        lambda r: (r["train"].update(elastic="live"), r.setdefault("comm", {}).update(shard="node", ranks_per_node=2)),
        "train.elastic live: comm.shard node shards the model over a node's ranks",
    ),
    "live node-aware": (
        lambda r: (r["train"].update(elastic="live"), r.setdefault("comm", {}).update(topology="hierarchical")),
        "train.elastic live: comm.topology hierarchical needs the same number of ranks on every node",
    ),
    "live on emulated nodes": (
        lambda r: (r["train"].update(elastic="live"), r.setdefault("comm", {}).update(ranks_per_node=1)),
        "train.elastic live: comm.ranks_per_node 1 emulates nodes of a fixed size",
    ),
    "live delayed": (
        lambda r: (r["train"].update(elastic="live"), r["optimizer"].update(sync_delay=1)),
        "train.elastic live: optimizer.sync_delay lets a round run behind the next step",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_RECIPES))
def test_bad_recipes_exit_2_with_one_sentence(tmp_path, case):
    if case == "nccl without GPUs" and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the 2 GPUs that 2 NCCL ranks need: nothing to refuse")
    edit, message = BAD_RECIPES[case]
    done = zoa("run", str(write_recipe(tmp_path, edit)), "--out", str(tmp_path / "run"))
    refused(done, message, alone=False, end="?" if message.endswith("?") else ".")
    check_documented("BAD_RECIPES", case, done.stderr)
    assert len(done.stderr.strip().splitlines()) <= 2  # the sentence and at most one line before it
    assert not (tmp_path / "run").exists()


def test_run_directory_is_protected_and_world_size_is_checked(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("keep me")
    done = zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(run_dir))
    refused(done, "is not empty")
    assert (run_dir / "notes.txt").read_text() == "keep me"

    checkpoint = run_dir / "checkpoints" / "step_00000004"
    checkpoint.mkdir(parents=True)
    (checkpoint / "COMPLETE").write_text("step 4\nworld_size 4\n")
    done = zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(run_dir), "--resume", "auto")
    refused(done, "written by 4 ranks and this run has 2")
    shutil.rmtree(run_dir)


def test_missing_recipe_and_bad_override(tmp_path):
    done = zoa("run", str(tmp_path / "nope.yaml"))
    refused(done, "does not exist")
    refused(zoa("plan", "recipes/gpt2_tiny.yaml", "--set", "noequals"), "section.key=value")


def test_plan_on_nodes_of_several_gpus_predicts_step_times_and_refuses_bad_shapes(monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # the table's headers unwrapped
    args = ("plan", "recipes/bert_large.yaml", "--nodes", "16", "--gpus-per-node", "8", "--bandwidth", "25Gbit", "--step-time", "200ms")
    done = zoa(*args, "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    flat, node_aware = result["zero_one_adam"], result["zero_one_adam"]["hierarchical"]
    assert node_aware["inter_bytes_per_node"] < flat["inter_bytes_per_node"] and node_aware["bits_per_param"] == flat["bits_per_param"]
    assert node_aware["speedup_vs_adam"] > flat["speedup_vs_adam"] > 1 and result["adam"]["speedup_vs_adam"] == 1
    table = zoa(*args)
    assert table.returncode == 0 and "node-aware" in table.stdout and "speed-up vs 1-bit" in table.stdout
    for bad, words in (
        (("--nodes", "2", "--world-size", "8"), "not both"),
        (("--world-size", "12", "--gpus-per-node", "8"), "does not divide"),
        (("--backend", "mpi"), "nccl or gloo"),
        (("--step-time", "fast"), "not understood"),
    ):
        refused(zoa("plan", "recipes/gpt2_tiny.yaml", *bad), words)


def test_plan_reads_the_bert_large_recipe():
    done = zoa("plan", "recipes/bert_large.yaml", "--world-size", "128", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert 0.47 < result["zero_one_adam"]["bits_per_param"] < 0.53
    assert 74_000 <= result["zero_one_adam"]["rounds"] <= 75_000
    assert 3.24 < result["onebit_adam"]["bits_per_param"] < 3.28
    assert result["adam"]["bits_per_param"] == 16
