"""A resume trains with what its recipe says (issue 49): every key of the schema, changed on a resume, is
either refused in one sentence or applied, said in one line, recorded in recipe.yaml and
recipe_changes.yaml, and moves the training as the new value says. The keys come from the schema (every
registered optimizer's and model family's included), not from a list written here; what is written here
is how to change a key so that its effect shows within three steps, and which keys leave the training
alone by design (validation, logging, the machine)."""

import copy
import dataclasses
import shutil
import types
import typing
from pathlib import Path
from typing import Literal

import pytest
import torch
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
    "optimizer.var_freeze_step": 4,
    "optimizer.var_update_scaler": 1,
    "optimizer.update_clip": 1e-3,
    "optimizer.freeze_step": 3,
    "optimizer.sync_every": 3,
    "optimizer.outer_lr": 0.3,
    "schedule.min_lr": 1e-5,
    "train.global_batch_size": 64,
    "train.micro_batch_size": 8,
    "train.backend": "gloo",
    "train.nproc": 1,
    "comm.ranks_per_node": 1,
    "train.grad_clip_rule": "bucket",  # auto is the global rule without comm.overlap
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
            "data.tokenize_workers",  # the same token shards, built by more or fewer processes
            "train.skip_nonfinite",
            "train.nproc",
            "train.backend",
            "train.timeout_s",
            "train.log_every",
            "train.val_every",
            "train.checkpoint_every",
            "train.keep_checkpoints",
            "train.elastic",  # one rank's parameters never differ: its checkpoints are where they were
            "train.activation_checkpointing",  # the same arithmetic, recomputed in backward
            "train.peak_tflops",
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
    # the same samples in micro-batches of another size: the same sums, rounded in another order (the
    # validation batches are micro-batches too: another validation loss)
    "train.micro_batch_size": "close",
    "train.steps": "longer",  # the same steps, and more of them
    "train.compile": "close",  # the same arithmetic, fused by the compiler
    # what acts only between ranks leaves a one-rank run alone: test_knobs_that_act_between_ranks_take_effect_on_resume
    **dict.fromkeys(
        [
            "optimizer.allreduce_dtype",
            "optimizer.local_steps",
            "optimizer.local_step_clip",
            "optimizer.local_step_scaler",
            "optimizer.local_step_interval",
            "optimizer.topk_density",
            "optimizer.topk_error_decay",
            "optimizer.sync_delay",
        ],
        "between ranks",
    ),
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
    found = changes_of([key], base, optimizer, step)
    return found[0] if found else None


def changes_of(keys: list[str], base: dict, optimizer: str, step: int = CHECKPOINT) -> list:
    """The ResumeChanges of `keys`, each to its probe, in a run of `optimizer` ([] where the recipe refuses a value)."""
    flat = resume_rules.flat(base)
    data = yaml.safe_load(yaml.safe_dump(base))
    for key in keys:
        section, _, name = key.rpartition(".")
        (data[section] if section else data)[name] = probe(key, flat[key], schema_types()[key])
    if "optimizer.name" not in keys:
        data["optimizer"]["name"] = optimizer
    try:
        recipe = recipe_from_dict(data)
    except UserError:
        return []
    found = {c.key: c for c in resume_rules.changes(base, recipe, step)}
    return [found[key] for key in keys]


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

# The base runs: 5 steps, a checkpoint at step 2; a schedule and settings under which each knob acts in
# steps 3-5 (0/1 Adam's variance updates at steps 0, 1, 2 and 4 before its freeze at 5; 1-bit Adam's and
# PowerSGD's compression from step 4; DiLoCo's outer steps every 2).
BASE = [
    "train.steps=5",
    f"train.checkpoint_every={CHECKPOINT}",
    "train.keep_checkpoints=3",
    "train.log_every=1",
    "train.val_every=0",
    "train.val_batches=1",
    "logging.wandb=disabled",
    "logging.tensorboard=false",
    "schedule.warmup_steps=1",
    "schedule.decay_every=1",
    "optimizer.var_freeze_step=5",
    "optimizer.var_update_scaler=2",
    "optimizer.freeze_step=4",
    "optimizer.sync_every=2",
    "optimizer.outer_collective=topk",
]
OWN_RUN = {"onebit_adam", "powersgd", "diloco"}  # their own knobs are tried in a run of their own


