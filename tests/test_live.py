"""train.elastic live (docs/faults.md, "Live: the others go on"; zoa_train/train/live.py): a lost rank is dropped
at the next collective and the survivors go on without restarting; a rank started again joins at a later sync.

- the optimizers' regroup: what each rank accumulated since the last exchange carries over tensor by tensor into
  the new world size's layout, and the next sync makes the survivors' parameters identical;
- whole runs on 3 ranks under zoa-train run's own launcher: a rank killed inside a local-step period and one hung
  (its collectives time out), each dropped while the other ranks' processes go on, each started again and
  joining from rank 0; a rank dying inside a 1-bit round (after its first pass), and a second one dying while the
  others regroup.
"""

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import refused, zoa, zoa_here
from distributed_harness import free_port, run_ranks
from test_faults import rank_pids, start_run, wait_for_step

from zoa_train.comm import OneBitAllReduce
from zoa_train.config import live_shrink_warning, load_recipe
from zoa_train.optim import OneBitAdam, ZeroOneAdam
from zoa_train.optim.diloco import DiLoCo
from zoa_train.train.live import BEAT_S, STALE_S, launch_live
from zoa_train.train.rundir import read_marker

ROOT = Path(__file__).resolve().parents[1]


# ---- the optimizers' regroup ---------------------------------------------------------------------


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(6, 13)
        self.head = torch.nn.Linear(13, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.hidden(x)))


OPTIMIZERS = {
    "zero_one_adam": lambda p: ZeroOneAdam(p, lr=1e-2, var_freeze_step=2, local_steps="fixed", local_step_interval=4, collective=OneBitAllReduce),
    "onebit_adam": lambda p: OneBitAdam(p, lr=1e-2, freeze_step=2, collective=OneBitAllReduce),
    "diloco": lambda p: DiLoCo(p, lr=1e-2, sync_every=4, outer_collective=OneBitAllReduce),
}


def _per_tensor(opt) -> dict[str, list[torch.Tensor]]:
    """Every flat buffer and the collective's accumulators, cut per tensor (the form that survives a relayout)."""
    found = {}
    for g, (flat, buffers) in enumerate(zip(opt._flat, opt._buffers)):
        for name, buffer in buffers.items():
            found[f"{name}/{g}"] = [v.clone() for v in flat.views(buffer)]
        if opt.collective is not None:
            found[f"accumulator/{g}"] = [v.clone() for v in flat.views(opt.collective.accumulators[g])]
    return found


