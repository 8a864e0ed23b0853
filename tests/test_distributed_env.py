"""Cluster-environment detection (no processes started)."""

import os

import pytest

from zoa_train.distributed import cluster_environment, cuda_device_index, export_slurm_environment, first_slurm_node, threads_per_rank
from zoa_train.errors import UserError

TORCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SLURM_VARS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_STEP_ID", "SLURM_JOB_NODELIST", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")


@pytest.fixture
def clean_env(monkeypatch):
    # setenv first so that monkeypatch records the original state of every variable, including the
    # ones export_slurm_environment writes behind its back: all are restored after the test.
    for name in TORCH_VARS + SLURM_VARS:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return monkeypatch


def test_no_launcher(clean_env):
    assert cluster_environment() is None


def test_torchrun_is_recognised(clean_env):
    clean_env.setenv("RANK", "3")
    clean_env.setenv("WORLD_SIZE", "8")
    assert cluster_environment() == "torchrun"


def test_srun_step_is_translated_for_torch(clean_env):
    for name, value in {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "16",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_NODELIST": "gpu[007-010],gpu012",
    }.items():
        clean_env.setenv(name, value)
    assert cluster_environment() == "slurm"
    export_slurm_environment()
    import os

    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("5", "16", "1")
    assert os.environ["MASTER_ADDR"] == "gpu007" and os.environ["MASTER_PORT"] == "29500"


def test_a_batch_script_outside_srun_is_not_a_rank(clean_env):
    clean_env.setenv("SLURM_PROCID", "0")
    clean_env.setenv("SLURM_NTASKS", "4")  # sbatch sets these, but only srun starts a step
    assert cluster_environment() is None


@pytest.mark.parametrize("nodelist,first", [("node1", "node1"), ("a[3-5]", "a3"), ("gpu[012,015],cpu1", "gpu012")])
def test_first_slurm_node_without_scontrol(nodelist, first):
    assert first_slurm_node(nodelist) == first


def test_threads_per_rank_shares_the_cores_unless_told(monkeypatch, clean_env):
    cores = os.cpu_count() or 1
    for name in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    assert threads_per_rank(1) == cores
    assert threads_per_rank(cores * 4) == 1  # never zero
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one rank on this machine, whatever the world size
    assert threads_per_rank(64) == cores
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads_per_rank(64) == 3


def test_ranks_map_to_the_gpus_they_can_see():
    assert [cuda_device_index(r, 8, 8) for r in range(8)] == list(range(8))  # torchrun on an 8-GPU machine
    assert [cuda_device_index(r, 4, 8) for r in range(4)] == [0, 1, 2, 3]
    assert [cuda_device_index(r, 4, 1) for r in range(4)] == [0, 0, 0, 0]  # srun --gpus-per-task 1: one GPU each
    with pytest.raises(UserError, match="4 ranks on this machine but 2 GPUs"):
        cuda_device_index(3, 4, 2)
    with pytest.raises(UserError, match="sees none"):
        cuda_device_index(0, 1, 0)


def test_slurm_tasks_per_node_become_the_local_world_size(clean_env):
    for name, value in (
        ("SLURM_PROCID", "5"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_STEP_ID", "0"),
        ("SLURM_JOB_NODELIST", "gpu1"),
        ("SLURM_STEP_TASKS_PER_NODE", "4(x2)"),
    ):
        clean_env.setenv(name, value)
    export_slurm_environment()
    assert os.environ["LOCAL_WORLD_SIZE"] == "4" and os.environ["LOCAL_RANK"] == "1"
