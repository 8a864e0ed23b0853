"""`zoa-train convert-deepspeed`: a DeepSpeed config (OneBitAdam, ZeroOneAdam, Adam/AdamW) as a zoa-train recipe.

Every key of the config either maps (a comment on each line whose meaning changed), is said to have no
effect here (a comment naming it), or is refused with one sentence naming the key and why: nothing is
dropped silently. The optimizer's parameter names come from zoa_train.optim.deepspeed_names, the table
the optimizers' from_deepspeed classmethods read. docs/from-deepspeed.md has the whole mapping.
"""

import json
import os
import tempfile
from pathlib import Path

import yaml

from zoa_train.config import apply_override, recipe_from_dict
from zoa_train.errors import UserError
from zoa_train.files import check_output_file, load_json, make_directory
from zoa_train.models import registry as models
from zoa_train.optim.deepspeed_names import PARAMS, ZOA_OPTIMIZER, optimizer_key, translate

_SPLITTING = "zoa-train is data-parallel only: every rank holds the whole model and optimizer state, which 1-bit and 0/1 Adam need"
# Top-level keys that cannot map, and why.
REFUSED = {
    "pipeline": _SPLITTING,
    "pipeline_parallel_size": _SPLITTING,
    "tensor_parallel": _SPLITTING,
    "sequence_parallel_size": _SPLITTING,
    "activation_checkpointing": "zoa-train has no activation checkpointing",
    "amp": "zoa-train's fp16 is torch autocast with its own loss scaler, not NVIDIA Apex (use fp16 instead)",
    "sparse_gradients": "the 1-bit optimizers refuse sparse gradients",
    "elasticity": "zoa-train keeps the global batch fixed; a changed number of ranks is a --resume --reshard (docs/faults.md)",
    "curriculum_learning": "zoa-train has no curriculum or data-efficiency scheduling",
    "data_efficiency": "zoa-train has no curriculum or data-efficiency scheduling",
    "compression_training": "zoa-train compresses communication, not the model",
    "zero_force_ds_cpu_optimizer": "zoa-train has no CPU optimizer offload",
}
# Top-level keys that only change DeepSpeed's printouts, monitors or the order of a division.
NO_EFFECT = {
    "wall_clock_breakdown": "DeepSpeed's timing printouts",
    "memory_breakdown": "DeepSpeed's memory printouts",
    "dump_state": "DeepSpeed's state printout",
    "zero_allow_untested_optimizer": "only matters with ZeRO",
    "prescale_gradients": "the same average, divided before or after the sum",
    "gradient_predivide_factor": "the same average, divided before or after the sum",
    "flops_profiler": "DeepSpeed's profiler",
    "comms_logger": "DeepSpeed's communication log; zoa-train logs every step's bytes (metrics.jsonl)",
    "tensorboard": "DeepSpeed's monitor; set logging.tensorboard",
    "wandb": "DeepSpeed's monitor; set logging.wandb and logging.project",
    "csv_monitor": "DeepSpeed's monitor; zoa-train writes metrics.jsonl",
}
MAPPED = {
    "optimizer",
    "scheduler",
    "fp16",
    "bf16",
    "gradient_clipping",
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "steps_per_print",
    "communication_data_type",
    "zero_optimization",
}
_FP16_SCALER = {"loss_scale_window", "initial_scale_power", "hysteresis", "consecutive_hysteresis", "min_loss_scale", "auto_cast"}
_DTYPES = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16", "float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


