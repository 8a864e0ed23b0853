"""convert-deepspeed and from_deepspeed: the authors' BERT-Large DeepSpeed configs (DeepSpeedExamples
bing_bert, seq 128, in tests/data/deepspeed) become recipes/bert_large.yaml's optimizer, and plan gives
the same bits/param; every key that cannot map is refused in one sentence; the library classmethods
build the same optimizer as the direct constructors. No training run."""

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from conftest import refused, zoa

from zoa_train.config import load_recipe
from zoa_train.convert_deepspeed import convert, write_recipe
from zoa_train.errors import UserError
from zoa_train.optim import DataParallelAdam, OneBitAdam, ZeroOneAdam, registry
from zoa_train.plan.model import plan
from zoa_train.plan.recipe import parameter_shapes

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "deepspeed"
ZERO_ONE = DATA / "bert_large_seq128_zero_one_adam.json"
ONEBIT = DATA / "bert_large_seq128_onebit_adam.json"
# What the authors' bing_bert script sets itself (no part of a DeepSpeed config): length and lr schedule.
BERT_SCRIPT = [
    "train.steps=152500",
    "schedule.name=exponential",
    "schedule.warmup_steps=12500",
    "schedule.decay_factor=0.99",
    "schedule.decay_every=520",
]


def converted(tmp_path: Path, source: Path, overrides=BERT_SCRIPT, name: str = "converted.yaml") -> Path:
    out = tmp_path / name
    write_recipe(convert(source, "bert-large", overrides), out)
    return out


def bits_per_param(recipe) -> dict:
    o = recipe.optimizer
    shapes = parameter_shapes(recipe)
    result = plan(
        recipe.train.steps,
        recipe.lr_schedule(),
        64,
        sum(math.prod(s) for s in shapes),
        **registry.knob_values(o),
        allreduce_bits=32 if o.allreduce_dtype == "fp32" else 16,
        bandwidth_bytes_per_s=1.25e9,
        latency_s=20e-6,
        betas=o.betas,
        param_shapes=shapes,
    )
    return {name: record["bits_per_param"] for name, record in result.items()}


def test_zero_one_adam_config_becomes_bert_large_recipe(tmp_path):
    ours, theirs = load_recipe(converted(tmp_path, ZERO_ONE)), load_recipe(ROOT / "recipes" / "bert_large.yaml")
    assert ours.optimizer.name == "zero_one_adam"
    for f in [*registry.get("zero_one_adam").knobs.__dataclass_fields__, "lr", "betas", "eps", "weight_decay", "bias_correction", "allreduce_dtype"]:
        assert getattr(ours.optimizer, f) == getattr(theirs.optimizer, f), f
    assert ours.schedule == theirs.schedule
    assert (ours.train.global_batch_size, ours.train.precision, ours.train.steps) == (4096, "fp16", 152_500)
    assert ours.train.grad_clip == 1.0  # the config's gradient_clipping (bert_large.yaml turns it off)
    assert bits_per_param(ours)["zero_one_adam"] == bits_per_param(theirs)["zero_one_adam"]


def test_onebit_adam_config_plans_as_bert_large_recipe(tmp_path):
    ours = load_recipe(converted(tmp_path, ONEBIT))
    theirs = load_recipe(ROOT / "recipes" / "bert_large.yaml", ["optimizer.name=onebit_adam"])
    assert ours.optimizer.name == "onebit_adam" and ours.optimizer.freeze_step == 23_000
    for f in ("lr", "betas", "eps", "weight_decay", "bias_correction", "allreduce_dtype"):
        assert getattr(ours.optimizer, f) == getattr(theirs.optimizer, f), f
    assert bits_per_param(ours)["onebit_adam"] == bits_per_param(theirs)["onebit_adam"]


