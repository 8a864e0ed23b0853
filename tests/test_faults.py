"""Faults met during a run: a NaN/inf loss, a stop signal, a killed rank (--max-restarts), a rank that stops answering."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import zoa

from zoa_train.train.rundir import read_marker

pytestmark = pytest.mark.slow  # every test trains 2-rank runs

ROOT = Path(__file__).resolve().parents[1]


def exploding(run_dir: Path, cache_dir: Path, *extra: str) -> list[str]:
    # Adam at lr 1e6 without clipping: step 1 is fine, the loss of step 2 is already infinite.
    sets = [
        "train.steps=12",
        "train.log_every=4",
        "train.val_every=0",
        "train.checkpoint_every=1",
        "optimizer.name=adam",
        "optimizer.lr=1e6",
        "train.grad_clip=0",
        "schedule.warmup_steps=0",
        "logging.wandb=disabled",
        "logging.tensorboard=false",
        f"data.cache_dir={cache_dir}",
        *extra,
    ]
    return ["run", "recipes/gpt2_tiny.yaml", "--out", str(run_dir), *[a for s in sets for a in ("--set", s)]]


def test_a_nonfinite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    done = zoa(*exploding(run_dir, cache_dir))
    assert done.returncode == 2, done.stderr[-3000:]
    assert "NaN or infinite at step 2" in done.stderr and "step_00000001" in done.stderr and "Traceback" not in done.stderr
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_00000001"]
    assert all(torch.isfinite(v).all() for v in torch.load(run_dir / "checkpoints" / "step_00000001" / "model.pt").values() if v.is_floating_point())
    assert not (run_dir / "metrics.jsonl").read_text().strip()  # nothing logged after the fault


def test_skip_nonfinite_skips_steps_on_every_rank_up_to_its_limit(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    done = zoa(*exploding(run_dir, cache_dir, "train.skip_nonfinite=3"))
    assert done.returncode == 2, done.stderr[-3000:]
    # Skipped steps leave the parameters alone, so the same fault recurs: three skips, then the stop.
    assert done.stderr.count("every rank skips the step") >= 3 and "NaN or infinite at step 2" in done.stderr
    state = torch.load(run_dir / "checkpoints" / "step_00000001" / "trainer.pt", weights_only=False)
    assert state["skipped_nonfinite"] == 0 and state["step"] == 1


def rank_pids(launcher: int) -> list[int]:
    """The rank processes `zoa-train run` started (multiprocessing spawn children of the launcher)."""
    found = subprocess.run(["pgrep", "-P", str(launcher), "-f", "spawn_main"], capture_output=True, text=True).stdout.split()
    return sorted(int(p) for p in found)


def thirty_steps(cache_dir: Path, *extra: str) -> list[str]:
    """0/1 Adam through variance updates, 1-bit steps and local-step periods of 3 steps."""
    sets = [
        "train.steps=30",
        "train.log_every=1",
        "train.val_every=0",
        "train.checkpoint_every=0",
        "train.val_batches=1",
        "optimizer.var_freeze_step=2",
        "optimizer.local_steps=fixed",
        "optimizer.local_step_interval=3",
        "logging.wandb=disabled",
        "logging.tensorboard=false",
        f"data.cache_dir={cache_dir}",
        *extra,
    ]
    return [a for s in sets for a in ("--set", s)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, cache_dir) -> dict:
    """The final parameters of thirty_steps run without a fault, on 2 ranks."""
    whole = tmp_path_factory.mktemp("whole") / "run"
    done = zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(whole), *thirty_steps(cache_dir))
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(whole / "checkpoints" / "step_00000030" / "model.pt")


def start_run(run_dir: Path, *args: str) -> subprocess.Popen:
    """`zoa-train run recipes/gpt2_tiny.yaml --out RUN_DIR ARGS` in the background, its output piped."""
    command = [sys.executable, "-m", "zoa_train.cli", "run", "recipes/gpt2_tiny.yaml", "--out", str(run_dir), *args]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_step(run: subprocess.Popen, metrics: Path, step: int) -> int:
    """Wait until rank 0 has logged `step` (log_every 1); returns the last step logged."""
    import json
    import time

    deadline = time.monotonic() + 300
    while True:
        lines = metrics.read_text().splitlines() if metrics.is_file() else []
        if lines and json.loads(lines[-1])["step"] >= step:
            return json.loads(lines[-1])["step"]
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()[1][-3000:]
        time.sleep(0.05)


def signal_the_ranks(run: subprocess.Popen) -> None:
    """What a scheduler's warning does: one rank gets it first (the store tells the other), then
    both again (the batch shell and the launcher may both forward it): harmless."""
    import os
    import signal
    import time

    ranks = rank_pids(run.pid)
    assert len(ranks) == 2
    os.kill(ranks[1], signal.SIGUSR2)
    time.sleep(0.05)
    for pid, again in ((ranks[1], signal.SIGTERM), (ranks[0], signal.SIGUSR2)):
        os.kill(pid, again)


def signal_the_launcher(run: subprocess.Popen) -> None:
    """`kill -USR2 PID` of what the user started, not of a rank: it passes the signal on."""
    import os
    import signal

    os.kill(run.pid, signal.SIGUSR2)


@pytest.mark.parametrize("send", [signal_the_ranks, signal_the_launcher], ids=["ranks", "launcher"])
def test_a_stop_signal_checkpoints_every_rank_and_resume_continues_exactly(tmp_path, cache_dir, uninterrupted, send):
    import os

    args = thirty_steps(cache_dir)
    stopped = tmp_path / "stopped"
    run = start_run(stopped, *args)
    wait_for_step(run, stopped / "metrics.jsonl", 3)
    ranks = rank_pids(run.pid)
    send(run)
    _, stderr = run.communicate(timeout=300)
    assert run.returncode == 75, stderr[-3000:]
    (checkpoint,) = (stopped / "checkpoints").iterdir()
    step = int(checkpoint.name.removeprefix("step_"))
    assert 3 <= step < 30
    said = f"stopped at step {step}" if send is signal_the_ranks else f"stopped on SIGUSR2; the latest complete checkpoint is {checkpoint}"
    assert said in stderr and "--resume auto" in stderr and "Traceback" not in stderr, stderr[-3000:]
    for pid in ranks:  # none left running
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)

    resumed = zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(stopped), "--resume", "auto", *args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    b = torch.load(stopped / "checkpoints" / "step_00000030" / "model.pt")
    assert all(torch.equal(uninterrupted[k], b[k]) for k in uninterrupted)


def test_a_killed_rank_restarts_every_rank_from_the_last_checkpoint_and_ends_on_the_same_parameters(tmp_path, cache_dir, uninterrupted):
    import json
    import os
    import re
    import signal

    # Checkpoints every 4 steps (some inside a local-step period); --overwrite on the first attempt
    # must not empty the directory on the restart.
    run_dir = tmp_path / "run"
    run = start_run(run_dir, "--overwrite", "--max-restarts", "1", *thirty_steps(cache_dir, "train.checkpoint_every=4"))
    killed_at = wait_for_step(run, run_dir / "metrics.jsonl", 10)
    ranks = rank_pids(run.pid)
    assert len(ranks) == 2
    os.kill(ranks[1], signal.SIGKILL)
    _, stderr = run.communicate(timeout=300)
    assert run.returncode == 0, stderr[-3000:]
    resumed = re.search(r"restart 1 after a rank failed: every rank resumed from \S+step_(\d+) \(step (\d+)\)", stderr)
    assert resumed, stderr[-3000:]
    step = int(resumed.group(2))
    # The latest complete checkpoint when it died (step 12's may have been in the making when step 12 was logged).
    assert 4 * ((killed_at - 1) // 4) <= step <= killed_at + 4
    print(f"killed at step {killed_at} (rank 0's last log), resumed from step {step}: {killed_at - step} steps of work lost")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 31))  # the restart's rows replace those past the checkpoint
    # and one record says what the failure cost
    assert [{k: r[k] for k in ("step", "world_size", "world_size_before", "restarts")} for r in records if "world_size" in r] == [
        {"step": step, "world_size": 2, "world_size_before": 2, "restarts": 1}
    ]
    final = torch.load(run_dir / "checkpoints" / "step_00000030" / "model.pt")
    assert all(torch.equal(uninterrupted[k], final[k]) for k in uninterrupted)


def test_a_rank_that_stops_answering_is_reported_within_the_timeout(tmp_path, cache_dir):
    import os
    import signal
    import time

    sets = [
        "train.steps=400",
        "train.log_every=1",
        "train.val_every=0",
        "train.checkpoint_every=0",
        "train.timeout_s=10",
        "logging.wandb=disabled",
        "logging.tensorboard=false",
        f"data.cache_dir={cache_dir}",
    ]
    run_dir = tmp_path / "run"
    run = subprocess.Popen(
        [sys.executable, "-m", "zoa_train.cli", "run", "recipes/gpt2_tiny.yaml", "--out", str(run_dir), *[a for s in sets for a in ("--set", s)]],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()[1][-3000:]
        time.sleep(0.2)
    ranks = rank_pids(run.pid)
    os.kill(ranks[1], signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        _, stderr = run.communicate(timeout=240)
    finally:
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert run.returncode == 1, stderr[-3000:]
    assert "train.timeout_s = 10 s" in stderr and "stopped answering" in stderr and "operation to complete" in stderr, stderr[-3000:]
    assert time.monotonic() - stopped_at < 120


def test_reshard_continues_a_synchronised_checkpoint_on_the_same_samples_at_any_world_size_and_refuses_a_local_step_one(tmp_path, cache_dir):
    import json

    from zoa_train.data.lm import SampleOrder

    # Global batches of 24 in micro-batches of 4: 3 a step on each of 2 ranks, 6 on 1 rank, 2 on each of 3.
    args = thirty_steps(
        cache_dir, "train.steps=10", "train.checkpoint_every=1", "train.keep_checkpoints=20", "train.global_batch_size=24", "train.micro_batch_size=4"
    )
    whole = tmp_path / "whole"
    first = zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(whole), *args)
    assert first.returncode == 0, first.stderr[-3000:]

    def checkpoint(run_dir: Path, step: int) -> Path:
        return run_dir / "checkpoints" / f"step_{step:08d}"

    synced = [step for step in range(3, 10) if read_marker(checkpoint(whole, step))["synced"]]
    inside = [step for step in range(3, 10) if not read_marker(checkpoint(whole, step))["synced"]]
    assert synced and inside, "0/1 Adam's local-step periods should leave synchronised and local checkpoints in steps 3-9"
    local, start = checkpoint(whole, inside[0]), synced[0]
    assert "model" in torch.load(local / "rank_00001.pt", weights_only=False)  # the ranks' parameters differ there

    refused = zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(whole), *args, "--resume", "auto", "--nproc", "1")
    assert refused.returncode == 2 and "pass --reshard" in refused.stderr, refused.stderr[-3000:]
    in_period = zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(whole), *args, "--resume", str(local), "--reshard", "--nproc", "1")
    assert in_period.returncode == 2 and "it was taken inside a 0/1 Adam local-step period" in in_period.stderr, in_period.stderr[-3000:]
    assert "Traceback" not in refused.stderr + in_period.stderr

    def positions(run_dir: Path, step: int) -> list[dict]:
        world = read_marker(checkpoint(run_dir, step))["world_size"]
        return [torch.load(checkpoint(run_dir, step) / f"rank_{rank:05d}.pt", weights_only=False)["loader"] for rank in range(world)]

    def consumed(position: dict, world: int) -> list[int]:
        """The blocks of the global batch after `position`, as the ranks of a run of `world` ranks (micro-batches of 4) take them:
        recomputed from the loader's own order, rank after rank."""
        taken = []
        for rank in range(world):
            order = SampleOrder(position["num_blocks"], 4, rank, world, position["seed"], 24)
            order.load_state_dict(position)
            taken += order.rows()[: order.accumulation].reshape(-1).tolist()
        return taken

    def losses(run_dir: Path) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}

    for world in (1, 3):
        out = tmp_path / f"on{world}"
        done = zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(out), *args, "--resume", str(checkpoint(whole, start)), "--reshard", "--nproc", str(world))
        assert done.returncode == 0, done.stderr[-3000:]
        assert "resharding" in done.stderr and f"from 2 to {world} ranks" in done.stderr
        assert read_marker(checkpoint(out, 10))["world_size"] == world
        for step in range(start + 1, 11):
            before = positions(whole, step - 1)[0] if step == start + 1 else positions(out, step - 1)[0]
            # every rank is at the uninterrupted run's place in the data after each step...
            assert all(p == positions(whole, step)[0] | {"world_size": world, "micro_batch_size": 4} for p in positions(out, step)), step
            # ...having taken, all ranks together, the uninterrupted run's global batch of that step
            assert consumed(before, world) == consumed(positions(whole, step - 1)[0], 2), step
        # The parameters of the synchronised checkpoint are the same on every rank: the first step's loss, the mean over
        # its global batch, is the uninterrupted run's only if the ranks took the same samples.
        assert losses(out)[start + 1] == pytest.approx(losses(whole)[start + 1], rel=1e-5)
        assert sorted(losses(out)) == list(range(start + 1, 11)) and all(np.isfinite(v) for v in losses(out).values())