class _Recipe:
    """Sections of (key -> value, comment) and comment lines, in the order they are written."""

    def __init__(self):
        self.sections: dict[str, dict[str, tuple[object, str]]] = {}
        self.notes: dict[str, list[str]] = {}

    def set(self, section: str, key: str, value, comment: str = "") -> None:
        self.sections.setdefault(section, {})[key] = (value, comment)

    def note(self, section: str, text: str) -> None:
        self.sections.setdefault(section, {})
        self.notes.setdefault(section, []).append(text)

    def data(self) -> dict:
        return {s: {k: v for k, (v, _) in keys.items()} for s, keys in self.sections.items()}

    def text(self, header: list[str]) -> str:
        lines = [f"# {h}" for h in header]
        for section, keys in self.sections.items():
            lines.append(f"{section}:")
            lines += [f"  # {n}" for n in self.notes.get(section, [])]
            for key, (value, comment) in keys.items():
                lines.append(f"  {key}: {_scalar(value)}" + (f"  # {comment}" if comment else ""))
        return "\n".join(lines) + "\n"


def _scalar(value) -> str:
    """One YAML value as this recipe writes it: floats always with a dot (YAML 1.1 reads 1e-08 as a string)."""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_scalar(v) for v in value) + "]"
    if isinstance(value, float):
        text = repr(value)
        mantissa, e, exponent = text.partition("e")
        return f"{mantissa if '.' in mantissa else mantissa + '.0'}{e}{exponent}"
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()


def read_config(path: Path) -> dict:
    """A DeepSpeed config file as a mapping; one sentence if it is missing or not JSON."""
    if not path.is_file():
        raise UserError(f"DeepSpeed config {path} does not exist.")
    try:
        data = load_json(path.read_text(encoding="utf-8"), str(path))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        where = f" at line {e.lineno}" if isinstance(e, json.JSONDecodeError) else ""
        raise UserError(f"{path} is not a JSON DeepSpeed config{where}.") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} must hold a JSON object of DeepSpeed settings.")
    _refuse_auto(data, path, "")
    return data


def _refuse_auto(node, path: Path, prefix: str) -> None:
    """Hugging Face's Trainer fills in "auto"; here there is nothing to fill it from."""
    for key, value in node.items():
        if value == "auto":
            raise UserError(f'{path}: {prefix}{key} is "auto", which Hugging Face\'s Trainer fills in; write the number.')
        if isinstance(value, dict):
            _refuse_auto(value, path, f"{prefix}{key}.")


def parse_model(model: str) -> dict:
    """--model KIND or KIND-SIZE (gpt2, gpt2-medium, bert-large, llama-1B, resnet50) as a recipe's model section."""
    kind, _, size = model.partition("-")
    spec = models.find(kind)
    if spec is None or (size and size not in spec.presets):
        sized = [k for k in models.names() if models.get(k).presets]
        raise UserError(
            f"--model must be one of {', '.join(models.names())}, with a size for {', '.join(sized)} (e.g. bert-large, gpt2-medium, llama-1B), not {model!r}."
        )
    return {"kind": kind, **({"size": size} if size else {})}


def convert(config_path: str | Path, model: str = "bert-large", overrides: list[str] = ()) -> str:
    """The recipe YAML for a DeepSpeed config, with a comment on every line whose meaning changed and
    on every DeepSpeed key that has no effect here; checked by loading it as a recipe. `overrides` are
    `--set section.key=value`, for what a DeepSpeed config does not hold (train.steps, a schedule that
    the training script set itself). A key that cannot map is a UserError naming it."""
    path = Path(config_path)
    ds = read_config(path)
    for key in ds:
        if key in REFUSED:
            raise UserError(f"{path}: {key} cannot map: {REFUSED[key]}.")
        if key not in MAPPED and key not in NO_EFFECT:
            raise UserError(f"{path}: {key} has no zoa-train counterpart that convert-deepspeed knows (docs/from-deepspeed.md lists those that map).")
    r = _Recipe()
    for key, value in parse_model(model).items():
        r.set("model", key, value, "not in a DeepSpeed config: --model")
    if "optimizer" not in ds or not isinstance(ds["optimizer"], dict) or "type" not in ds["optimizer"]:
        raise UserError(f"{path} has no optimizer.type; convert-deepspeed converts OneBitAdam, ZeroOneAdam, Adam and AdamW configs.")
    _optimizer(ds, path, r)
    _schedule(ds, path, r)
    _train(ds, path, r)
    for key in ds:
        if key in NO_EFFECT:
            r.note("train", f"DeepSpeed's {key}: no effect here ({NO_EFFECT[key]}).")
    data = r.data()
    for override in overrides:
        section, _, rest = override.partition(".")
        apply_override(data, override)
        key = rest.partition("=")[0].strip()
        if section in data and isinstance(data[section], dict) and key in data[section]:
            r.set(section, key, data[section][key], "--set")
    recipe_from_dict(r.data(), f"the recipe converted from {path}")  # the written recipe loads, or one sentence why not
    header = [
        f"Converted from the DeepSpeed config {path} by zoa-train convert-deepspeed (docs/from-deepspeed.md).",
        "A comment marks every value whose meaning changed.",
    ]
    return r.text(header)