@pytest.fixture(scope="module")
def one_rank_env():
    """This process as the only rank of a launcher's group: `zoa-train run` trains here."""
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
    records = [yaml.safe_load(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    model = torch.load(run_dir / "checkpoints" / "step_00000005" / "model.pt", weights_only=True)
    losses = [(r["step"], r["loss"]) for r in records if "loss" in r]  # a record may hold validation alone (train.val_every)
    return {"val_loss": records[-1]["val_loss"], "loss": losses[-1][1], "model": model, "losses": losses, "steps": len(losses)}


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
    """(optimizer of the run, keys) for the keys that a base run takes on a resume (those its rule refuses
    are refused before anything loads: the test above holds their sentences, tests/test_bad_input.py the
    directory left as it was): the run's own knobs in its own run, every other key in 0/1 Adam's; each
    key that moves the training alone, those that leave it alone all at once in each run."""
    base = config.load_recipe(RECIPE, BASE).to_dict()
    cases, alone = [], {}
    for key in schema_types():
        section, _, name = key.partition(".")
        own = section == "optimizer" and not registry.uses_knob("zero_one_adam", name)
        for optimizer in [o for o in sorted(OWN_RUN) if registry.uses_knob(o, name)] if own else ["zero_one_adam"]:
            found = change(key, base, optimizer)
            if found is None:
                continue  # the recipe refuses the value in such a run (another family's knob): nothing to resume
            try:
                resume_rules.judge(Path("ckpt"), [found])
            except UserError:
                continue
            if LEAVES_TRAINING.get(key) in ("none", "between ranks"):
                alone.setdefault(optimizer, []).append(key)
            else:
                cases.append(pytest.param(optimizer, (key,), id=f"{key}-{optimizer}" if own else key))
    return cases + [pytest.param(o, tuple(keys), id=f"leaving-the-training-alone-{o}") for o, keys in alone.items()]


def same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow  # a resumed run of three steps per key (about 1.5 s each, in this process)
@pytest.mark.parametrize("optimizer, keys", end_to_end_cases())
def test_a_changed_key_is_refused_or_moves_the_training_as_it_says(base_runs, tmp_path, cache_dir, capsys, optimizer, keys):
    base_dir, before = base_runs[optimizer]
    found = changes_of(list(keys), yaml.safe_load((base_dir / "recipe.yaml").read_text()), optimizer)
    run_dir = tmp_path / "run"
    shutil.copytree(base_dir, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")
    shutil.rmtree(run_dir / "checkpoints" / "step_00000005")
    settings = [f"{c.key}={yaml.safe_dump(c.now, default_flow_style=True).strip().removesuffix('...').strip()}" for c in found]
    done = train(capsys, run_dir, cache_dir, f"optimizer.name={optimizer}", *settings, resume=str(run_dir / "checkpoints" / "step_00000002"))
    if done.returncode == 2 and len(keys) == 1:  # refused: a key of the 1-bit layout, by the layout it gives
        assert keys[0] in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
        assert not (run_dir / "checkpoints" / "step_00000005").exists()
        return
    assert done.returncode == 0, done.stderr[-3000:]
    for c in found:
        assert f"resuming with {c.key} {resume_rules.show(c.now)}, was {resume_rules.show(c.was)} (from step 3" in done.stdout
        assert resume_rules.flat(yaml.safe_load((run_dir / "recipe.yaml").read_text()))[c.key] == c.now
    assert yaml.safe_load((run_dir / resume_rules.CHANGES).read_text()) == [c.record() for c in found]
    effect = "none" if len(keys) > 1 else LEAVES_TRAINING.get(keys[0], "trains")
    if effect == "longer":
        losses = [(r["step"], r["loss"]) for r in map(yaml.safe_load, (run_dir / "metrics.jsonl").read_text().splitlines())]
        assert losses[: before["steps"]] == before["losses"] and losses[-1][0] == found[0].now
        return
    after = final(run_dir)
    if effect == "trains":
        assert after["val_loss"] != before["val_loss"] and not same(after["model"], before["model"]), f"{keys} {found[0].now} did not change the training"
    elif effect == "close":
        assert after["loss"] == pytest.approx(before["loss"], rel=1e-5)
        assert all(torch.allclose(after["model"][k], before["model"][k], atol=1e-5) for k in before["model"])
    else:  # none, validates (and on one rank, what acts between ranks)
        assert same(after["model"], before["model"]), f"{keys} changed the model"
        assert (after["val_loss"] != before["val_loss"]) == (effect == "validates"), (keys, after["val_loss"], before["val_loss"])


# Knobs that act only between ranks, each changed on a resume of two ranks in one process group: a run
# of the optimizer with its base knobs, its state saved at step 3 and continued for 5 steps; resumed from
# the saved state with the same knobs it must end where it did, resumed with the changed knob elsewhere.
BETWEEN_RANKS = [
    # (optimizer, its base knobs, the knob, its new value)
    ("zero_one_adam", dict(var_freeze_step=2, local_steps="fixed", local_step_interval=2), "local_step_interval", 1),
    ("zero_one_adam", dict(var_freeze_step=2, local_steps="fixed", local_step_interval=2), "local_steps", "lr"),
    ("zero_one_adam", dict(var_freeze_step=2, local_steps="steps", local_step_scaler=1, local_step_clip=4), "local_step_clip", 1),
    ("zero_one_adam", dict(var_freeze_step=2, local_steps="steps", local_step_scaler=1, local_step_clip=4), "local_step_scaler", 100),
    ("zero_one_adam", dict(var_freeze_step=20, var_update_scaler=1, allreduce_dtype="fp32"), "allreduce_dtype", "bf16"),
    ("zero_one_adam", dict(var_freeze_step=2, local_steps="fixed", local_step_interval=2), "sync_delay", 1),
    ("diloco", dict(sync_every=2), "sync_delay", 1),
    ("diloco", dict(sync_every=2, outer_collective="topk", topk_density=0.05, topk_chunk=16), "topk_density", 0.5),
    ("diloco", dict(sync_every=2, outer_collective="topk", topk_density=0.05, topk_chunk=16), "topk_error_decay", 0.5),
]


def _resume_with_changed_knobs(rank: int, world_size: int) -> list[bool]:
    def build(optimizer: str, knobs: dict):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        section = config.optimizer_section()(name=optimizer, lr=0.05, **knobs)
        return model, registry.create(section, model, torch.device("cpu"), world_size)

    def train(model, opt, steps: int, first: int) -> None:
        for t in range(first, first + steps):
            data = torch.Generator().manual_seed(1000 * rank + t)
            x = torch.randn(32, 8, generator=data)
            model(x).sub(x[:, :4].sin()).square().mean().backward()
            opt.step()
            opt.zero_grad()

    def resumed(optimizer: str, knobs: dict, shared: dict, own: dict, saved_model: dict) -> list[torch.Tensor]:
        model, opt = build(optimizer, knobs)
        model.load_state_dict(saved_model)
        opt.load_state_dicts(shared, own)
        train(model, opt, 5, 3)
        return [p.detach().clone() for p in model.parameters()]

    moved = []
    for optimizer, knobs, knob, value in BETWEEN_RANKS:
        model, opt = build(optimizer, knobs)
        train(model, opt, 3, 0)
        saved = copy.deepcopy((opt.shared_state_dict(), opt.rank_state_dict(), model.state_dict()))  # the live tensors train on
        train(model, opt, 5, 3)
        uninterrupted = [p.detach().clone() for p in model.parameters()]
        same_knobs = resumed(optimizer, knobs, *saved)
        assert all(torch.equal(a, b) for a, b in zip(uninterrupted, same_knobs)), f"{optimizer} does not resume exactly with {knobs}"
        changed = resumed(optimizer, {**knobs, knob: value}, *saved)
        moved.append(any(not torch.equal(a, b) for a, b in zip(same_knobs, changed)))
    return moved


@pytest.mark.slow  # two ranks, one process group for every case
def test_knobs_that_act_between_ranks_take_effect_on_resume():
    from distributed_harness import run_ranks

    for rank_moved in run_ranks(_resume_with_changed_knobs, 2):
        unmoved = [f"{o} {k} {v}" for (o, _, k, v), moved in zip(BETWEEN_RANKS, rank_moved) if not moved]
        assert not unmoved, f"changed on resume without effect: {unmoved}"


def test_a_reshard_says_what_each_optimizer_keeps_and_what_starts_at_zero():
    from zoa_train.optim import OneBitAdam, ZeroOneAdam
    from zoa_train.optim.diloco import DiLoCo

    def said(cls, **kwargs) -> str:
        return cls([torch.nn.Parameter(torch.ones(4, 4))], **kwargs).resharded_state()

    assert said(ZeroOneAdam) == "parameters, momentum, variance, anchor carry over; the 1-bit error buffers start at zero"
    assert said(OneBitAdam) == "parameters, momentum, variance carry over; the 1-bit error buffers start at zero"
    assert said(DiLoCo) == "parameters, anchor, outer momentum carry over; inner momentum and inner variance start at zero"


@pytest.mark.parametrize(
    "optimizer, words",
    [
        ("diloco", "between two of DiLoCo's outer steps"),
        ("zero_one_adam", "inside a 0/1 Adam local-step period"),
        (None, "while the ranks' parameters differed"),
    ],
)
def test_a_reshard_inside_a_period_names_the_run_s_own_optimizer(tmp_path, optimizer, words):
    from zoa_train.train.rundir import check_resumable

    checkpoint = tmp_path / "step_00000004"
    checkpoint.mkdir()
    (checkpoint / "COMPLETE").write_text("step 4\nworld_size 2\nsynced 0\n")
    torch.save({"recipe": {"optimizer": {"name": optimizer}}} if optimizer else {"step": 4}, checkpoint / "trainer.pt")
    with pytest.raises(UserError, match=f"it was taken {words}"):
        check_resumable(checkpoint, 1, reshard=True)
