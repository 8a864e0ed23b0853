"""`zoa-train slurm`: the sbatch script for each launcher, bad input, and jobs on a real one-node Slurm
cluster (tests/slurm_cluster.py): a job completes with each launcher, and a job warned before its time
limit checkpoints, requeues itself and finishes with the parameters of an uninterrupted run."""

import json
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import torch
from conftest import refused, zoa, zoa_here
from slurm_cluster import SlurmCluster, unavailable

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "gpt2_tiny.yaml")


def short(steps: int, cache_dir: Path, checkpoint_every: int) -> list[str]:
    sets = [
        f"train.steps={steps}",
        "train.log_every=10",
        "train.val_every=0",
        f"train.checkpoint_every={checkpoint_every}",
        "logging.wandb=disabled",
        "logging.tensorboard=false",
        f"data.cache_dir={cache_dir}",
    ]
    return [a for s in sets for a in ("--set", s)]


def dry_run(run_dir: Path, *args: str) -> str:
    """The script `zoa-train slurm --dry-run` prints: valid bash, and nothing written."""
    done = zoa("slurm", RECIPE, "--out", str(run_dir), "--dry-run", *args)
    assert done.returncode == 0, done.stderr
    syntax = subprocess.run(["bash", "-n"], input=done.stdout, capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    assert not run_dir.exists()
    return done.stdout


def test_script_for_the_torchrun_launcher(tmp_path):
    script = dry_run(
        tmp_path / "run",
        "--nodes",
        "2",
        "--gpus-per-node",
        "4",
        "--set",
        "train.micro_batch_size=4",
        "--time",
        "12:00:00",
        "--partition",
        "gpu",
        "--env",
        "NCCL_SOCKET_IFNAME=eth0",
    )
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --time=12:00:00",
        "#SBATCH --partition=gpu",
        "#SBATCH --signal=B:USR2@120",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        "export NCCL_SOCKET_IFNAME=eth0",
        "trap on_warning USR2",
        'scontrol requeue "$SLURM_JOB_ID"',
        "MAX_REQUEUES=3",
    ):
        assert line in script.splitlines() or line in script, line
    assert '--nnodes="$SLURM_NNODES" --nproc-per-node=4' in script
    assert '--rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID"' in script
    assert "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2 --shutdown-timeout=120" in script
    assert f"run {tmp_path / 'run' / 'slurm' / 'recipe.yaml'} --out {tmp_path / 'run'} --resume auto" in script


def test_script_for_the_srun_launcher_on_cpus(tmp_path):
    script = dry_run(
        tmp_path / "run",
        "--nproc-per-node",
        "2",
        "--launcher",
        "srun",
        "--signal",
        "USR1@300",
        "--max-requeues",
        "5",
        "--master-port",
        "29555",
        "--sbatch-option",
        "--mem=8G",
    )
    for line in (
        "#SBATCH --ntasks-per-node=2",
        "#SBATCH --signal=B:USR1@300",
        "#SBATCH --mem=8G",
        "export MASTER_PORT=29555",
        "MAX_REQUEUES=5",
        "trap on_warning USR1",
    ):
        assert line in script.splitlines(), line
    assert "gpus-per-node" not in script and "torch.distributed.run" not in script
    assert f"srun --ntasks-per-node=2 --kill-on-bad-exit=1 \\\n    {sys.executable} -m zoa_train.cli run" in script


def test_script_for_the_live_launcher(tmp_path):
    live = ["train.elastic=live", "train.micro_batch_size=4", "train.global_batch_size=48"]
    script = dry_run(tmp_path / "run", "--nodes", "3", "--nproc-per-node", "2", "--launcher", "live", *(a for s in live for a in ("--set", s)))
    for line in ("#SBATCH --nodes=3", "#SBATCH --ntasks-per-node=1", "#SBATCH --cpus-per-task=2", "#SBATCH --no-kill"):
        assert line in script.splitlines(), line
    assert "srun --ntasks-per-node=1 --no-kill --kill-on-bad-exit=0 \\\n" in script
    assert f"--out {tmp_path / 'run'} --resume auto --nproc 2 --max-restarts 3 &" in script