def test_changed_meanings_are_commented():
    lines = {line.split(":")[0].strip(): line for line in convert(ZERO_ONE, "bert-large").splitlines() if not line.lstrip().startswith("#")}
    for key in ("local_steps", "local_step_scaler", "var_freeze_step", "bias_correction", "update_clip", "grad_clip", "allreduce_dtype"):
        assert "#" in lines[key], key
    text = convert(ZERO_ONE, "bert-large")
    assert "cuda_aware: no effect" in text and "comm_backend_name: no effect" in text and "freeze_step is 1-bit Adam's" in text


def write(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return path


def with_changes(**top) -> dict:
    config = json.loads(ZERO_ONE.read_text())
    config.update(top)
    return config


def test_local_step_clipper_is_renamed_and_warmup_lr_maps(tmp_path):
    config = with_changes(
        scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 4e-4, "warmup_num_steps": 100, "warmup_type": "linear"}}
    )
    config["optimizer"]["params"]["local_step_clipper"] = 8
    recipe = yaml.safe_load(convert(write(tmp_path, config)))
    assert recipe["optimizer"]["local_step_clip"] == 8 and "local_step_clipper" not in recipe["optimizer"]
    assert recipe["schedule"] == {"name": "exponential", "warmup_steps": 100, "decay_factor": 1.0}


def test_flat_one_cycle_maps_to_constant(tmp_path):
    params = {"cycle_min_lr": 2e-4, "cycle_max_lr": 2e-4, "cycle_momentum": False, "cycle_first_step_size": 1000}
    recipe = yaml.safe_load(convert(write(tmp_path, with_changes(scheduler={"type": "OneCycle", "params": params}))))
    assert recipe["schedule"] == {"name": "constant"} and recipe["optimizer"]["lr"] == 2e-4