def _regroup_after_a_rank_leaves(rank, world, name, store_path):
    torch.manual_seed(0)
    model = Net()
    opt = OPTIMIZERS[name](list(model.parameters()))
    torch.manual_seed(rank + 1)
    steps = 7  # past the warm-up, inside a local-step period (0/1 Adam: syncs at 2, 3, 7 ...; DiLoCo: 4, 8)
    for _ in range(steps):
        model(torch.randn(8, 6)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    before = _per_tensor(opt)
    params = [p.detach().clone() for p in model.parameters()]
    differed = opt.parameters_differ
    dist.destroy_process_group()
    # Rank 2 leaves; ranks 0 and 1 meet in a new group, as the live trainer's next generation does.
    if rank == 2:
        dist.init_process_group("gloo", store=dist.FileStore(store_path + ".alone", 1), rank=0, world_size=1)
        return None
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    opt.regroup()
    after = _per_tensor(opt)
    carried = {key: all(torch.equal(a, b) for a, b in zip(before[key], after[key])) for key in before}
    kept = all(torch.equal(a, p) for a, p in zip(params, model.parameters()))
    servers = [s["server_error"].abs().sum().item() for s in opt.collective.state_dicts() if "server_error" in s] if opt.collective else []
    opt.synchronize()
    synced = [p.detach().clone() for p in model.parameters()]
    return {"world": opt.world_size, "differed": differed, "carried": carried, "kept": kept, "servers": servers, "synced": synced}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_regroup_carries_each_ranks_state_tensor_by_tensor_into_the_new_layout_and_the_next_sync_agrees(tmp_path, name):
    results = run_ranks(_regroup_after_a_rank_leaves, 3, name, str(tmp_path / "store"))
    for r in results[:2]:
        assert r["world"] == 2
        # inside a local-step period, where each rank's own state is what must carry over (1-bit Adam: its worker error)
        assert r["differed"] == (name != "onebit_adam")
        assert all(r["carried"].values()), {k: v for k, v in r["carried"].items() if not v}
        assert r["kept"], "a survivor keeps its own parameters (no broadcast when nobody joins)"
        assert all(s == 0 for s in r["servers"])  # the server's 1-bit error is of the old chunks: zero
    for a, b in zip(results[0]["synced"], results[1]["synced"]):
        assert torch.equal(a, b)


# ---- refusals ------------------------------------------------------------------------------------


def test_live_under_torchrun_or_several_srun_tasks_a_node_is_refused_in_one_sentence(tmp_path, capsys, monkeypatch):
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    run_dir = tmp_path / "run"
    done = zoa_here(capsys, "run", "recipes/gpt2_tiny.yaml", "--out", str(run_dir), "--set", "train.elastic=live")
    refused(done, "train.elastic live runs on the ranks zoa-train run starts itself (--nproc)")
    assert not run_dir.exists()
    # under srun each node's task is its launcher: two tasks on one node would start its ranks twice
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key)
    for key, value in {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "1"}.items():
        monkeypatch.setenv(key, value)
    done = zoa_here(capsys, "run", "recipes/gpt2_tiny.yaml", "--out", str(run_dir), "--set", "train.elastic=live")
    refused(done, "train.elastic live under srun needs one task per node, whose zoa-train run starts the node's ranks (--nproc), and this step has 2 tasks")
    assert not run_dir.exists()


def test_a_live_run_says_at_the_start_which_fewer_ranks_would_stop_it():
    recipe = load_recipe(ROOT / "recipes/gpt2_tiny.yaml", ["train.global_batch_size=24", "train.micro_batch_size=3", "train.elastic=live"])
    assert live_shrink_warning(recipe, 8) == (
        "train.elastic live: train.global_batch_size 24 in micro-batches of 3 splits over 1, 2, 4 and 8 ranks, "
        "so a run that drops to 7, 6, 5 or 3 ranks stops there (its checkpoints resume at any size that fits)."
    )
    assert "splits over 1, 2 and 4 ranks, so a run that drops to 3 ranks stops there" in live_shrink_warning(recipe, 4)
    recipe = load_recipe(ROOT / "recipes/gpt2_tiny.yaml", ["train.global_batch_size=24", "train.micro_batch_size=4", "train.elastic=live"])
    assert live_shrink_warning(recipe, 3) is None  # 24 = 4 x 3 x 2 = 4 x 2 x 3 = 4 x 1 x 6


# ---- whole runs -------------------------------------------------------------------------------------

STEPS = 60


def sets(cache_dir: Path, *extra: str) -> list[str]:
    """0/1 Adam with local-step periods of 3 steps after its variance freezes at step 12; global batches of 24 in
    micro-batches of 4 (2 a step on each of 3 ranks, 3 on each of 2, 6 on 1)."""
    return [a for s in sets_of(cache_dir, *extra) for a in ("--set", s)]


def sets_of(cache_dir: Path, *extra: str) -> list[str]:
    return [
        f"train.steps={STEPS}",
        "train.log_every=1",
        "train.val_every=0",
        "train.val_batches=2",
        "train.checkpoint_every=8",
        "train.global_batch_size=24",
        "train.micro_batch_size=4",
        "train.elastic=live",
        "train.timeout_s=60",  # above a start-up's spread on a loaded 2-core machine (a rank building the data cache)
        "optimizer.var_freeze_step=12",
        "optimizer.lr=0.001",
        "optimizer.local_steps=fixed",
        "optimizer.local_step_interval=3",
        "logging.wandb=disabled",
        "logging.tensorboard=false",
        f"data.cache_dir={cache_dir}",
        *extra,
    ]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def wait_for(run, run_dir: Path, key: str, count: int) -> dict:
    """The `count`-th membership record with `key` (left_members, joined_members)."""
    deadline = time.monotonic() + 300
    while True:
        found = [r for r in records(run_dir) if key in r] if (run_dir / "metrics.jsonl").is_file() else []
        if len(found) >= count:
            return found[count - 1]
        assert run.poll() is None and time.monotonic() < deadline, (run.communicate()[1] or "the run ended: see its log")[-3000:]
        time.sleep(0.1)