def test_script_for_an_elastic_torchrun_job_that_goes_on_with_the_nodes_it_has(tmp_path):
    script = dry_run(tmp_path / "run", "--nodes", "4", "--nproc-per-node", "1", "--set", "train.elastic=reshard", "--set", "train.global_batch_size=64")
    assert "#SBATCH --no-kill" in script.splitlines() and "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in script.splitlines()
    assert f"srun --ntasks-per-node=1 --no-kill --kill-on-bad-exit=0 {sys.executable} -m torch.distributed.run" in script
    assert '--nnodes=1:"$SLURM_NNODES" --nproc-per-node=1 --max-restarts=3' in script
    assert "--rdzv-conf=last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=5" in script
    # without train.elastic a lost node ends the job (it requeues from the latest checkpoint)
    script = dry_run(tmp_path / "run", "--nodes", "4", "--nproc-per-node", "1", "--set", "train.global_batch_size=64")
    assert "--no-kill" not in script and '--nnodes="$SLURM_NNODES" --nproc-per-node=1 \\\n' in script


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--nodes", "1"], "--gpus-per-node G for a GPU job, or --nproc-per-node K"),
        (["--nodes", "0", "--gpus-per-node", "8"], "--nodes must be at least 1"),
        (["--gpus-per-node", "4", "--nproc-per-node", "8"], "more ranks than the 4 GPUs per node"),
        (["--nproc-per-node", "2", "--launcher", "mpirun"], "--launcher must be torchrun, srun or live"),
        (["--nproc-per-node", "2", "--launcher", "live"], "--launcher live starts a train.elastic live run and"),
        (["--nproc-per-node", "2", "--set", "train.elastic=live"], "sets train.elastic live, whose ranks each node's zoa-train run starts itself"),
        (["--gpus-per-node", "8", "--launcher", "live", "--set", "train.elastic=live"], "--launcher live runs CPU ranks over Gloo for now"),
        (["--nproc-per-node", "2", "--launcher", "srun", "--max-restarts", "2"], "--max-restarts starts failed ranks again inside the job"),
        (["--nproc-per-node", "2", "--time", "ten hours"], "is not a Slurm time limit"),
        (["--nproc-per-node", "2", "--signal", "USR2"], "is not SIGNAL@SECONDS"),
        (["--nproc-per-node", "2", "--env", "NCCL_SOCKET_IFNAME"], "is not KEY=VALUE"),
        (["--nproc-per-node", "3"], "not divisible by micro_batch_size x world size = 16 x 3"),
        (["--nproc-per-node", "2", "--set", "train.backend=nccl"], "this is a CPU job"),
        (["--nproc-per-node", "2", "--resume", "runs/x/checkpoints/step_00000010"], "pass --resume auto"),
    ],
)
def test_bad_input_is_one_sentence(capsys, tmp_path, args, expected):
    done = zoa_here(capsys, "slurm", RECIPE, "--out", str(tmp_path / "run"), *args)
    refused(done, expected)
    assert not (tmp_path / "run").exists()


def test_without_sbatch_the_submission_fails_with_one_sentence(tmp_path):
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}  # python, but no Slurm commands
    done = zoa("slurm", RECIPE, "--nproc-per-node", "2", "--out", str(tmp_path / "run"), env=env)
    refused(done, "sbatch is not on PATH")


