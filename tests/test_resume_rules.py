"""A resume trains with what its recipe says (issue 49): every key of the schema, changed on a resume, is
either refused in one sentence or applied, said in one line, recorded in recipe.yaml and
recipe_changes.yaml, and moves the training as the new value says. The keys come from the schema (every
registered optimizer's and model family's included), not from a list written here; what is written here
is how to change a key so that its effect shows within three steps, and which keys leave the training
alone by design (validation, logging, the machine)."""

import dataclasses
import shutil
import types
import typing
from pathlib import Path
from typing import Literal

import pytest
import yaml
from conftest import one_sentence, zoa_here

from zoa_train import config
from zoa_train.config import Recipe, recipe_from_dict
from zoa_train.errors import UserError
from zoa_train.optim import registry
from zoa_train.train import resume_rules

RECIPE = str(Path(__file__).resolve().parents[1] / "recipes" / "gpt2_tiny.yaml")
CHECKPOINT = 2  # the resumed runs start from the checkpoint of step 2 and train steps 3-5


def schema_types() -> dict[str, object]:
    """Every key of the schema, dotted, with its annotation."""
    made = {config.OptimizerConfig: config.optimizer_section, config.ModelConfig: config.model_section}
    found = {}
    for section in dataclasses.fields(Recipe):
        kind = typing.get_type_hints(Recipe)[section.name]
        kind = made[kind]() if kind in made else kind
        if dataclasses.is_dataclass(kind):
            hints = typing.get_type_hints(kind)
            found |= {f"{section.name}.{f.name}": hints[f.name] for f in dataclasses.fields(kind)}
        else:
            found[section.name] = kind
    return found


# How to change a key so that its effect shows in steps 3-5 of the base runs below, where the schema's
# type alone would not say (a file that exists, a module that imports, a schedule that decays now).
PROBES = {
    "data.validation_files": [str(Path(__file__).parent / "data" / "corpus" / "validation.txt")],
    "imports": ["zoa_train.comm"],
    "optimizer.var_freeze_step": 3,
    "optimizer.var_update_scaler": 2,
    "optimizer.local_step_interval": 1,
    "optimizer.local_steps": "steps",
    "optimizer.local_step_scaler": 1,
    "optimizer.local_step_clip": 1,
    "optimizer.update_clip": 1e-3,
    "optimizer.freeze_step": 3,
    "optimizer.sync_every": 3,
    "optimizer.outer_lr": 0.3,
    "optimizer.topk_density": 0.5,
    "schedule.min_lr": 1e-5,
    "train.global_batch_size": 64,
    "train.micro_batch_size": 8,
    "train.backend": "gloo",
    "train.nproc": 1,
    "comm.ranks_per_node": 1,
}

# Keys that by design leave the model's training as it was (the final model is the same to the bit):
# "validates" changes the validation loss only, "none" changes neither (a cadence, a place, the machine).
LEAVES_TRAINING = {
    "data.validation_files": "validates",
    "train.val_batches": "validates",
    **dict.fromkeys(
        [
            "data.cache_dir",
            "data.workers",
            "train.steps",
            "train.skip_nonfinite",
            "train.nproc",
            "train.backend",
            "train.timeout_s",
            "train.log_every",
            "train.val_every",
            "train.checkpoint_every",
            "train.keep_checkpoints",
            "comm.topology",
            "comm.ranks_per_node",
            "comm.kernels",
            "logging.wandb",
            "logging.tensorboard",
            "logging.project",
            "imports",
        ],
        "none",
    ),
    # image augmentation in a language-model run; min_lr in an exponential schedule (cosine's floor)
    **dict.fromkeys(["data.crop_size", "data.resize_size", "data.min_crop_scale", "data.hflip", "schedule.min_lr"], "none"),
    # the same samples in micro-batches of another size: the same sums, rounded in another order
    "train.micro_batch_size": "close",
}


def probe(key: str, value, kind):
    """A value of `key` other than `value`, of the schema's type `kind`."""
    if PROBES.get(key, value) != value:
        return PROBES[key]
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        inner = next(a for a in args if a is not type(None))
        return probe(key, value, inner) if value is not None else {int: 1, float: 0.5, str: "changed"}.get(inner, [])
    if origin is Literal:
        return next(a for a in args if a != value)
    if origin in (list, tuple):
        return [v * 0.99 for v in value] if origin is tuple else [*value, "changed"]
    if kind is bool:
        return not value
    if kind is int:
        return value + 1
    if kind is float:
        return value * 0.5 if value else 0.5
    return f"{value}-changed"


