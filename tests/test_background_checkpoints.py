"""Checkpoints written in the background (train/checkpointer.py, RunDirectory.save_in_background): a rank
that dies while its files are written leaves the previous checkpoint complete and the new one invisible;
a write that fails in a run stops every rank soon after, in one sentence, with the earlier checkpoint
intact. (Exact resumes from background checkpoints: test_run.py, test_sharded.py, test_faults.py.)"""

import json
import subprocess
import sys

import pytest
import torch
from conftest import refused, zoa
from distributed_harness import free_port

from zoa_train.train.checkpointer import read_whole
from zoa_train.train.rundir import RunDirectory, complete_checkpoints, verify_checkpoint

pytestmark = pytest.mark.slow  # ranks in processes of their own, or a training run

# One rank of two: step 4 written in the background and published; rank 1 then dies (os._exit, as a kill
# would stop it) in the middle of writing its files of step 8, after its shards, while rank 0 trains on.
RANK = """
import os, sys, torch, torch.distributed as dist
from zoa_train.distributed import init_process_group
from zoa_train.train import rundir
from zoa_train.train.rundir import RunDirectory

rank, port, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
init_process_group("gloo", timeout_s=60, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
run = RunDirectory(path)
run.prepare(None, False, 2, rank)

def save(step):
    shards = {"model": {f"node_{rank}": {"w": torch.full((1024,), float(step))}}}
    shared = {"model.pt": {"w": torch.full((8,), float(step))}} if rank == 0 else {}
    run.save_in_background(step, rank, 2, {"r": torch.full((1 << 16,), float(step))}, shared, 5, sharded=shards, timeout_s=60)

save(4)
print("published", run.wait_for_save().name, flush=True)
if rank == 1:
    write = rundir.save_file
    def killed(obj, file):
        with open(str(file) + ".part", "wb") as f:
            f.write(b"torn")  # half a file, as a kill mid-write leaves it
        os._exit(9)
    rundir.save_file = killed
save(8)
try:
    for _ in range(1000):
        dist.all_reduce(torch.ones(1))  # training goes on: it meets the dead rank
    run.wait_for_save()
    print("published", 8, flush=True)
except BaseException as e:
    print("failed", type(e).__name__, flush=True)
    os._exit(3)
"""


def test_a_rank_killed_while_its_files_are_written_leaves_the_previous_checkpoint_complete_and_loadable(tmp_path):
    path, port = tmp_path / "run", str(free_port())
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(r), port, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in ranks]
    assert ranks[1].returncode == 9, outs[1][1][-3000:]
    assert ranks[0].returncode == 3 and "failed" in outs[0][0], outs[0]  # rank 0 is told; nothing is published
    assert all("published step_00000004" in out for out, _ in outs)
    checkpoints = path / "checkpoints"
    staged = checkpoints / "step_00000008.tmp"
    assert (staged / "model" / "__1_0.distcp").is_file() and (staged / "rank_00001.pt.part").is_file()  # killed mid-write
    assert [p.name for p in complete_checkpoints(checkpoints)] == ["step_00000004"]
    assert verify_checkpoint(checkpoints / "step_00000004") is None
    run = RunDirectory(path)
    assert run.prepare("auto", False, 2, 0).name == "step_00000004"  # what a restart resumes from
    run.close()
    assert torch.equal(run.load(checkpoints / "step_00000004", "rank_00001.pt")["r"], torch.full((1 << 16,), 4.0))
    shards = read_whole(checkpoints / "step_00000004" / "model")
    assert torch.equal(shards["node_1"]["w"], torch.full((1024,), 4.0)) and torch.equal(
        run.load(checkpoints / "step_00000004", "model.pt")["w"], torch.full((8,), 4.0)
    )


@pytest.fixture
def small_disk(tmp_path):
    """A 20 MiB tmpfs: one checkpoint of the run below fits (about 13 MB), a second does not. Needs root (CI)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "--lazy", str(mount)], check=True)


def test_a_write_that_fails_in_the_background_stops_every_rank_soon_in_one_sentence(small_disk, cache_dir):
    # Checkpoints at 8 (fits) and 16 (the disk is full): the failure is agreed in the background and every
    # rank stops at one step a little after 16, before the next checkpoint at 24, with step 8 intact.
    run_dir = small_disk / "run"
    sets = [
        "train.steps=32",
        "train.checkpoint_every=8",
        "train.keep_checkpoints=1",
        "train.log_every=1",
        "train.val_every=0",
        "train.val_batches=1",
        "optimizer.name=adam",
        "logging.wandb=disabled",
        "logging.tensorboard=false",
        f"data.cache_dir={cache_dir}",
    ]
    done = zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(run_dir), *[a for s in sets for a in ("--set", s)])
    refused(done, "could not write checkpoint step_00000016", f"no space is left on the disk mounted at {small_disk}", alone=False)
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_00000008"] and verify_checkpoint(checkpoints / "step_00000008") is None
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert 16 < steps[-1] < 24, steps[-1]  # stopped by the failure, not at the next checkpoint