def _optimizer(ds: dict, path: Path, r: _Recipe) -> None:
    opt = ds["optimizer"]
    for key in opt:
        if key not in ("type", "params"):
            raise UserError(f"{path}: optimizer.{key} has no meaning in a DeepSpeed config's optimizer section (type and params).")
    key = optimizer_key(opt["type"], f"{path}: optimizer.type")
    params = opt.get("params") or {}
    if not isinstance(params, dict):
        raise UserError(f"{path}: optimizer.params must be a JSON object.")
    kwargs, notes = translate(key, params, f"{path}: optimizer.params")
    r.set("optimizer", "name", ZOA_OPTIMIZER[key], f"DeepSpeed's {opt['type']}")
    by_zoa = {}
    for ds_name in params:
        entry = PARAMS[key].get(ds_name)
        if entry is not None and entry.zoa:
            by_zoa[entry.zoa] = ds_name
    for zoa, value in kwargs.items():
        ds_name = by_zoa.get(zoa)
        comment = notes.get(ds_name, "") if ds_name else "DeepSpeed's behaviour where the config does not say"
        if zoa == "local_steps":
            comment = "DeepSpeed's rule for the sync interval (zoa-train's default is lr, the paper's)"
        if zoa == "bias_correction" and key in ("onebitadam", "zerooneadam"):
            comment = notes.get("bias_correction", "DeepSpeed's 1-bit optimizers never correct bias")
        if zoa == "weight_decay":
            comment = f"{comment}; a recipe decays matrices and kernels only" if comment else "a recipe decays matrices and kernels only"
        r.set("optimizer", zoa, list(value) if isinstance(value, tuple) else value, comment)
    for ds_name, note in notes.items():
        entry = PARAMS[key].get(ds_name)
        if (entry is None or entry.zoa is None) and ds_name != "bias_correction":
            r.note("optimizer", f"DeepSpeed's {ds_name}: no effect here: {note}.")
    if key == "zerooneadam":
        r.set("optimizer", "update_clip", 1.0, "zoa-train's own (DeepSpeed has none): m/d clipped before var_freeze_step; null reproduces DeepSpeed")
        r.note("optimizer", "freeze_step is 1-bit Adam's (full-precision steps); 0/1 Adam's variance stops at var_freeze_step, so none is written.")