def change(key: str, base: dict, optimizer: str, step: int = CHECKPOINT):
    """The ResumeChange of `key` to its probe in a run of `optimizer` (None where the recipe refuses the value)."""
    flat = resume_rules.flat(base)
    now = probe(key, flat[key], schema_types()[key])
    data = yaml.safe_load(yaml.safe_dump(base))
    section, _, name = key.rpartition(".")
    (data[section] if section else data)[name] = now
    if key != "optimizer.name":
        data["optimizer"]["name"] = optimizer
    try:
        recipe = recipe_from_dict(data)
    except UserError:
        return None
    return next(c for c in resume_rules.changes(base, recipe, step) if c.key == key)


def base_recipe() -> dict:
    return config.load_recipe(RECIPE).to_dict()


@pytest.mark.parametrize("optimizer", registry.names())
def test_every_key_of_the_schema_has_a_rule_for_every_optimizer(optimizer):
    recipe = recipe_from_dict({**base_recipe(), "optimizer": {**base_recipe()["optimizer"], "name": optimizer}})
    unknown = [k for k in schema_types() if isinstance(r := resume_rules.rule(k, recipe), str) and ("does not know" in r or "does not say" in r)]
    assert not unknown, f"keys without a resume rule: {unknown}"


@pytest.mark.parametrize("optimizer", registry.names())
def test_every_changed_key_is_refused_in_one_sentence_or_applied_in_one_line(optimizer):
    base = base_recipe()
    for key in schema_types():
        found = change(key, base, optimizer)
        if found is None:  # the recipe itself refuses the value (another family's knob, a file that is not there)
            continue
        try:
            resume_rules.judge(Path("run/checkpoints/step_00000002"), [found])
        except UserError as e:
            one_sentence(str(e), key, f"resume with {key} {resume_rules.show(found.was)}")
            continue
        (line,) = resume_rules.applied([found])
        assert line.startswith(f"resuming with {key} {resume_rules.show(found.now)}, was {resume_rules.show(found.was)} (from step 3"), line


def test_a_frozen_variance_refuses_a_later_freeze_step_and_takes_an_earlier_one():
    base = base_recipe()  # var_freeze_step and freeze_step 240
    for key, optimizer in (("optimizer.var_freeze_step", "zero_one_adam"), ("optimizer.freeze_step", "onebit_adam")):
        data = yaml.safe_load(yaml.safe_dump(base))
        data["optimizer"] |= {"name": optimizer, key.split(".")[1]: 500}
        later = next(c for c in resume_rules.changes(base, recipe_from_dict(data), 300) if c.key == key)
        with pytest.raises(UserError, match="the variance froze at step 240"):
            resume_rules.judge(Path("ckpt"), [later])
        resume_rules.judge(Path("ckpt"), [dataclasses.replace(later, step=100)])  # before the freeze: either way
        resume_rules.judge(Path("ckpt"), [dataclasses.replace(later, now=280)])  # frozen, and stays frozen


# ---- end to end: each applied key moves the training as its value says -----------------------------

# The base runs: 5 steps, a checkpoint at step 2; a schedule and 0/1 Adam settings under which each
# knob acts in steps 3-5 (variance updates at steps 0, 1 and 3, the freeze at 4, local steps after it).
BASE = [
    "train.steps=5",
    f"train.checkpoint_every={CHECKPOINT}",
    "train.log_every=1",
    "train.val_every=0",
    "train.val_batches=1",
    "logging.wandb=disabled",
    "logging.tensorboard=false",
    "schedule.warmup_steps=1",
    "schedule.decay_every=1",
    "optimizer.var_freeze_step=4",
    "optimizer.var_update_scaler=1",
    "optimizer.local_steps=fixed",
    "optimizer.local_step_interval=2",
    "optimizer.freeze_step=4",
    "optimizer.sync_every=2",
    "optimizer.outer_collective=topk",
]
OWN_RUN = {"onebit_adam", "powersgd", "diloco"}  # their own knobs are tried in a run of their own


