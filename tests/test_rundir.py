"""RunDirectory on one process: what it refuses, what it empties, trims and publishes."""

import json

import pytest
import torch

from zoa_train.errors import UserError
from zoa_train.train.rundir import RunDirectory


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


def test_prepare_empties_with_overwrite_and_trims_metrics_on_resume(tmp_path):
    run = RunDirectory(tmp_path / "run")
    run.prepare(None, False, 1, 0)
    records = [{"step": s, "loss": 1.0} for s in (1, 2, 3, 4, 5)]
    (run.path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 6, "lo')  # torn last line
    saved = run.save(3, 0, 1, {"x": torch.ones(2)}, {"model.pt": {"w": torch.zeros(1)}}, keep=2)
    assert saved.name == "step_00000003" and (saved / "COMPLETE").is_file() and not list(run.checkpoints.glob("*.tmp"))

    assert run.prepare("auto", False, 1, 0) == saved
    assert [json.loads(line)["step"] for line in (run.path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert torch.equal(run.load(saved, "rank_00000.pt")["x"], torch.ones(2))
    with pytest.raises(UserError, match="written by 1 ranks and this run has 2"):
        run.prepare("auto", False, 2, 0)

    run.prepare(None, True, 1, 0)
    assert run.path.is_dir() and not any(run.path.iterdir())


def test_save_keeps_the_newest_checkpoints(tmp_path):
    run = RunDirectory(tmp_path)
    for step in (1, 2, 3):
        run.save(step, 0, 1, {}, {}, keep=2)
    assert [p.name for p in sorted(run.checkpoints.iterdir())] == ["step_00000002", "step_00000003"]
    assert run.latest().name == "step_00000003"