@pytest.mark.slow  # three ranks killed, hung and started again, and a reference run
def test_a_killed_and_a_hung_rank_are_dropped_while_the_others_go_on_and_each_joins_again_from_rank_0(tmp_path, cache_dir):
    reference = tmp_path / "reference"
    whole = zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(reference), "--nproc", "3", *sets(cache_dir, "train.elastic=off"))
    assert whole.returncode == 0, whole.stderr[-3000:]

    run_dir = tmp_path / "live"
    run = start_run(run_dir, "--nproc", "3", "--max-restarts", "2", *sets(cache_dir))
    wait_for_step(run, run_dir / "metrics.jsonl", 14)  # after the sync at step 13 (syncs every 3 steps from 12 on)
    first = rank_pids(run.pid)
    assert len(first) == 3
    os.kill(first[2], signal.SIGKILL)
    left = wait_for(run, run_dir, "left_members", 1)
    assert left["left_members"] == [2] and left["world_size"] == 2 and left["world_size_before"] == 3
    assert left["seconds_down"] < 5  # seen at the next collective: the dead rank's connections are closed
    assert 0 <= left["steps_dropped"] <= 3 and left["samples_dropped"] == left["steps_dropped"] * 8
    assert set(first[:2]) <= set(rank_pids(run.pid)), "the survivors go on in their own processes"
    joined = wait_for(run, run_dir, "joined_members", 1)
    assert joined["joined_members"] == [2] and joined["world_size"] == 3 and joined["step"] > left["step"]

    # A hung rank (stopped): the others drop it (once its heartbeat is STALE_S old) and go on; once
    # it runs again it finds itself dropped, stops, and is started again.
    wait_for_step(run, run_dir / "metrics.jsonl", joined["step"] + 4)  # training again: the others meet it in each step's collectives
    now = rank_pids(run.pid)
    assert first[0] in now and first[1] in now
    os.kill(first[1], signal.SIGSTOP)
    hung = wait_for(run, run_dir, "left_members", 2)
    os.kill(first[1], signal.SIGCONT)
    assert hung["left_members"] == [1] and hung["world_size"] == 2
    # seen when its heartbeat aged past STALE_S (from its last beat, up to BEAT_S before it stopped), by the member
    # that watches it, while the others wait in a collective with it (the loss of each step) or for its commit: not
    # after their collective's timeout (train.timeout_s, 60 s here)
    assert STALE_S - 2 * BEAT_S <= hung["seconds_down"] < 3 * STALE_S
    _, err = run.communicate(timeout=300)
    assert run.returncode == 0, err[-3000:]
    assert "member 1 arrived after the others had formed generation" in err

    done = records(run_dir)
    assert done[-1]["step"] == STEPS
    assert [r["step"] for r in done if "loss" in r] == list(range(1, STEPS + 1)), "every step logged once"
    final = run_dir / "checkpoints" / f"step_{STEPS:08d}"
    assert read_marker(final)["synced"]  # every rank ended on the same model
    val, val_reference = done[-1]["val_loss"], records(reference)[-1]["val_loss"]
    assert abs(val / val_reference - 1) < 0.05, (val, val_reference)