@pytest.fixture(scope="module")
def one_rank_env():
    """This process as the only rank of a launcher's group: `zoa-train run` trains here."""
    import torch
    from distributed_harness import free_port

    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        yield
    torch.set_num_threads(threads)


def train(capsys, run_dir: Path, cache_dir: Path, *settings: str, resume: str | None = None):
    args = ["run", RECIPE, "--out", str(run_dir), *[a for s in (*BASE, f"data.cache_dir={cache_dir}", *settings) for a in ("--set", s)]]
    return zoa_here(capsys, *args, *(["--resume", resume] if resume else []))


def final(run_dir: Path) -> dict:
    import torch

    last = yaml.safe_load((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    model = torch.load(run_dir / "checkpoints" / "step_00000005" / "model.pt", weights_only=True)
    return {"val_loss": last["val_loss"], "loss": last["loss"], "model": model}


@pytest.fixture(scope="module")
def base_runs(tmp_path_factory, cache_dir, one_rank_env):
    """One finished base run per optimizer whose knobs are tried: its directory and final figures."""
    import _pytest.capture

    runs = {}
    capture = _pytest.capture.CaptureFixture(_pytest.capture.SysCapture, request=None, _ispytest=True)  # module-scoped capsys
    capture._start()
    try:
        for optimizer in ("zero_one_adam", *sorted(OWN_RUN)):
            run_dir = tmp_path_factory.mktemp("resume-base") / optimizer
            done = train(capture, run_dir, cache_dir, f"optimizer.name={optimizer}")
            assert done.returncode == 0, done.stderr[-3000:]
            runs[optimizer] = (run_dir, final(run_dir))
    finally:
        capture.close()
    return runs


def end_to_end_cases() -> list:
    """(optimizer of the run, key): the run's own knobs in its own run, every other key in 0/1 Adam's."""
    cases = []
    for key in schema_types():
        section, _, name = key.partition(".")
        owner = next(
            (o for o in sorted(OWN_RUN) if section == "optimizer" and registry.uses_knob(o, name) and not registry.uses_knob("zero_one_adam", name)), None
        )
        cases.append(pytest.param(owner or "zero_one_adam", key, id=key))
    return cases


def same(a, b) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow  # a resumed run of three steps per key (about 1.5 s each, in this process)
@pytest.mark.parametrize("optimizer, key", end_to_end_cases())
def test_a_changed_key_is_refused_or_moves_the_training_as_it_says(base_runs, tmp_path, cache_dir, capsys, optimizer, key):
    base_dir, before = base_runs[optimizer]
    recipe = yaml.safe_load((base_dir / "recipe.yaml").read_text())
    found = change(key, recipe, optimizer)
    if found is None:
        pytest.skip(f"the recipe refuses {key} {probe(key, resume_rules.flat(recipe)[key], schema_types()[key])} in a {optimizer} run")
    run_dir = tmp_path / "run"
    shutil.copytree(base_dir, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")
    shutil.rmtree(run_dir / "checkpoints" / "step_00000005")
    value = yaml.safe_dump(found.now, default_flow_style=True).strip().removesuffix("...").strip()
    done = train(capsys, run_dir, cache_dir, f"optimizer.name={optimizer}", f"{key}={value}", resume=str(run_dir / "checkpoints" / "step_00000002"))
    if done.returncode == 2:  # refused: by its rule, or (a key of the 1-bit layout) by the layout it gives
        assert key in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
        assert not (run_dir / "checkpoints" / "step_00000005").exists()
        return
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resuming with {key} {resume_rules.show(found.now)}, was {resume_rules.show(found.was)} (from step 3" in done.stdout
    assert resume_rules.flat(yaml.safe_load((run_dir / "recipe.yaml").read_text()))[key] == found.now
    assert yaml.safe_load((run_dir / resume_rules.CHANGES).read_text()) == [found.record()]
    after = final(run_dir)
    effect = LEAVES_TRAINING.get(key, "trains")
    if effect == "trains":
        assert after["val_loss"] != before["val_loss"] and not same(after["model"], before["model"]), f"{key} {found.now} did not change the training"
    elif effect == "close":
        assert after["val_loss"] == pytest.approx(before["val_loss"], rel=1e-4)
    else:
        assert same(after["model"], before["model"]), f"{key} {found.now} changed the model"
        assert (after["val_loss"] != before["val_loss"]) == (effect == "validates"), (key, after["val_loss"], before["val_loss"])
