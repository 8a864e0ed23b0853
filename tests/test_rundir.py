"""RunDirectory on one process: what it refuses, what it empties, trims and publishes; checksums,
failed saves and the run-directory lock."""

import errno
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading

import pytest
import torch

from zoa_train.errors import UserError
from zoa_train.train import rundir
from zoa_train.train.checkpointer import host_copy, read_whole
from zoa_train.train.rundir import RunDirectory, complete_checkpoints, read_manifest, read_marker, verify_checkpoint


def test_check_refuses_what_a_run_must_not_touch(tmp_path):
    run = RunDirectory(tmp_path / "run")
    assert run.check(None, False, 2) is None  # missing: fine
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("keep")
    with pytest.raises(UserError, match="is not empty"):
        run.check(None, False, 2)
    with pytest.raises(UserError, match="cannot be used together"):
        run.check("auto", True, 2)
    with pytest.raises(UserError, match="no such checkpoint directory"):
        run.check(str(tmp_path / "nowhere"), False, 2)
    assert run.check("auto", False, 2) is None  # nothing to resume: start at step 0
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="not a directory"):
        RunDirectory(tmp_path / "file").check(None, True, 1)


def test_prepare_empties_with_overwrite_and_a_resume_trims_metrics_only_when_asked(tmp_path):
    run = RunDirectory(tmp_path / "run")
    run.prepare(None, False, 1, 0)
    records = [{"step": s, "loss": 1.0} for s in (1, 2, 3, 4, 5)]
    (run.path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 6, "lo')  # torn last line
    saved = run.save(3, 0, 1, {"x": torch.ones(2)}, {"model.pt": {"w": torch.zeros(1)}}, keep=2)
    assert saved.name == "step_00000003" and (saved / "COMPLETE").is_file() and not list(run.checkpoints.glob("*.tmp"))

    before = (run.path / "metrics.jsonl").read_bytes()
    assert run.prepare("auto", False, 1, 0) == saved
    assert (run.path / "metrics.jsonl").read_bytes() == before  # the trainer trims once the checkpoint is loaded
    run.trim_metrics(3)
    assert [json.loads(line)["step"] for line in (run.path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert torch.equal(run.load(saved, "rank_00000.pt")["x"], torch.ones(2))
    with pytest.raises(UserError, match="written by 1 ranks and this run has 2"):
        run.prepare("auto", False, 2, 0)

    run.prepare(None, True, 1, 0)
    assert run.path.is_dir() and [p.name for p in run.path.iterdir()] == [".lock"]  # only the lock survives
    run.close()


def test_save_keeps_the_newest_checkpoints(tmp_path):
    run = RunDirectory(tmp_path)
    for step in (1, 2, 3):
        run.save(step, 0, 1, {}, {}, keep=2)
    assert [p.name for p in sorted(run.checkpoints.iterdir())] == ["step_00000002", "step_00000003"]
    assert run.latest().name == "step_00000003"


def _save(run, step, keep=5):
    return run.save(step, 0, 1, {"x": torch.full((64,), float(step))}, {"model.pt": {"w": torch.ones(8) * step}}, keep=keep)


def _flip_byte(path, at=-20):
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_marker_records_checksums_and_old_markers_still_load(tmp_path):
    run = RunDirectory(tmp_path)
    saved = _save(run, 1)
    assert read_marker(saved) == {"step": 1, "world_size": 1, "synced": 1}
    inside = RunDirectory(tmp_path / "other").save(2, 0, 1, {}, {"model.pt": {}}, keep=3, synced=False)
    assert read_marker(inside)["synced"] == 0  # taken inside a local-step period: --reshard refuses it
    manifest = read_manifest(saved)
    assert sorted(manifest) == ["model.pt", "rank_00000.pt"]
    assert manifest["model.pt"][0] == (saved / "model.pt").stat().st_size
    assert manifest["model.pt"][1] == rundir.file_digest(saved / "model.pt")
    (saved / "COMPLETE").write_text("step 1\nworld_size 1\n")  # a marker from before checksums
    assert run.latest() == saved and run.check("auto", False, 1) == saved


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_auto_resume_skips_a_damaged_newest_checkpoint(tmp_path, caplog, damage):
    run = RunDirectory(tmp_path)
    older, newest = _save(run, 4), _save(run, 8)
    bad = newest / "rank_00000.pt"
    if damage == "flip":
        _flip_byte(bad)
    elif damage == "truncate":
        bad.write_bytes(bad.read_bytes()[:-5])
    else:
        bad.unlink()
    with caplog.at_level(logging.WARNING, logger="zoa_train.train.rundir"):
        assert run.prepare("auto", False, 1, 0) == older
    run.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("step_00000008" in w and "rank_00000.pt" in w for w in warnings), warnings
    assert torch.equal(run.load(older, "rank_00000.pt")["x"], torch.full((64,), 4.0))
    _flip_byte(older / "model.pt")  # nothing intact left: refuse rather than silently start again
    with pytest.raises(UserError, match="every complete checkpoint .* is damaged"):
        run.check("auto", False, 1)


def test_an_auto_reshard_falls_back_to_the_newest_synchronised_checkpoint_and_refuses_when_there_is_none(tmp_path, caplog):
    run = RunDirectory(tmp_path)
    run.save(4, 0, 1, {}, {"model.pt": {}}, keep=5)
    synced = run.save(6, 0, 1, {}, {"model.pt": {}}, keep=5)
    run.save(8, 0, 1, {}, {"model.pt": {}}, keep=5, synced=False)  # inside a local-step period: not reshardable
    _flip_byte(synced / "model.pt")  # a damaged one is skipped too
    assert run.check("auto", False, 1).name == "step_00000008"  # at its own world size the newest, as always
    with caplog.at_level("WARNING"):
        assert run.check("auto", False, 2, reshard=True).name == "step_00000004"
    assert "the newest checkpoint, step_00000008, was taken" in caplog.text and "step_00000004 (4 steps earlier)" in caplog.text
    alone = RunDirectory(tmp_path / "alone")
    alone.save(8, 0, 1, {}, {"model.pt": {}}, keep=5, synced=False)
    with pytest.raises(UserError, match="cannot reshard checkpoint .*step_00000008"):
        alone.check("auto", False, 2, reshard=True)


def test_explicit_resume_of_a_damaged_checkpoint_names_the_file(tmp_path):
    run = RunDirectory(tmp_path)
    saved = _save(run, 4)
    assert run.check(str(saved), False, 1) == saved
    _flip_byte(saved / "model.pt")
    with pytest.raises(UserError, match=r"checkpoint .*step_00000004 is damaged: .*model\.pt does not match") as e:
        run.prepare(str(saved), False, 1, 0)
    assert str(e.value).count(". ") == 0 and str(e.value).endswith(".")  # one sentence
    with pytest.raises(UserError, match=r"model\.pt does not match"):
        rundir.resolve_model_file(saved)


@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
@pytest.mark.parametrize("failing", ["save_file", "_write_synced"])
def test_a_failed_save_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch, failing, background):
    run = RunDirectory(tmp_path)
    previous = _save(run, 4, keep=1)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(rundir, failing, no_space)
    failed = threading.Event()
    with pytest.raises(UserError, match=r"^could not write checkpoint step_00000008 under .*checkpoints: no space is left on the disk mounted at /.*; ") as e:
        if background:  # the error comes at the next wait, the same sentence; the trainer is told at once (it then stops every rank)
            run.save_in_background(8, 0, 1, {"x": torch.zeros(64)}, {"model.pt": {"w": torch.ones(8)}}, keep=1, on_failure=failed.set)
            assert failed.wait(30)
            run.wait_for_save()
        else:
            _save(run, 8, keep=1)  # keep=1: pruning first would have lost step 4
    assert "\n" not in str(e.value)
    assert run.wait_for_save() is None  # said once
    monkeypatch.undo()
    assert [p.name for p in run.checkpoints.iterdir()] == ["step_00000004"]  # no staging left behind
    assert run.latest() == previous and run.check("auto", False, 1) == previous
    assert torch.equal(run.load(previous, "model.pt")["w"], torch.ones(8) * 4)
    assert _save(run, 8, keep=1).name == "step_00000008" and run.latest().name == "step_00000008"
    assert [p.name for p in run.checkpoints.iterdir()] == ["step_00000008"]  # pruned once the new one was complete


def test_a_background_save_copies_the_state_at_once_and_publishes_it_whole_once_written(tmp_path, monkeypatch):
    run = RunDirectory(tmp_path)
    previous = _save(run, 4, keep=1)
    writing, release = threading.Event(), threading.Event()
    original = rundir.save_file

    def held(obj, path):  # the first file's write waits until the test lets it go
        writing.set()
        assert release.wait(30)
        return original(obj, path)

    monkeypatch.setattr(rundir, "save_file", held)
    weights = torch.ones(8)
    run.save_in_background(8, 0, 1, {"x": weights}, {"model.pt": {"w": weights, "tied": weights[:4]}}, keep=1)
    weights.mul_(5)  # training goes on and changes the tensors: the checkpoint holds them as they were at the save
    assert writing.wait(30)
    assert complete_checkpoints(run.checkpoints) == [previous] and (run.checkpoints / "step_00000008.tmp").is_dir()  # invisible until whole
    second = threading.Thread(target=run.save_in_background, args=(12, 0, 1, {"x": weights}, {"model.pt": {"w": weights}}, 2))
    second.start()
    second.join(0.5)
    assert second.is_alive()  # a second save waits for the first write
    release.set()
    second.join(30)
    assert run.latest().name == "step_00000012"  # latest() waits for the write in flight
    published = run.wait_for_save()
    assert published.name == "step_00000012" and run.wait_for_save() is None
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["step_00000008", "step_00000012"]  # step 4 pruned once 8 was complete
    at_8 = run.load(published.with_name("step_00000008"), "model.pt")
    assert torch.equal(at_8["w"], torch.ones(8)) and torch.equal(at_8["tied"], torch.ones(4))  # as the tensors were at the save
    assert at_8["tied"].untyped_storage().data_ptr() == at_8["w"].untyped_storage().data_ptr()
    assert torch.equal(run.load(published.with_name("step_00000008"), "rank_00000.pt")["x"], torch.ones(8))
    assert torch.equal(run.load(published, "model.pt")["w"], torch.full((8,), 5.0))


def test_the_copy_to_host_memory_keeps_shared_storages_shared(tmp_path):
    """What a background save copies: tensors that share a storage (tied weights, views of a flat buffer) share
    its one copy, so torch.save writes the same file as of the originals; the originals may change afterwards."""
    weights = torch.arange(4096.0)
    state = {"w": weights, "tied": weights[:1024], "nested": [(weights, 3)], "step": 8}
    torch.save(state, tmp_path / "original.pt")
    copied = host_copy(state)
    weights.zero_()
    assert torch.equal(copied["w"], torch.arange(4096.0)) and torch.equal(copied["tied"], torch.arange(1024.0)) and copied["step"] == 8
    assert copied["tied"].untyped_storage().data_ptr() == copied["w"].untyped_storage().data_ptr() == copied["nested"][0][0].untyped_storage().data_ptr()
    torch.save(copied, tmp_path / "copy.pt")
    assert abs((tmp_path / "copy.pt").stat().st_size - (tmp_path / "original.pt").stat().st_size) < 1024  # a second storage: 4 KB more


def test_saving_a_step_again_replaces_it_whole(tmp_path):
    run = RunDirectory(tmp_path)
    _save(run, 4)
    again = run.save(4, 0, 1, {"x": torch.zeros(3)}, {"model.pt": {}}, keep=5)
    assert [p.name for p in run.checkpoints.iterdir()] == ["step_00000004"]
    assert torch.equal(run.load(again, "rank_00000.pt")["x"], torch.zeros(3)) and run.latest() == again


def test_the_lock_refuses_a_second_job_until_closed(tmp_path):
    first, second = RunDirectory(tmp_path / "run"), RunDirectory(tmp_path / "run")
    first.prepare(None, False, 1, 0)
    (first.path / "notes.txt").write_text("keep")
    holder = f"pid {os.getpid()} on host {socket.gethostname()}"
    for resume, overwrite in ((None, False), ("auto", False), (None, True)):
        with pytest.raises(UserError, match=f"^run directory .*run is in use by another job \\({holder}\\)\\.$"):
            second.prepare(resume, overwrite, 1, 0)
    with pytest.raises(UserError, match="in use by another job"):
        second.check("auto", False, 1)  # the launcher's read-only check refuses too
    assert (first.path / "notes.txt").read_text() == "keep"  # --overwrite by the second job emptied nothing
    first.prepare(None, True, 1, 0)  # the holder may empty it: the lock survives
    assert [p.name for p in first.path.iterdir()] == [".lock"]
    with pytest.raises(UserError, match="in use by another job"):
        second.prepare(None, True, 1, 0)
    first.close()
    second.prepare(None, False, 1, 0)
    second.close()
    second.close()  # idempotent


def test_a_refused_run_leaves_no_directory_or_lock(tmp_path):
    run = RunDirectory(tmp_path / "new")
    with pytest.raises(UserError, match="no such checkpoint directory"):
        run.prepare(str(tmp_path / "nowhere"), False, 1, 0)
    assert not run.path.exists() and run._lock is None


def test_the_lock_of_a_dead_process_does_not_block(tmp_path):
    path = tmp_path / "run"
    code = (
        "import sys; from zoa_train.train.rundir import RunDirectory\n"
        f"run = RunDirectory({str(path)!r}); run.prepare(None, False, 1, 0)\n"
        "print('locked', flush=True); sys.stdin.read()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(UserError, match=f"in use by another job \\(pid {proc.pid} on host "):
            RunDirectory(path).prepare("auto", False, 1, 0)
    finally:
        proc.kill()
        proc.wait()
    assert str(proc.pid) in (path / ".lock").read_text()  # the stale file is still there
    run = RunDirectory(path)
    assert run.prepare("auto", False, 1, 0) is None  # and does not block
    assert (path / ".lock").read_text().split()[0] == str(os.getpid())
    run.close()


def _two_ranks(rank, world_size, path):
    """Each rank's own files are hashed by that rank; a damaged rank file and a failed write on one
    rank give the same outcome on every rank. Step 4 and the failed step 6 are written in the background,
    their collectives (DCP's and the agreement's) beside the training thread's on the default group."""
    import torch.distributed as dist

    run = RunDirectory(path)
    out = {"start": run.prepare(None, False, world_size, rank)}
    shards = {"model": {f"node_{rank}": {"w": torch.full((8,), float(rank))}}}  # each rank its own, as inside a local-step period
    run.save(2, rank, world_size, {"r": torch.full((16,), float(rank))}, {"model.pt": {"w": torch.ones(2)}} if rank == 0 else {}, keep=5)
    run.save_in_background(
        4, rank, world_size, {"r": torch.full((16,), float(rank))}, {"model.pt": {"w": torch.ones(2)}} if rank == 0 else {}, 5, sharded=shards
    )
    total = torch.zeros(1)
    for _ in range(200):  # training's collectives meanwhile
        step = torch.ones(1)
        dist.all_reduce(step)
        total += step
    out["all_reduced"] = total.item()
    run.wait_for_save()
    if rank == 0:
        out["manifest"] = sorted(read_manifest(run.checkpoints / "step_00000004"))
        out["sidecars"] = sorted(p.name for p in run.checkpoints.rglob("*.sha256"))
        out["verified"] = verify_checkpoint(run.checkpoints / "step_00000004")
        _flip_byte(run.checkpoints / "step_00000004" / "rank_00001.pt")
    dist.barrier()
    out["resumed"] = run.prepare("auto", False, world_size, rank).name
    original = rundir.save_file

    def full_on_rank_1(obj, file):
        if rank == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return original(obj, file)

    rundir.save_file = full_on_rank_1
    try:
        run.save_in_background(6, rank, world_size, {}, {}, keep=1, sharded=shards)
        run.wait_for_save()
    except UserError as e:
        out["error"] = str(e)
    rundir.save_file = original
    out["left"] = sorted(p.name for p in run.checkpoints.iterdir())
    run.close()
    return out


@pytest.mark.slow
def test_two_ranks_agree_on_damage_and_on_a_failed_save(tmp_path):
    from distributed_harness import run_ranks

    out0, out1 = run_ranks(_two_ranks, 2, str(tmp_path / "run"), timeout=120)
    assert out0["manifest"] == ["model.pt", "model/.metadata", "model/__0_0.distcp", "model/__1_0.distcp", "rank_00000.pt", "rank_00001.pt"]
    assert out0["sidecars"] == [] and out0["verified"] is None and out0["all_reduced"] == out1["all_reduced"] == 400
    whole = read_whole(tmp_path / "run" / "checkpoints" / "step_00000004" / "model")  # one process, no group: every rank's shards
    assert torch.equal(whole["node_0"]["w"], torch.zeros(8)) and torch.equal(whole["node_1"]["w"], torch.ones(8))
    assert out0["resumed"] == out1["resumed"] == "step_00000002"
    assert "could not write checkpoint step_00000006" in out0["error"] and out0["error"] == out1["error"]
    assert out0["left"] == out1["left"] == ["step_00000002", "step_00000004"]


def _fill_the_disk(rank, world_size, path, sharded):
    """Step 1 fits on the small disk; step 2's rank-1 file does not (or, `sharded`, its shards, written in the background)."""
    run = RunDirectory(path)
    run.prepare(None, False, world_size, rank)
    run.save(1, rank, world_size, {"r": torch.zeros(1 << 16)}, {"model.pt": {"w": torch.ones(2)}} if rank == 0 else {}, keep=2)
    free = shutil.disk_usage(path).free
    big = torch.zeros((1 << 21) if rank == 1 else 1)
    try:
        if sharded:
            run.save_in_background(2, rank, world_size, {}, {}, 2, sharded={"model": {f"node_{rank}": {"w": big}}})
            run.wait_for_save()
        else:
            run.save(2, rank, world_size, {"r": big}, {"model.pt": {"w": torch.ones(2)}} if rank == 0 else {}, keep=2)
        error = None
    except UserError as e:
        error = str(e)
    left = sorted(p.name for p in run.checkpoints.iterdir())
    run.close()
    return {"error": error, "left": left, "free_before": free, "free_after": shutil.disk_usage(path).free}


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs (root can mount one, as CI runs the tests); skipped where it cannot be mounted."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "--lazy", str(mount)], check=True)


@pytest.mark.slow
@pytest.mark.parametrize("sharded", [False, True], ids=["rank_file", "shards_in_background"])
def test_a_full_disk_fails_the_checkpoint_in_one_sentence_on_every_rank_and_keeps_the_earlier_one(small_disk, sharded):
    from distributed_harness import run_ranks

    out0, out1 = run_ranks(_fill_the_disk, 2, str(small_disk / "run"), sharded, timeout=120)
    checkpoints = small_disk / "run" / "checkpoints"
    assert out0["error"] == out1["error"] and out0["error"] is not None
    assert out0["error"].startswith(f"could not write checkpoint step_00000002 under {checkpoints}: no space is left on the disk mounted at {small_disk} (")
    assert "\n" not in out0["error"] and "enforce fail" not in out0["error"]
    assert out0["left"] == out1["left"] == ["step_00000001"]  # the staged step_00000002.tmp is gone
    assert out0["free_after"] == out0["free_before"]  # everything the failed write took is given back
    assert verify_checkpoint(checkpoints / "step_00000001") is None
