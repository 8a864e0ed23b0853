"""The task-agnostic trainer end to end: the image task on the bundled digits with each optimizer,
exact resume mid-epoch, validation on its own schedule, and the run directory under torchrun."""

import json
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TORCHRUN, refused, zoa

pytestmark = pytest.mark.slow  # every test trains or starts ranks

IMAGE_FIELDS = {"step", "loss", "lr", "images_per_s", "bits_per_param", "rounds", "bytes_sent", "variance_updates", "wall_time"}


def sets(*pairs: str) -> list[str]:
    return [arg for pair in pairs for arg in ("--set", pair)]


def tiny_images(cache_dir: Path, steps: int, *extra: str) -> list[str]:
    return sets(
        f"train.steps={steps}",
        "train.global_batch_size=32",
        "train.micro_batch_size=16",
        "train.log_every=1",
        "train.val_every=0",
        "train.val_batches=2",
        "logging.wandb=disabled",
        "logging.tensorboard=false",
        f"data.cache_dir={cache_dir}",
        *extra,
    )


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("optimizer", ["adam", "onebit_adam", "zero_one_adam"])
def test_resnet18_tiny_trains_with_each_optimizer(tmp_path, cache_dir, optimizer):
    run_dir = tmp_path / optimizer
    done = zoa(
        "run",
        "recipes/resnet18_tiny.yaml",
        "--out",
        str(run_dir),
        *tiny_images(cache_dir, 4, f"optimizer.name={optimizer}", "optimizer.freeze_step=2", "optimizer.var_freeze_step=2", "train.val_batches=100"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(IMAGE_FIELDS <= set(r) for r in records)
    last = records[-1]
    assert 0 <= last["val_top1"] <= last["val_top5"] <= 1 and last["val_loss"] > 0
    assert json.loads((run_dir / "classes.json").read_text()) == [str(d) for d in range(10)]
    model = torch.load(run_dir / "checkpoints" / "step_00000004" / "model.pt")
    assert model["fc.weight"].shape == (10, 512)
    if optimizer != "adam":
        # The last validation covered the whole set with the final, synchronised model (BatchNorm
        # statistics included), which is what the checkpoint holds: eval must agree exactly.
        scores = tmp_path / "eval.json"
        done = zoa(
            "eval",
            "imagenet",
            "--checkpoint",
            str(run_dir),
            "--data",
            str(cache_dir / "images" / "digits32" / "val"),
            "--batch-size",
            "16",
            "--workers",
            "0",
            "--json",
            str(scores),
        )
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(scores.read_text())
        assert result["images"] == 360 and result["model"] == "resnet18"
        assert result["top1"] == last["val_top1"] and result["top5"] == last["val_top5"]
        assert result["loss"] == pytest.approx(last["val_loss"], rel=1e-5)


def test_resnet18_tiny_resumes_exactly_mid_epoch_inside_a_local_period(tmp_path, cache_dir):
    # 44 batches per epoch: the checkpoint at step 3 is mid-epoch, inside a 3-step local period,
    # and one decoding worker per rank must not change which images a resumed run sees.
    knobs = tiny_images(
        cache_dir,
        6,
        "train.checkpoint_every=3",
        "optimizer.var_freeze_step=1",
        "optimizer.local_steps=fixed",
        "optimizer.local_step_interval=4",
        "data.workers=1",
    )
    first, second = tmp_path / "first", tmp_path / "second"
    done = zoa("run", "recipes/resnet18_tiny.yaml", "--out", str(first), *knobs)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = zoa("run", "recipes/resnet18_tiny.yaml", "--out", str(second), "--resume", str(first / "checkpoints" / "step_00000003"), *knobs)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["loss"] for r in metrics(second)] == [r["loss"] for r in metrics(first)[3:]]
    a = torch.load(first / "checkpoints" / "step_00000006" / "model.pt")
    b = torch.load(second / "checkpoints" / "step_00000006" / "model.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "model" in torch.load(first / "checkpoints" / "step_00000003" / "rank_00001.pt", weights_only=False)  # ranks differed there


def test_validation_fires_on_its_own_schedule(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    done = zoa(
        "run",
        "recipes/gpt2_tiny.yaml",
        "--out",
        str(run_dir),
        *sets(
            "train.steps=6",
            "train.log_every=4",
            "train.val_every=3",
            "train.val_batches=1",
            "train.checkpoint_every=0",
            "logging.wandb=disabled",
            f"data.cache_dir={cache_dir}",
        ),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = metrics(run_dir)
    assert [r["step"] for r in records] == [3, 4, 6]
    assert ["val_loss" in r for r in records] == [True, False, True]
    assert ["loss" in r for r in records] == [False, True, True]


def test_run_directory_rules_hold_under_torchrun(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    knobs = sets(
        "train.steps=2",
        "train.log_every=1",
        "train.val_every=0",
        "train.val_batches=1",
        "train.checkpoint_every=0",
        "logging.wandb=disabled",
        f"data.cache_dir={cache_dir}",
    )
    first = zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(run_dir), *knobs, command=TORCHRUN)
    assert first.returncode == 0, first.stderr[-3000:]
    (run_dir / "notes.txt").write_text("mine")

    taken = zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(run_dir), *knobs, command=TORCHRUN)
    assert taken.returncode != 0 and "is not empty" in taken.stderr
    assert (run_dir / "notes.txt").read_text() == "mine" and [r["step"] for r in metrics(run_dir)] == [1, 2]

    again = zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(run_dir), "--overwrite", *knobs, command=TORCHRUN)
    assert again.returncode == 0, again.stderr[-3000:]
    assert not (run_dir / "notes.txt").exists()
    assert [r["step"] for r in metrics(run_dir)] == [1, 2]  # a new metrics.jsonl, not appended to


def image_tree(root: Path, counts: dict[str, int], corrupt: str | None = None) -> Path:
    """train/ and val/ with `counts` 8x8 images per class; `corrupt` names one train file to garble."""
    from PIL import Image

    for split in ("train", "val"):
        for name, count in counts.items():
            (root / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(count):
                Image.new("RGB", (8, 8), (i * 7 % 256, 0, 0)).save(root / split / name / f"{i}.png")
    if corrupt:
        (root / "train" / corrupt).write_bytes(b"this is not a PNG")
    return root


BAD_IMAGE_DATA = {
    "missing root": (lambda root: root / "absent", "absent/train does not exist"),
    "empty class folder": (lambda root: image_tree(root, {"a": 16, "b": 0}), "b has no image files"),
    "no images": (lambda root: image_tree(root, {"a": 0, "b": 0}), "has no image files in its class subfolders"),
    "corrupt file met in training": (lambda root: image_tree(root, {"a": 16, "b": 16}, corrupt="b/5.png"), "b/5.png is corrupt or unreadable"),
}


@pytest.mark.parametrize("case", sorted(BAD_IMAGE_DATA))
def test_bad_image_data_stops_the_run_with_one_sentence(tmp_path, case):
    make, message = BAD_IMAGE_DATA[case]
    root = make(tmp_path / "images")
    # 32 images per epoch and a global batch of 32: the first step reads every image, on both ranks.
    done = zoa(
        "run",
        "recipes/resnet18_tiny.yaml",
        "--out",
        str(tmp_path / "run"),
        *sets(
            "data.source=folder",
            f"data.root={root}",
            "data.workers=1",
            "train.steps=2",
            "train.val_every=0",
            "train.global_batch_size=32",
            "train.micro_batch_size=16",
            "logging.wandb=disabled",
            "logging.tensorboard=false",
        ),
    )
    refused(done, message, alone=False)


def _dropout_outputs(rank, world_size, run_dir, cache_dir):
    from zoa_train.config import load_recipe
    from zoa_train.train.trainer import Trainer

    recipe = load_recipe(
        ROOT / "recipes" / "gpt2_tiny.yaml", ["model.dropout=0.5", "logging.wandb=disabled", "logging.tensorboard=false", f"data.cache_dir={cache_dir}"]
    )
    trainer = Trainer(recipe, Path(run_dir), None, overwrite=True)
    try:
        trainer.model.train()
        batch = {"input_ids": torch.arange(32).view(2, 16)}  # the same batch on both ranks
        with torch.no_grad():
            out = trainer.model(**batch).logits
        return out, [p.detach().clone() for p in trainer.model.parameters()]
    finally:
        trainer.close()


def test_each_rank_draws_its_own_dropout_masks_from_the_same_model(tmp_path, cache_dir):
    from distributed_harness import run_ranks

    (out0, params0), (out1, params1) = run_ranks(_dropout_outputs, 2, str(tmp_path / "run"), str(cache_dir))
    assert all(torch.equal(a, b) for a, b in zip(params0, params1))
    assert not torch.allclose(out0, out1)