@pytest.mark.slow  # three ranks, two of which die at chosen points
def test_a_rank_dying_inside_a_1bit_round_and_another_while_the_others_regroup_leave_the_last_one_going_on(tmp_path, cache_dir):
    from live_faults import faulty_rank

    # 1-bit Adam (a 1-bit round every step from step 12): member 2 dies in its 5th round, between the round's two
    # passes, so that member 0 and 1 have sent and received its first; member 1 dies in the regroup that follows.
    recipe = load_recipe(ROOT / "recipes/gpt2_tiny.yaml", [*sets_of(cache_dir), "optimizer.name=onebit_adam", "optimizer.freeze_step=12"])
    run_dir = tmp_path / "run"
    launched = launch_live(
        functools.partial(faulty_rank, {2: ("round", 5), 1: ("regroup", 1)}), 3, recipe.to_dict(), str(run_dir), None, True, False, max_restarts=2
    )
    assert launched[0]["step"] == STEPS
    changes = [r for r in records(run_dir) if "left_members" in r or "joined_members" in r]
    left = [m for r in changes for m in r.get("left_members", [])]
    assert sorted(left) == [1, 2], changes
    first = next(r for r in changes if "left_members" in r)
    assert first["step"] == 16 and first["steps_dropped"] == 1  # the round of step 17 failed: redone by the survivors
    assert any(r.get("world_size") == 1 for r in changes), "member 0 went on alone while the others came back"
    assert [r["step"] for r in records(run_dir) if "loss" in r] == list(range(1, STEPS + 1))
    assert read_marker(run_dir / "checkpoints" / f"step_{STEPS:08d}")["synced"]


@pytest.mark.slow  # three ranks, one of which freezes inside a 1-bit round
def test_a_rank_frozen_inside_a_1bit_round_is_dropped_once_its_heartbeat_is_stale_not_after_the_rounds_timeout(tmp_path, cache_dir):
    from live_faults import FROZEN_S, faulty_rank

    # Member 1 stops itself (SIGSTOP) between the two passes of its 5th round: members 0 and 2 wait in the second
    # pass for it. Member 0 watches member 1's heartbeat, sees it stale and ends the generation; the wait would
    # otherwise last train.timeout_s (60 s), past FROZEN_S, when member 1 runs again and finishes the round.
    recipe = load_recipe(ROOT / "recipes/gpt2_tiny.yaml", [*sets_of(cache_dir), "optimizer.name=onebit_adam", "optimizer.freeze_step=12"])
    run_dir = tmp_path / "run"
    launched = launch_live(functools.partial(faulty_rank, {1: ("freeze", 5)}), 3, recipe.to_dict(), str(run_dir), None, True, False)
    assert launched[0]["step"] == STEPS
    changes = [r for r in records(run_dir) if "left_members" in r or "joined_members" in r]
    # (member 1 runs again after FROZEN_S, finds itself dropped and exits: not started again here)
    assert changes[0]["left_members"] == [1] and changes[0]["world_size"] == 2, changes
    assert STALE_S - 2 * BEAT_S <= changes[0]["seconds_down"] < min(3 * STALE_S, FROZEN_S), changes[0]
    assert [r["step"] for r in records(run_dir) if "loss" in r] == list(range(1, STEPS + 1))
    assert read_marker(run_dir / "checkpoints" / f"step_{STEPS:08d}")["synced"]


@pytest.mark.slow  # three launchers as three machines, one lost and started again
def test_a_machine_lost_and_started_again_leaves_and_joins_while_the_other_machines_go_on(tmp_path, cache_dir):
    store, run_dir = f"127.0.0.1:{free_port()}", tmp_path / "run"

    def machine(rank: int) -> subprocess.Popen:
        command = [sys.executable, "-m", "zoa_train.cli", "run", "recipes/gpt2_tiny.yaml", "--out", str(run_dir), "--nproc", "1"]
        command += ["--nnodes", "3", "--node-rank", str(rank), "--store", store, *sets(cache_dir)]
        with open(tmp_path / f"machine{rank}.log", "a") as log:
            return subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)

    machines = [machine(r) for r in range(3)]
    wait_for_step(machines[0], run_dir / "metrics.jsonl", 14)
    lost = [machines[2].pid, *rank_pids(machines[2].pid)]  # the machine's launcher and its rank, at once
    for pid in lost:
        os.kill(pid, signal.SIGKILL)
    left = wait_for(machines[0], run_dir, "left_members", 1)
    assert left["left_members"] == [2] and left["world_size"] == 2
    machines[2] = machine(2)  # the machine comes back: the run is under way, so its rank joins
    joined = wait_for(machines[0], run_dir, "joined_members", 1)
    assert joined["joined_members"] == [2] and joined["world_size"] == 3
    for m in machines:
        assert m.wait(timeout=300) == 0, (tmp_path / "machine0.log").read_text()[-3000:]
    done = records(run_dir)
    assert [r["step"] for r in done if "loss" in r] == list(range(1, STEPS + 1))
    assert read_marker(run_dir / "checkpoints" / f"step_{STEPS:08d}")["world_size"] == 3