def _schedule(ds: dict, path: Path, r: _Recipe) -> None:
    lr = r.sections["optimizer"].get("lr", (1e-3, ""))[0]
    sched = ds.get("scheduler")
    if sched is None:
        r.set(
            "schedule",
            "name",
            "constant",
            "no scheduler in the config: DeepSpeed keeps lr constant unless the script sets it (the authors' bing_bert script did); --set schedule.*",
        )
        return
    kind, params = sched.get("type"), sched.get("params") or {}
    if kind in ("WarmupLR", "WarmupCosineLR"):
        if params.get("warmup_type", "log") != "linear":
            raise UserError(f'{path}: scheduler.params.warmup_type {params.get("warmup_type", "log")!r} cannot map: zoa-train warms up linearly; set "linear".')
        if params.get("warmup_min_lr", 0) or params.get("warmup_min_ratio", 0):
            raise UserError(f"{path}: scheduler.params warmup_min_lr cannot map: zoa-train warms up from 0; set it to 0.")
        steps = params.get("warmup_num_steps", 1000)
    if kind == "WarmupLR":
        max_lr = params.get("warmup_max_lr", 0.001)
        if max_lr != lr:
            r.set("optimizer", "lr", max_lr, "scheduler.params.warmup_max_lr (DeepSpeed's scheduler sets the lr)")
        # zoa-train's constant schedule has no warm-up; exponential with factor 1 is the warm-up alone.
        r.set("schedule", "name", "exponential", "DeepSpeed's WarmupLR: linear warm-up, then constant (decay_factor 1)")
        r.set("schedule", "warmup_steps", steps, "scheduler.params.warmup_num_steps")
        r.set("schedule", "decay_factor", 1.0)
    elif kind == "WarmupCosineLR":
        r.set("schedule", "name", "cosine", "DeepSpeed's WarmupCosineLR")
        r.set("schedule", "warmup_steps", steps, "scheduler.params.warmup_num_steps")
        r.set("schedule", "min_lr", lr * params.get("cos_min_ratio", 0.0001), "scheduler.params.cos_min_ratio x lr")
        if "total_num_steps" not in params:
            raise UserError(f"{path}: scheduler.params.total_num_steps is missing; WarmupCosineLR needs it (it becomes train.steps).")
        r.set("train", "steps", params["total_num_steps"], "scheduler.params.total_num_steps")
    elif kind == "WarmupDecayLR":
        raise UserError(
            f"{path}: scheduler.type WarmupDecayLR cannot map: it decays linearly to 0, and zoa-train's schedules are constant, exponential and cosine."
        )
    elif kind == "OneCycle":
        _one_cycle(params, path, r)
    else:
        raise UserError(
            f"{path}: scheduler.type {kind!r} cannot map: zoa-train's schedules are constant, exponential and cosine (from WarmupLR and WarmupCosineLR)."
        )


def _one_cycle(params: dict, path: Path, r: _Recipe) -> None:
    """OneCycle maps only where it does not cycle: a flat lr (cycle_min_lr = cycle_max_lr, no decay) and
    no momentum cycle (cycle_momentum false), which is the constant schedule; any other is refused."""
    low, high = params.get("cycle_min_lr"), params.get("cycle_max_lr")
    if low is None or low != high or params.get("decay_lr_rate", 0.0):
        raise UserError(
            f"{path}: scheduler.type OneCycle cannot map unless cycle_min_lr equals cycle_max_lr and decay_lr_rate is 0: "
            "it cycles the lr and then decays it as 1/(1 + rate t), none of zoa-train's schedules."
        )
    if params.get("cycle_momentum", True):
        raise UserError(f"{path}: scheduler.params.cycle_momentum (OneCycle's default, true) cannot map: zoa-train keeps beta1 fixed; set it false.")
    r.set("optimizer", "lr", high, "scheduler.params.cycle_max_lr (DeepSpeed's scheduler sets the lr)")
    r.set("schedule", "name", "constant", "DeepSpeed's OneCycle with cycle_min_lr = cycle_max_lr, no decay and no momentum cycle: a constant lr")