REFUSED = {
    "zero stage 2": (dict(zero_optimization={"stage": 2}), "zero_optimization.stage 2"),
    "offload": (dict(zero_optimization={"stage": 0, "offload_optimizer": {"device": "cpu"}}), "zero_optimization.offload_optimizer"),
    "pipeline": (dict(pipeline={"stages": 2}), "pipeline"),
    "tensor parallel": (dict(tensor_parallel={"tp_size": 2}), "tensor_parallel"),
    "activation checkpointing": (dict(activation_checkpointing={"partition_activations": True}), "activation_checkpointing"),
    "amp": (dict(amp={"enabled": True}), "amp"),
    "unknown key": (dict(hybrid_engine={"enabled": True}), "hybrid_engine"),
    "auto": (dict(train_batch_size="auto"), "train_batch_size"),
    "static loss scale": (dict(fp16={"enabled": True, "loss_scale": 128}), "fp16.loss_scale"),
    "WarmupDecayLR": (dict(scheduler={"type": "WarmupDecayLR", "params": {"total_num_steps": 10}}), "WarmupDecayLR"),
    "OneCycle": (dict(scheduler={"type": "OneCycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": 1e-3}}), "OneCycle"),
    "OneCycle momentum": (dict(scheduler={"type": "OneCycle", "params": {"cycle_min_lr": 4e-4, "cycle_max_lr": 4e-4}}), "cycle_momentum"),
    "log warm-up": (dict(scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 10}}), "warmup_type"),
    "unknown optimizer": (dict(optimizer={"type": "OneBitLamb", "params": {}}), "OneBitLamb"),
    "amsgrad": (dict(optimizer={"type": "ZeroOneAdam", "params": {"amsgrad": True}}), "amsgrad"),
    "freeze_step on 0/1 Adam": (dict(optimizer={"type": "ZeroOneAdam", "params": {"freeze_step": 10}}), "freeze_step"),
    "L2 Adam": (dict(optimizer={"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.01}}), "adam_w_mode"),
    "no micro batch": (dict(train_micro_batch_size_per_gpu=None), "train_micro_batch_size_per_gpu"),
}


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_keys_that_cannot_map_are_refused_by_name(tmp_path, case):
    changes, named = REFUSED[case]
    config = with_changes(**changes)
    config = {k: v for k, v in config.items() if v is not None}
    with pytest.raises(UserError) as refused:
        convert(write(tmp_path, config))
    message = str(refused.value)
    assert named in message and message.endswith(".") and "\n" not in message


def test_adam_config_maps_to_adam_with_deepspeed_bias_correction(tmp_path):
    recipe = yaml.safe_load(convert(write(tmp_path, with_changes(optimizer={"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}))))
    assert recipe["optimizer"]["name"] == "adam" and recipe["optimizer"]["bias_correction"] is True


def test_cli_bad_input_exits_2_with_one_sentence(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "adagrad.json").write_text(json.dumps(with_changes(optimizer={"type": "Adagrad"})))
    for args, named in (
        (["convert-deepspeed", str(tmp_path / "missing.json")], "does not exist"),
        (["convert-deepspeed", str(tmp_path / "bad.json")], "is not a JSON DeepSpeed config"),
        (["convert-deepspeed", str(tmp_path / "adagrad.json")], "'Adagrad' has no zoa-train counterpart"),
    ):
        refused(zoa(*args), named)


def test_cli_out_is_not_overwritten_without_overwrite(tmp_path):
    out = tmp_path / "recipe.yaml"
    out.write_text("mine\n")
    refused(zoa("convert-deepspeed", str(ZERO_ONE), "--out", str(out)), "--overwrite")
    assert out.read_text() == "mine\n"
    done = zoa("convert-deepspeed", str(ZERO_ONE), "--out", str(out), "--overwrite", "--set", "train.steps=10")
    assert done.returncode == 0, done.stderr
    assert load_recipe(out).train.steps == 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]  # no temporary file left


def assert_same(a, b) -> None:
    """Equal state dicts: tensors by value, everything else by ==."""
    if isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def test_from_deepspeed_builds_the_direct_constructors_optimizer():
    ds = json.loads(ZERO_ONE.read_text())["optimizer"]["params"]
    ours = ZeroOneAdam.from_deepspeed(model().parameters(), **ds, local_step_clipper=8)
    direct = ZeroOneAdam(
        model().parameters(),
        lr=4e-4,
        weight_decay=0.01,
        bias_correction=False,
        var_freeze_step=12500,
        local_steps="steps",
        local_step_scaler=32678,
        local_step_clip=8,
    )
    assert ours.param_groups[0].keys() == direct.param_groups[0].keys()
    assert {k: v for k, v in ours.param_groups[0].items() if k != "params"} == {k: v for k, v in direct.param_groups[0].items() if k != "params"}
    assert vars(ours.schedule) == vars(direct.schedule)
    assert_same(ours.state_dict(), direct.state_dict())

    ds = {**json.loads(ONEBIT.read_text())["optimizer"]["params"], "bias_correction": True, "eps_inside_sqrt": True}
    onebit = OneBitAdam.from_deepspeed(model().parameters(), **ds)
    direct = OneBitAdam(model().parameters(), lr=4e-4, weight_decay=0.01, freeze_step=23000, bias_correction=False)
    # DeepSpeed never corrects bias, so from_deepspeed does not either, whatever the library's default (on)
    assert (
        onebit.freeze_step == 23000 and onebit.param_groups[0]["bias_correction"] is False and registry.library_default(OneBitAdam, "bias_correction") is True
    )
    assert {k: v for k, v in onebit.param_groups[0].items() if k != "params"} == {k: v for k, v in direct.param_groups[0].items() if k != "params"}
    assert_same(onebit.state_dict(), direct.state_dict())


@pytest.mark.parametrize(
    "params, named", [({"lrr": 1.0}, "lrr"), ({"amsgrad": True}, "amsgrad"), ({"max_grad_norm": 1.0}, "max_grad_norm"), ({"freeze_step": 5}, "freeze_step")]
)
def test_from_deepspeed_refuses_what_cannot_map(params, named):
    with pytest.raises(UserError, match=named):
        ZeroOneAdam.from_deepspeed(model().parameters(), **params)


def test_from_deepspeed_only_where_deepspeed_has_the_algorithm():
    with pytest.raises(TypeError, match="no DeepSpeed counterpart"):
        DataParallelAdam.from_deepspeed(model().parameters(), lr=1e-3)
