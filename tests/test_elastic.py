"""Elastic membership (train.elastic reshard): a node lost under torchrun's elastic agent, and the run
goes on at the new world size on its own (docs/faults.md, "Elastic: a node leaves, the run goes on")."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import refused, zoa, zoa_here
from distributed_harness import free_port
from test_faults import signal_the_ranks, start_run, thirty_steps, wait_for_step

from zoa_train.train.rundir import complete_checkpoints, read_marker

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from node_churn import AGENT_ENV, agent_command, kill_node  # noqa: E402  (the torchrun agents the script starts)

STEPS = 48


def sets(cache_dir: Path) -> list[str]:
    """0/1 Adam with local-step periods of 3 steps after its variance freezes at step 12, and a checkpoint falling due
    every 4; global batches of 24
    in micro-batches of 4: 2 a step on each of 3 ranks, 3 on each of 2."""
    pairs = [
        f"train.steps={STEPS}",
        "train.log_every=1",
        "train.val_every=0",
        "train.val_batches=2",
        "train.checkpoint_every=4",
        "train.keep_checkpoints=50",
        "train.global_batch_size=24",
        "train.micro_batch_size=4",
        "train.elastic=reshard",
        "train.timeout_s=60",
        "optimizer.var_freeze_step=12",
        "optimizer.lr=0.001",
        "optimizer.local_steps=fixed",
        "optimizer.local_step_interval=3",
        "logging.wandb=disabled",
        "logging.tensorboard=false",
        f"data.cache_dir={cache_dir}",
    ]
    return [a for s in pairs for a in ("--set", s)]


def agent(nproc: int, hosts_store: bool, port: int, run_dir: Path, cache_dir: Path) -> list[str]:
    """One node's torchrun, as scripts/node_churn.py starts it; --resume auto at the first start too (at step 0):
    torchrun starts the ranks again with this command line whenever a node joins."""
    return agent_command(nproc, hosts_store, port, 1, ["recipes/gpt2_tiny.yaml", "--out", str(run_dir), "--resume", "auto", *sets(cache_dir)])


@pytest.mark.parametrize(
    "given, says",
    [
        (["--overwrite"], "and --overwrite would empty the run directory each time; pass --resume auto instead"),
        (["--resume", "auto"], "needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the agents' environment"),
    ],
)
def test_an_elastic_run_under_torchrun_refuses_a_launch_that_would_lose_its_directory_or_its_ranks(tmp_path, capsys, monkeypatch, given, says):
    # a rank as torchrun's agents start it, with their shared store (their default)
    env = {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "job-7", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    run_dir = tmp_path / "run"
    done = zoa_here(capsys, "run", "recipes/gpt2_tiny.yaml", "--out", str(run_dir), "--set", "train.elastic=reshard", *given)
    refused(done, says)
    assert not run_dir.exists()


@pytest.mark.slow  # three ranks in two torchrun agents, and a reference run
def test_a_node_lost_under_torchrun_continues_on_the_survivors_from_a_synchronised_checkpoint_on_the_planned_samples(tmp_path, cache_dir):
    reference = tmp_path / "reference"
    whole = zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(reference), "--nproc", "3", *sets(cache_dir))
    assert whole.returncode == 0, whole.stderr[-3000:]

    run_dir, port = tmp_path / "run", free_port()
    env = {**os.environ, **AGENT_ENV}
    first = subprocess.Popen(agent(2, True, port, run_dir, cache_dir), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    second = subprocess.Popen(agent(1, False, port, run_dir, cache_dir), cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        killed_at = wait_for_step(first, run_dir / "metrics.jsonl", 20)
        assert len(kill_node(second)) == 2  # the node is lost: its agent and its one rank at once
        _, stderr = first.communicate(timeout=300)
    finally:
        for process in (first, second):
            if process.poll() is None:
                process.kill()
    assert first.returncode == 0, stderr[-3000:]

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    changes = [r for r in records if "world_size" in r]  # the membership records
    assert len(changes) == 1, changes
    restart = changes[0]
    assert restart["restarts"] == 1 and restart["world_size_before"] == 3 and restart["world_size"] == 2, restart
    # resumed from a checkpoint before the kill, and the steps after it trained again (and logged once)
    assert restart["step"] <= killed_at + 4 and restart["steps_redone"] >= 0 and restart["seconds_down"] > 0, restart
    assert "from 3 to 2 ranks" in stderr, stderr[-3000:]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, STEPS + 1))
    assert all(len(r["mem_peak_bytes_by_rank"]) == (3 if r["step"] <= restart["step"] else 2) for r in records if "loss" in r)

    # every periodic checkpoint was taken at a synchronised step (only those reshard): the first sync at or after each multiple of 4
    checkpoints = complete_checkpoints(run_dir / "checkpoints")
    assert checkpoints and all(read_marker(c)["synced"] == 1 for c in checkpoints)
    assert read_marker(checkpoints[-1])["step"] == STEPS and read_marker(checkpoints[-1])["world_size"] == 2

    def positions(run: Path) -> list[dict]:
        final = run / "checkpoints" / f"step_{STEPS:08d}"
        return [torch.load(final / f"rank_{r:05d}.pt", weights_only=False)["loader"] for r in range(read_marker(final)["world_size"])]

    # the same samples in total as the uninterrupted run: the order and the global batch do not depend on the world size
    expected = positions(reference)[0] | {"world_size": 2}
    assert all(p == expected for p in positions(run_dir))
    lost = [r for r in records if "val_loss" in r][-1]["val_loss"]
    uninterrupted = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()][-1]["val_loss"]
    print(f"killed at step {killed_at}; resumed on 2 ranks from step {restart['step']}: {restart}")
    print(f"final validation loss {lost:.4f} against {uninterrupted:.4f} uninterrupted on 3 ranks ({(lost / uninterrupted - 1) * 100:+.2f}%)")
    assert abs(lost / uninterrupted - 1) < 0.05


@pytest.mark.slow  # two runs of 2 ranks and 1
def test_an_elastic_run_s_stop_checkpoint_is_synchronised_and_continues_at_another_world_size(tmp_path, cache_dir):
    # Local-step periods of 16 after the freeze at step 2: a stop near step 3 falls inside one, where the ranks'
    # parameters differ. torchrun stops the ranks so when a node joins; the checkpoint must then reshard.
    args = thirty_steps(cache_dir, "optimizer.local_step_interval=16", "train.elastic=reshard", "train.global_batch_size=32", "train.micro_batch_size=8")
    run_dir = tmp_path / "run"
    run = start_run(run_dir, *args)
    wait_for_step(run, run_dir / "metrics.jsonl", 3)
    signal_the_ranks(run)
    _, stderr = run.communicate(timeout=300)
    assert run.returncode == 75, stderr[-3000:]
    (checkpoint,) = (run_dir / "checkpoints").iterdir()
    step = read_marker(checkpoint)["step"]
    kinds = {r["step"]: r["step_kinds"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    assert kinds[step] == "l" and read_marker(checkpoint)["synced"] == 1  # stopped after a local step, and synchronised for it
    resumed = zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(run_dir), "--resume", "auto", "--nproc", "1", *args)
    assert resumed.returncode == 0 and f"resharding {checkpoint} from 2 to 1 ranks" in resumed.stderr, resumed.stderr[-3000:]
    assert read_marker(run_dir / "checkpoints" / "step_00000030")["world_size"] == 1