def test_a_non_empty_run_directory_is_refused_before_submitting(capsys, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    done = zoa_here(capsys, "slurm", RECIPE, "--nproc-per-node", "2", "--out", str(tmp_path / "run"))
    refused(done, "is not empty")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["notes.txt"]


# ---- a real Slurm -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    c = SlurmCluster()
    try:
        c.start()
        yield c
    finally:
        c.stop()


def submit(cluster: SlurmCluster, run_dir: Path, *args: str) -> str:
    done = zoa("slurm", RECIPE, "--out", str(run_dir), *args, env=cluster.env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "submitted job" in done.stdout and "tail -f" in done.stdout
    return json.loads((run_dir / "slurm" / "jobs.jsonl").read_text().splitlines()[-1])["job_id"]


def final_model(run_dir: Path, steps: int) -> dict:
    return torch.load(run_dir / "checkpoints" / f"step_{steps:08d}" / "model.pt")


STEPS = 120


@pytest.fixture(scope="module")
def reference_run(cluster, cache_dir, tmp_path_factory) -> Path:
    """An uninterrupted job (torchrun launcher, 2 CPU ranks): completes, and is the reference of the preemption test."""
    run_dir = tmp_path_factory.mktemp("slurm") / "reference"
    submitted = time.monotonic()
    job_id = submit(cluster, run_dir, "--nproc-per-node", "2", *short(STEPS, cache_dir, 60))
    info = cluster.wait(job_id, timeout=300)
    history = [json.loads(line) for line in (run_dir / "slurm" / "jobs.jsonl").read_text().splitlines()]
    started = datetime.fromisoformat(history[1]["time"]) - datetime.fromisoformat(history[0]["time"])
    print(f"torchrun job: running {started.total_seconds():.0f} s and COMPLETED {time.monotonic() - submitted:.1f} s after zoa-train slurm")
    log = (run_dir / "slurm" / f"job-{job_id}.out").read_text()
    assert info["JobState"] == "COMPLETED", log[-3000:]
    return run_dir


@pytest.mark.slow
def test_a_torchrun_job_completes(reference_run):
    log = next((reference_run / "slurm").glob("job-*.out")).read_text()
    assert "zoa-train: job" in log and f"done: {STEPS} steps in " in log
    assert len((reference_run / "metrics.jsonl").read_text().splitlines()) == STEPS // 10
    assert (reference_run / "checkpoints" / f"step_{STEPS:08d}" / "COMPLETE").is_file()
    events = [json.loads(line)["event"] for line in (reference_run / "slurm" / "jobs.jsonl").read_text().splitlines()]
    assert events == ["submitted", "start", "end"]


@pytest.mark.slow
def test_an_srun_job_completes(cluster, cache_dir, tmp_path):
    run_dir = tmp_path / "run"
    job_id = submit(cluster, run_dir, "--nproc-per-node", "2", "--launcher", "srun", *short(20, cache_dir, 0))
    again = zoa("slurm", RECIPE, "--nproc-per-node", "2", "--resume", "auto", "--out", str(run_dir), env=cluster.env, timeout=120)
    assert again.returncode == 2 and f"job {job_id} (" in again.stderr and "already uses run directory" in again.stderr
    info = cluster.wait(job_id, timeout=300)
    log = (run_dir / "slurm" / f"job-{job_id}.out").read_text()
    assert info["JobState"] == "COMPLETED", log[-3000:]
    assert "done: 20 steps in " in log and (run_dir / "checkpoints" / "step_00000020" / "COMPLETE").is_file()
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.slow
def test_a_warned_job_checkpoints_requeues_and_finishes_like_an_uninterrupted_one(cluster, cache_dir, reference_run, tmp_path):
    run_dir = tmp_path / "run"
    job_id = submit(cluster, run_dir, "--nproc-per-node", "2", "--max-requeues", "1", "--set", "train.keep_checkpoints=3", *short(STEPS, cache_dir, 60))
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2) and time.monotonic() < deadline:
        time.sleep(0.2)
    # What Slurm does before the time limit with --signal=B:USR2@120: the signal to the batch shell only.
    cluster.run("scancel", "--signal=USR2", "--batch", job_id)
    history = run_dir / "slurm" / "jobs.jsonl"
    while '"requeue"' not in history.read_text() or cluster.job(job_id)["JobState"] != "PENDING":
        assert time.monotonic() < deadline + 120, cluster.job(job_id)
        time.sleep(0.2)
    before_requeue = metrics.read_text().splitlines()  # Slurm holds a requeued job back (cred_expire): nothing runs now
    info = cluster.wait(job_id, timeout=300)
    log = (run_dir / "slurm" / f"job-{job_id}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log[-3000:] + cluster.logs()
    history = [json.loads(line) for line in (run_dir / "slurm" / "jobs.jsonl").read_text().splitlines()]
    assert [h["event"] for h in history] == ["submitted", "start", "requeue", "start", "end"]
    stopped = int(log.split("stopped at step ")[1].split()[0])
    assert 20 <= stopped < STEPS and "requeueing job" in log
    assert log.count("continue with: zoa-train run") == 1  # said once, by rank 0, not by every rank torchrun started
    assert (run_dir / "checkpoints" / f"step_{stopped:08d}" / "COMPLETE").is_file()
    # The requeued job continued from that checkpoint: the rows logged before it are kept as they were
    # (a run from step 0 would rewrite them with other wall times), none is duplicated.
    rows = metrics.read_text().splitlines()
    assert rows[: stopped // 10] == before_requeue[: stopped // 10] and len(rows) == STEPS // 10
    print(f"warned at step >= 20: stopped at step {stopped} after a checkpoint at step {stopped} (0 steps lost)")
    # The stop checkpoint was the latest when the requeued job resumed from it; the final parameters match.
    reference, resumed = final_model(reference_run, STEPS), final_model(run_dir, STEPS)
    assert all(torch.equal(reference[k], resumed[k]) for k in reference)


@pytest.mark.slow
def test_a_job_sbatch_refuses_is_one_sentence_with_its_message(cluster, tmp_path):
    done = zoa("slurm", RECIPE, "--nproc-per-node", "2", "--partition", "nosuch", "--out", str(tmp_path / "run"), env=cluster.env, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "sbatch refused the job:" in done.stderr and "invalid partition" in done.stderr.lower()
    assert not (tmp_path / "run").exists()  # no trace: the same command can be run again


@pytest.mark.slow
def test_a_live_job_goes_on_without_a_lost_rank_and_its_node_starts_it_again(cluster, cache_dir, tmp_path):
    # --launcher live: srun's one task per node is its launcher, which keeps the store (node 0) and starts the ranks
    run_dir, steps = tmp_path / "run", 60
    live = ["train.elastic=live", "train.log_every=1", "optimizer.var_freeze_step=12", "optimizer.local_steps=fixed", "optimizer.local_step_interval=3"]
    job_id = submit(
        cluster,
        run_dir,
        "--nproc-per-node",
        "2",
        "--launcher",
        "live",
        "--max-restarts",
        "1",
        *short(steps, cache_dir, 8),
        *(a for s in live for a in ("--set", s)),
    )
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 180
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 14):
        assert time.monotonic() < deadline, cluster.job(job_id)
        time.sleep(0.2)
    launcher = subprocess.run(["pgrep", "-f", f"^{sys.executable} -m zoa_train.cli run .* --out {run_dir}"], capture_output=True, text=True).stdout.split()
    assert len(launcher) == 1, launcher  # one task on the one node (srun's own processes start with srun)
    ranks = sorted(int(p) for p in subprocess.run(["pgrep", "-P", launcher[0], "-f", "spawn_main"], capture_output=True, text=True).stdout.split())
    assert len(ranks) == 2
    os.kill(ranks[1], 9)
    info = cluster.wait(job_id, timeout=300)
    log = (run_dir / "slurm" / f"job-{job_id}.out").read_text()
    assert info["JobState"] == "COMPLETED", log[-3000:] + cluster.logs()
    done = [json.loads(line) for line in metrics.read_text().splitlines()]
    changes = [r for r in done if "world_size" in r]
    assert [r.get("left_members", r.get("joined_members")) for r in changes] == [[1], [1]], changes
    assert changes[0]["world_size"] == 1 and changes[1]["world_size"] == 2 and ranks[0] != ranks[1]
    assert [r["step"] for r in done if "loss" in r] == list(range(1, steps + 1)), "every step logged once"
    assert (run_dir / "checkpoints" / f"step_{steps:08d}" / "COMPLETE").is_file() and f"done: {steps} steps in " in log