def _train(ds: dict, path: Path, r: _Recipe) -> None:
    global_batch, micro = ds.get("train_batch_size"), ds.get("train_micro_batch_size_per_gpu")
    if global_batch is None or micro is None:
        raise UserError(f"{path}: a recipe needs train_batch_size and train_micro_batch_size_per_gpu (its global and per-rank batch); give both.")
    r.set("train", "global_batch_size", global_batch, "train_batch_size")
    r.set("train", "micro_batch_size", micro, "train_micro_batch_size_per_gpu")
    accumulation = ds.get("gradient_accumulation_steps")
    if accumulation is not None:
        ranks, left = divmod(global_batch, micro * accumulation)
        if left or not ranks:
            raise UserError(f"{path}: train_batch_size {global_batch} is not train_micro_batch_size_per_gpu x gradient_accumulation_steps x a number of ranks.")
        r.set("train", "nproc", ranks, f"gradient_accumulation_steps {accumulation} implies {ranks} ranks; zoa-train derives the accumulation from the ranks")
    fp16, bf16 = (ds.get(k) or {} for k in ("fp16", "bf16"))
    if fp16.get("enabled") and bf16.get("enabled"):
        raise UserError(f"{path}: fp16 and bf16 are both enabled; a run trains in one precision.")
    for name, section in (("fp16", fp16), ("bf16", bf16)):
        if not section.get("enabled"):
            continue
        if name == "fp16" and section.get("loss_scale", 0):
            raise UserError(f"{path}: fp16.loss_scale {section['loss_scale']} cannot map: zoa-train's fp16 loss scale is dynamic (DeepSpeed's loss_scale 0).")
        r.set("train", "precision", name, f"{name}.enabled")
        r.set("optimizer", "allreduce_dtype", name, f"DeepSpeed averages {name} gradients in {name} on full-precision steps")
        rest = sorted(set(section) - {"enabled", "loss_scale"})
        if rest:
            r.note("train", f"DeepSpeed's {name}.{', '.join(rest)}: no effect here (zoa-train's loss scaler keeps its own settings).")
    if "communication_data_type" in ds:
        dtype = _DTYPES.get(str(ds["communication_data_type"]).lower())
        if dtype is None:
            raise UserError(f"{path}: communication_data_type {ds['communication_data_type']!r} cannot map: allreduce_dtype is fp32, fp16 or bf16.")
        r.set("optimizer", "allreduce_dtype", dtype, "communication_data_type: the full-precision collectives")
    if "gradient_clipping" in ds:
        r.set("train", "grad_clip", float(ds["gradient_clipping"]), "gradient_clipping; zoa-train clips each rank's own gradient")
    if "steps_per_print" in ds:
        r.set("train", "log_every", ds["steps_per_print"], "steps_per_print")
    zero = ds.get("zero_optimization")
    if zero is not None:
        stage = zero.get("stage", 0) if isinstance(zero, dict) else zero
        if stage:
            raise UserError(f"{path}: zero_optimization.stage {stage} cannot map: {_SPLITTING}.")
        for key in ("offload_optimizer", "offload_param", "cpu_offload"):
            if isinstance(zero, dict) and zero.get(key):
                raise UserError(f"{path}: zero_optimization.{key} cannot map: zoa-train keeps the optimizer state and parameters on the device.")
        r.note("train", "DeepSpeed's zero_optimization stage 0: no effect here (plain data parallelism, as zoa-train).")
    r.sections["train"].setdefault("steps", (1000, ""))
    if r.sections["train"]["steps"][1] == "":
        r.set("train", "steps", 1000, "not in a DeepSpeed config (the script decides): --set train.steps=N")


def write_recipe(text: str, out: Path, overwrite: bool = False) -> None:
    """Write the recipe to `out` atomically (a temporary file beside it, then renamed); an existing
    file is replaced only with `overwrite`."""
    if out.is_dir():
        raise UserError(f"--out {out} is a directory; name the recipe file to write.")
    if out.exists() and not overwrite:
        raise UserError(f"{out} exists already: pass --overwrite to replace it.")
    check_output_file(out, "--out")
    make_directory(out.parent, "the directory of --out")
    fd, staged = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        if overwrite:
            os.replace(staged, out)
        else:
            os.link(staged, out)  # fails if the file appeared meanwhile: never replaced without --overwrite
            os.unlink(staged)
    except FileExistsError:
        os.unlink(staged)
        raise UserError(f"{out} exists already: pass --overwrite to replace it.") from None
    except BaseException:
        if os.path.exists(staged):
            os.unlink(staged)
        raise
