"""DeepSpeed's optimizer parameter names mapped onto zoa-train's: the one table that
DataParallelOptimizer.from_deepspeed (ZeroOneAdam, OneBitAdam) and `zoa-train convert-deepspeed` read.

Facts from DeepSpeed's own classes (deepspeed/runtime/fp16/onebit/adam.py, zoadam.py, ops/adam):
OnebitAdam and ZeroOneAdam store bias_correction, eps_inside_sqrt and max_grad_norm and never use
them (their steps are uncorrected, eps outside the square root), and refuse amsgrad; cuda_aware and
comm_backend_name only pick DeepSpeed's transport. FusedAdam (type Adam/AdamW) corrects bias by default.
"""

from collections.abc import Mapping
from dataclasses import dataclass

from zoa_train.errors import UserError


@dataclass(frozen=True)
class Name:
    """One DeepSpeed parameter: zoa-train's keyword (None: it has no effect here) and, where the meaning
    changed or it has no effect, what to say about it."""

    zoa: str | None
    note: str = ""


_TRANSPORT = "picks DeepSpeed's transport (MPI, NCCL, compressed); zoa-train communicates through torch.distributed (train.backend), so it has no meaning here"
_UNUSED_BIAS = "DeepSpeed's 1-bit optimizers read bias_correction and never apply it (their steps are uncorrected), so zoa-train's is false whatever it says"

_ONEBIT_COMMON = {
    "lr": Name("lr"),
    "betas": Name("betas"),
    "eps": Name("eps"),
    "weight_decay": Name("weight_decay", "decoupled in both (DeepSpeed adds wd*p to the update)"),
    "bias_correction": Name(None, _UNUSED_BIAS),
    "eps_inside_sqrt": Name(None, "DeepSpeed's 1-bit optimizers read it and never use it (eps is outside the square root, as here)"),
    "cuda_aware": Name(None, _TRANSPORT),
    "comm_backend_name": Name(None, _TRANSPORT),
}

PARAMS: dict[str, dict[str, Name]] = {
    "onebitadam": {**_ONEBIT_COMMON, "freeze_step": Name("freeze_step", "the same: full-precision steps before 1-bit compression starts")},
    "zerooneadam": {
        **_ONEBIT_COMMON,
        "var_freeze_step": Name("var_freeze_step", "the same: the last step that may update the variance (not 1-bit Adam's freeze_step)"),
        "var_update_scaler": Name("var_update_scaler"),
        "local_step_scaler": Name(
            "local_step_scaler",
            "with local_steps: steps, DeepSpeed's rule (the sync interval doubles every local_step_scaler steps after var_freeze_step); "
            "zoa-train's default, lr, doubles it as the lr halves instead",
        ),
        "local_step_clipper": Name("local_step_clip", "DeepSpeed's local_step_clipper renamed: H, the largest sync interval"),
    },
    "adam": {
        "lr": Name("lr"),
        "betas": Name("betas"),
        "eps": Name("eps"),
        "weight_decay": Name("weight_decay", "decoupled (AdamW)"),
        "bias_correction": Name("bias_correction", "DeepSpeed's FusedAdam corrects bias unless told not to; so does zoa-train's adam when true"),
        "adam_w_mode": Name(None, "zoa-train's weight decay is always decoupled, as adam_w_mode true"),
        "torch_adam": Name(None, "picks DeepSpeed's Adam implementation; zoa-train's adam is torch's AdamW"),
    },
}
PARAMS["adamw"] = PARAMS["adam"]

# What DeepSpeed's class does where the parameter is not given, when it differs from zoa-train's default.
DEEPSPEED_DEFAULTS = {"onebitadam": {}, "zerooneadam": {"local_steps": "steps"}, "adam": {"bias_correction": True}, "adamw": {"bias_correction": True}}

# Accepted only at DeepSpeed's default (which does nothing); any other value is refused with the reason.
_ONLY_DEFAULT = {
    "amsgrad": (False, "0/1 Adam, 1-bit Adam and zoa-train's adam have no AMSGrad variant (DeepSpeed refuses it too)"),
    "max_grad_norm": (0, "DeepSpeed ignores it (its engine refuses it in a config); clip gradients with gradient_clipping, train.grad_clip in a recipe"),
}

TYPES = {"onebitadam": "OneBitAdam", "zerooneadam": "ZeroOneAdam", "adam": "Adam", "adamw": "AdamW"}
ZOA_OPTIMIZER = {"onebitadam": "onebit_adam", "zerooneadam": "zero_one_adam", "adam": "adam", "adamw": "adam"}


def optimizer_key(type_name: object, where: str = "optimizer.type") -> str:
    """DeepSpeed's optimizer type (case does not matter, as in DeepSpeed) as a key of PARAMS."""
    key = str(type_name).lower()
    if key not in PARAMS:
        raise UserError(f"{where} {type_name!r} has no zoa-train counterpart; the types that map are {', '.join(TYPES.values())}.")
    return key


def translate(type_name: str, params: Mapping, where: str = "optimizer.params") -> tuple[dict, dict[str, str]]:
    """zoa-train's keyword arguments for DeepSpeed's optimizer `type_name` built with `params`, and a
    note for each given DeepSpeed name whose meaning changed or that has no effect. A parameter DeepSpeed
    does not take, or one that cannot map, is a UserError of one sentence."""
    key = optimizer_key(type_name)
    table = PARAMS[key]
    kwargs = dict(DEEPSPEED_DEFAULTS[key])
    notes = {}
    for name, value in params.items():
        if name in _ONLY_DEFAULT:
            default, why = _ONLY_DEFAULT[name]
            if value != default:
                raise UserError(f"{where}.{name} {value!r} cannot map: {why}.")
            notes[name] = "no effect at its default"
            continue
        if key == "adam" and name == "adam_w_mode" and value is False and params.get("weight_decay", 0):
            raise UserError(f"{where}.adam_w_mode false with weight_decay is Adam's L2 penalty, which zoa-train does not have (its weight decay is decoupled).")
        if name not in table:
            hint = "; 0/1 Adam's variance freezes at var_freeze_step" if (key, name) == ("zerooneadam", "freeze_step") else ""
            raise UserError(f"{where}.{name} is not a parameter of DeepSpeed's {TYPES[key]}, so it cannot map{hint}.")
        entry = table[name]
        if entry.zoa is not None:
            kwargs[entry.zoa] = tuple(value) if name == "betas" else value
        if entry.note:
            notes[name] = entry.note
    if key in ("onebitadam", "zerooneadam"):
        kwargs["bias_correction"] = False  # what DeepSpeed runs, whatever the config says
    return kwargs, notes