def _own_hostnames_allowed() -> bool:
    """Whether this process may start commands in a UTS namespace of their own (root, util-linux's unshare)."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "--uts", "--", "sh", "-c", "hostname zoa-probe"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.slow  # two machines of two ranks, one rank lost and started again
@pytest.mark.skipif(not _own_hostnames_allowed(), reason="needs root and unshare --uts: each machine's hostname of its own")
def test_node_aware_sync_falls_back_to_flat_while_a_machine_is_short_of_a_rank_and_comes_back_when_it_rejoins(tmp_path, cache_dir):
    # Two launchers, each in a UTS namespace with a hostname of its own: the ranks find two nodes of two ranks by
    # their hostnames, as on two machines, and comm.topology auto makes the 1-bit sync node-aware.
    store, run_dir = f"127.0.0.1:{free_port()}", tmp_path / "run"
    machines = []
    for rank in range(2):
        command = [sys.executable, "-m", "zoa_train.cli", "run", "recipes/gpt2_tiny.yaml", "--out", str(run_dir), "--nproc", "2", "--max-restarts", "1"]
        command += ["--nnodes", "2", "--node-rank", str(rank), "--store", store, *sets(cache_dir, "train.micro_batch_size=2")]
        own_host = ["unshare", "--uts", "--", "sh", "-c", f'hostname zoa-machine{rank} && exec "$@"', "sh"]
        with open(tmp_path / f"machine{rank}.log", "w") as log:
            machines.append(subprocess.Popen([*own_host, *command], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True))
    wait_for_step(machines[0], run_dir / "metrics.jsonl", 14)
    os.kill(rank_pids(machines[1].pid)[-1], signal.SIGKILL)  # member 3, the second rank of the second machine
    left = wait_for(machines[0], run_dir, "left_members", 1)
    assert left["left_members"] == [3] and left["world_size"] == 3 and left["node_aware"] == 0, left  # nodes of 2 and 1: flat
    assert left["seconds_down"] < 5  # a rank waiting in a node group with the lost one is freed as in the world group
    joined = wait_for(machines[0], run_dir, "joined_members", 1)
    assert joined["joined_members"] == [3] and joined["world_size"] == 4 and joined["node_aware"] == 1, joined
    for m in machines:
        assert m.wait(timeout=300) == 0, (tmp_path / "machine0.log").read_text()[-3000:]
    log = (tmp_path / "machine0.log").read_text()
    assert "hierarchical 1-bit sync, 2 nodes x 2 ranks" in log and "3 ranks: flat 1-bit sync, 2 nodes x 1/2 ranks" in log
    done = records(run_dir)
    assert [r["step"] for r in done if "loss" in r] == list(range(1, STEPS + 1))
    assert read_marker(run_dir / "checkpoints" / f"step_{STEPS:08d}")["synced"]


def test_machines_of_a_live_run_need_train_elastic_live_and_a_store(tmp_path, capsys):
    run_dir = tmp_path / "run"
    done = zoa_here(capsys, "run", "recipes/gpt2_tiny.yaml", "--out", str(run_dir), "--nnodes", "2", "--store", "h:1")
    refused(done, "--nnodes, --node-rank and --store start a train.elastic live run on several machines")
    done = zoa_here(capsys, "run", "recipes/gpt2_tiny.yaml", "--out", str(run_dir), "--nnodes", "2", "--set", "train.elastic=live")
    refused(done, "--store must be HOST:PORT, where machine 0 keeps the run's store, not None.")
    assert not run_dir.exists()
